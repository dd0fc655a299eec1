"""Fixtures of the end-to-end tests: a running cluster on the test database, and its cast."""

from __future__ import annotations

import os

import pytest

from tests.e2e.cluster import Cluster

REDIS_DB = int(os.environ.get("NIGHTWATCH_E2E_REDIS_DB", "14"))


@pytest.fixture
def cluster(transactional_db, tmp_path, request):
    """Control plane + worker (with beat) against the test database; agents are started by tests.

    Parametrized indirectly with a dict, that dict is added to the processes' environment
    (``@pytest.mark.parametrize("cluster", [{"NIGHTWATCH_X": "1"}], indirect=True)``)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.fail("end-to-end tests need PostgreSQL and Redis: run them through `make test`")
    c = Cluster(tmp_path, database_name=connection.settings_dict["NAME"], redis_db=REDIS_DB,
                settings=getattr(request, "param", None))
    try:
        c.start_web()
        c.start_worker()
        yield c
    finally:
        c.close()
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            print(c.dump_logs())


@pytest.fixture
def tokens(transactional_db):
    """An operator, an on-call person, and bootstrap tokens for agents, as raw strings."""
    from django.contrib.auth.models import Group, User

    from core.models import ApiToken

    def person(name, role):
        user = User.objects.create_user(name)
        user.groups.add(Group.objects.get(name=role))
        return user

    _, operator = ApiToken.issue(name="ops", scope="operator", user=person("otto", "operator"))
    _, oncall = ApiToken.issue(name="pager", scope="oncall", user=person("olga", "oncall"))

    def bootstrap():
        return ApiToken.issue(name="boot", scope="bootstrap", single_use=True)[1]

    return {"operator": operator, "oncall": oncall, "bootstrap": bootstrap}
