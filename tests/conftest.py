"""The cast every control-plane test shares: people in each role, tokens of each scope, two nodes
and a job — built inline, small and named (like healthchecks' ``hc/test.py``).

Tests of ``agents/`` (hooks, agent) keep their fixtures in their own folders and never touch Django's
database fixtures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


@dataclass
class Cast:
    viewer: object
    operator: object
    oncall: object
    ci_user: object
    tokens: dict  # name -> raw token
    node1: object
    node2: object
    job: object


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (``item.rep_call``): fixtures that start real
    processes print their logs when the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


#: The folders whose tests hash the cast's passwords cheaply (``fast_password_hashing``): their
#: servers, where they start one, run in the test's process and settings.
CHEAP_HASH_FOLDERS = frozenset({"alerts", "api", "checkpoints", "core", "dashboard", "jobs", "nodes"})


@pytest.fixture(autouse=True)
def _cheap_hashes(request):
    """Cheap hashes for the cast in ``CHEAP_HASH_FOLDERS``, except in end-to-end tests: a real
    server (a browser's, an agent's) checks passwords with the production hashers."""
    folder = Path(str(request.node.path)).relative_to(TESTS).parts[0]
    if folder in CHEAP_HASH_FOLDERS and request.node.get_closest_marker("e2e") is None:
        request.getfixturevalue("fast_password_hashing")


@pytest.fixture(autouse=True)
def fleet_counted_afresh():
    """Heartbeat pacing counts the fleet once per ``FLEET_COUNT_TTL_S`` in a process: a test's
    1,500 nodes must not stretch the next test's heartbeat interval."""
    from nodes.services.fleet import forget_fleet_count

    forget_fleet_count()
    yield
    forget_fleet_count()


@pytest.fixture(autouse=True)
def command_watch_stopped():
    """A test that reached the command wait endpoint started the process's watch, whose thread
    holds a database connection: stopped after the test, so that the test database can go."""
    yield
    from nodes.services import wake

    wake.WATCH.stop()


@pytest.fixture(autouse=True)
def redis_not_skipped():
    """A test that made Redis fail must not leave it skipped (``core.degraded``'s short circuit) for
    the next test in the same process."""
    from core import degraded

    degraded.reset()
    yield
    degraded.reset()


@pytest.fixture
def cast(db):
    from django.contrib.auth.models import Group, User

    from core.models import ApiToken
    from jobs.models import Job
    from nodes.models import Node

    def person(name, role):
        user = User.objects.create_user(name, password=f"{name}-password-1")
        user.groups.add(Group.objects.get(name=role))
        return user

    viewer, operator, oncall = person("vera", "viewer"), person("otto", "operator"), person("olga", "oncall")
    ci_user = person("ci-bot", "operator")
    node1 = Node.objects.create(hostname="gpu-01", address="10.0.0.1", health="healthy")
    node2 = Node.objects.create(hostname="gpu-02", address="10.0.0.2", health="healthy", is_spare=True)
    tokens = {}
    for name, scope, kwargs in [
        ("viewer", "viewer", {"user": viewer}),
        ("operator", "operator", {"user": operator}),
        ("oncall", "oncall", {"user": oncall}),
        ("ci", "ci", {"user": ci_user}),
        ("agent", "agent", {"node": node1}),
        ("agent2", "agent", {"node": node2}),
        ("bootstrap", "bootstrap", {"single_use": True}),
    ]:
        _, tokens[name] = ApiToken.issue(name=name, scope=scope, **kwargs)
    job = Job.objects.create(name="llama-tiny", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             created_by="test")
    return Cast(viewer, operator, oncall, ci_user, tokens, node1, node2, job)


@pytest.fixture
def eager_celery():
    """Run tasks enqueued on commit (or with ``.delay``) inline, so a service's follow-up work happens in
    the test; retries run too, without their countdown."""
    from controlplane.celery import app

    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


@pytest.fixture
def fast_password_hashing(settings):
    """Cheap MD5 hashes: the cast's users get passwords, and PBKDF2 at production strength costs seconds
    per test on 2 cores. The folders in ``CHEAP_HASH_FOLDERS`` have it for every test but the
    end-to-end ones; a test whose real server checks a password must keep the real hashers (the
    server does not use the test's settings)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def api():
    """``api(token=None)`` -> a DRF client, authenticated with that raw token when given."""
    from rest_framework.test import APIClient

    def make(token: str | None = None):
        client = APIClient()
        if token:
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        return client

    return make
