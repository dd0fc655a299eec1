"""A worker that hangs mid-recovery is found by its liveness check and restarted, compose-style, and
the restarted worker finishes the recovery: exactly one new generation.

The supervision is the one docker-compose.yml and docs/deployment.md set up: the worker touches its
liveness file (``NIGHTWATCH_WORKER_LIVENESS_FILE``) and writes a pid file; a healthcheck runs
``python -m core.liveness FILE --max-age N --kill-pidfile PIDFILE``, which kills a worker whose file
went stale; the restart policy starts a new one when the old one exits. Beat runs as its own process
and survives the worker.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.cluster import Cluster, Proc, api, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

MAX_AGE_S = 3


class ComposeStyleWorker:
    """``restart: unless-stopped`` plus the liveness healthcheck, for one worker service."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.pidfile = cluster.tmp / "worker.pid"
        self.alive_file = cluster.env["NIGHTWATCH_WORKER_LIVENESS_FILE"]
        self.starts = 0
        self.proc: Proc | None = None
        self.verdicts: list[int] = []

    def start(self) -> None:
        self.starts += 1
        self.pidfile.unlink(missing_ok=True)
        self.proc = self.cluster._start_celery(f"worker{self.starts}", ["-Q", "celery,checkpoints",
                                                                        "--pidfile", str(self.pidfile)])
        wait_for(lambda: "ready." in self.proc.log() or not self.proc.alive, timeout=60, what="the worker to start")
        assert self.proc.alive, self.proc.log()

    def healthcheck(self) -> int:
        check = subprocess.run([sys.executable, "-m", "core.liveness", self.alive_file, "--max-age", str(MAX_AGE_S),
                                "--kill-pidfile", str(self.pidfile)], capture_output=True, text=True, timeout=30)
        self.verdicts.append(check.returncode)
        return check.returncode

    def supervise(self) -> None:
        """One turn of the supervisor: the healthcheck, then the restart policy."""
        self.healthcheck()
        if self.proc is not None and self.proc.popen.poll() is not None:
            self.proc.stop()  # reap it and whatever is left of its group
            self.start()


@pytest.fixture
def supervised(transactional_db, tmp_path, request):
    from django.db import connection

    from tests.e2e.conftest import REDIS_DB

    cluster = Cluster(tmp_path, database_name=connection.settings_dict["NAME"], redis_db=REDIS_DB, settings={
        "NIGHTWATCH_WORKER_LIVENESS_FILE": str(tmp_path / "worker.alive"), "NIGHTWATCH_WORKER_LIVENESS_S": "0.5",
        "NIGHTWATCH_HEARTBEAT_MISSES": "100"})
    worker = ComposeStyleWorker(cluster)
    try:
        cluster.start_web()
        cluster.procs["beat"] = Proc("beat", [sys.executable, "-m", "celery", "-A", "controlplane", "beat",
                                              "--loglevel=INFO", "-s", str(tmp_path / "beat-schedule")],
                                     env=cluster.env, log_dir=cluster.logs)
        worker.start()
        yield cluster, worker
    finally:
        cluster.close()
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            print(cluster.dump_logs())


def test_a_worker_hung_mid_recovery_is_restarted_by_its_liveness_check_and_the_next_one_finishes(supervised):
    from core.models import ApiToken
    from jobs.models import Generation, Incident, Job
    from nodes.models import Node

    cluster, worker = supervised
    node = Node.objects.create(hostname="node-w", address="127.0.0.1", health="healthy")
    _, agent = ApiToken.issue(name="agent", scope="agent", node=node)
    # The backoff holds the job in "recovering" long enough to hang the worker there.
    job = Job.objects.create(name="liveness", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             created_by="test", recovery_policy={"backoff_seconds": 6})
    wait_for(lambda: Generation.objects.filter(job=job, number=1).exists(), timeout=30, what="generation 1")
    assert worker.healthcheck() == 0, "a working worker is alive"

    exited = {"key": "exit-1", "kind": "exited", "job": str(job.pk), "generation": 1, "time": time.time(),
              "detail": {"exit_code": 1, "ranks": [{"rank": 0, "local_rank": 0, "signal": 9}]}}
    status, body = api(cluster, agent, "POST", f"/api/v1/nodes/{node.pk}/events", {"events": [exited]})
    assert status in (200, 202), body
    wait_for(lambda: Job.objects.get(pk=job.pk).state == "recovering", timeout=30, what="the recovery to start")
    hung_at = time.monotonic()
    worker.proc.popen.send_signal(signal.SIGSTOP)  # hung: alive, but its loop no longer turns

    wait_for(lambda: (worker.supervise(), worker.starts == 2)[1], timeout=MAX_AGE_S + 30, interval=0.5,
             what="the liveness check to find the hung worker and the restart policy to replace it")
    assert worker.verdicts[-1] == 1 and time.monotonic() - hung_at >= MAX_AGE_S
    wait_for(lambda: Generation.objects.filter(job=job, number=2).exists(), timeout=60,
             what="the restarted worker to finish the recovery")
    relaunch = f"job {job.pk} generation 2 launched"
    assert relaunch in worker.proc.log() and relaunch not in cluster.procs["worker1"].log()
    assert worker.healthcheck() == 0
    # Sweeps go on: none of them relaunches again.
    sweeps = worker.proc.log().count("jobs.tasks.sweep[")
    wait_for(lambda: worker.proc.log().count("jobs.tasks.sweep[") >= sweeps + 8, timeout=30, what="more sweeps")
    assert list(Generation.objects.filter(job=job).values_list("number", flat=True).order_by("number")) == [1, 2]
    incident = Incident.objects.get(job=job)
    assert incident.relaunched_at is not None
    assert cluster.procs["beat"].alive, "beat is a process of its own: the worker's death did not take it"
