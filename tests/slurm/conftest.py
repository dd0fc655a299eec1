"""Fixtures of the Slurm tests: one real Slurm cluster per session, and a control plane per test."""

from __future__ import annotations

import os

import pytest

from tests.slurm.slurmcluster import SlurmCluster, missing


@pytest.fixture(scope="session")
def slurm_cluster():
    why = missing()
    if why:
        pytest.fail(why)
    cluster = SlurmCluster()
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)  # the adapter, called in the test process, finds it
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before


@pytest.fixture
def slurm(slurm_cluster, settings, tmp_path):
    """The session's cluster, with its node idle and undrained, and Nightwatch's Slurm settings on."""
    slurm_cluster.command("scontrol", "update", f"nodename={'localhost'}", "state=resume", check=False)
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "SLURM": {**settings.NIGHTWATCH["SLURM"], "ENABLED": True,
                                                             "LOG_DIR": str(tmp_path / "slurm-logs")}}
    return slurm_cluster


@pytest.fixture
def control_plane(slurm, transactional_db, tmp_path, request):
    """daphne + a Celery worker with beat, the Slurm transport on, polling Slurm every second."""
    from django.db import connection

    from tests.e2e.cluster import Cluster
    from tests.e2e.conftest import REDIS_DB

    if connection.vendor != "postgresql":
        pytest.fail("the Slurm end-to-end tests need PostgreSQL and Redis: run them through `make test`")
    cluster = Cluster(tmp_path, database_name=connection.settings_dict["NAME"], redis_db=REDIS_DB, settings={
        "NIGHTWATCH_SLURM_ENABLED": "1", "NIGHTWATCH_SLURM_POLL_INTERVAL_S": "1",
        "NIGHTWATCH_SLURM_LOG_DIR": str(tmp_path / "slurm-logs"), "SLURM_CONF": str(slurm.conf)})
    try:
        cluster.start_web()
        cluster.start_worker()
        yield cluster
    finally:
        cluster.close()
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            print(cluster.dump_logs())
            print(_job_outputs(tmp_path / "slurm-logs"))


def _job_outputs(directory, limit: int = 3000) -> str:
    """The end of every batch job's output: why a generation ended is there, not in the logs."""
    outputs = sorted(directory.rglob("*.out")) if directory.is_dir() else []
    return "\n".join(f"===== {path.relative_to(directory)} =====\n{path.read_text(errors='replace')[-limit:]}"
                     for path in outputs) or f"===== no batch output under {directory} ====="


@pytest.fixture
def operator_token(transactional_db):
    from django.contrib.auth.models import Group, User

    from core.models import ApiToken

    user = User.objects.create_user("otto")
    user.groups.add(Group.objects.get(name="operator"))
    return ApiToken.issue(name="ops", scope="operator", user=user)[1]
