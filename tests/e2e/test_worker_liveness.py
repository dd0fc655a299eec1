"""A worker that hangs mid-recovery is found by its liveness check and restarted, compose-style, and
the restarted worker finishes the recovery: exactly one new generation.

The supervision is the one docker-compose.yml and docs/deployment.md set up: the worker touches its
liveness file (``NIGHTWATCH_WORKER_LIVENESS_FILE``) and writes a pid file; a healthcheck runs
``python -m core.liveness FILE --max-age N --kill-pidfile PIDFILE``, which kills a worker whose file
went stale; the restart policy starts a new one when the old one exits. Beat runs as its own process
and survives the worker.

The recovery is hung while it waits for the second node's stop confirmation, which arrives while the
worker is frozen. Redis may already have handed that message to the frozen worker, which dies with it
(the issue's "worker died inside kombu"); then the sweep's reconciliation (``jobs.reconcile``) handles
the stored confirmation 10 s later. Either way: exactly one new generation.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from core import liveness
from tests.e2e.cluster import FAILURE_QUEUES, Cluster, Proc, api, wait_for

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
        self.proc = self.cluster._start_celery(f"worker{self.starts}", ["-Q", f"{FAILURE_QUEUES},checkpoints",
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
        "NIGHTWATCH_HEARTBEAT_MISSES": "100",
        # The recovery waits for the second node's confirmation across the worker's restart.
        "NIGHTWATCH_QUIESCE_TIMEOUT_S": "120"})
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
    nodes, agents = [], []
    for name in ("node-w1", "node-w2"):
        nodes.append(Node.objects.create(hostname=name, address="127.0.0.1", health="healthy"))
        agents.append(ApiToken.issue(name=name, scope="agent", node=nodes[-1])[1])
    # Two nodes: after one crashes, the recovery waits (quiescing) until the other confirms its stop.
    job = Job.objects.create(name="liveness", entrypoint="examples/train.py", nnodes=2, nproc_per_node=2,
                             created_by="test")
    wait_for(lambda: Generation.objects.filter(job=job, number=1).exists(), timeout=30, what="generation 1")
    assert worker.healthcheck() == 0, "a working worker is alive"
    # ... because it touches its file, again and again (not merely because it just started).
    first = wait_for(lambda: liveness.age(worker.alive_file) is not None and os.stat(worker.alive_file).st_mtime,
                     timeout=10, what="the worker's first touch")
    wait_for(lambda: os.stat(worker.alive_file).st_mtime > first, timeout=10, what="the worker's next touch")

    _event(cluster, agents[0], nodes[0], job, "exited", {"exit_code": 1,
                                                        "ranks": [{"rank": 0, "local_rank": 0, "signal": 9}]})
    wait_for(lambda: Job.objects.get(pk=job.pk).state == "quiescing", timeout=30, what="the recovery to start")
    hung_at = time.monotonic()
    worker.proc.popen.send_signal(signal.SIGSTOP)  # hung in the middle of the recovery: alive, its loop still
    # The last confirmation the recovery waits for arrives while no worker takes messages.
    _event(cluster, agents[1], nodes[1], job, "stopped", {"exit_code": -15, "requested_stop": True})

    wait_for(lambda: (worker.supervise(), worker.starts == 2)[1], timeout=MAX_AGE_S + 30, interval=0.5,
             what="the liveness check to find the hung worker and the restart policy to replace it")
    assert worker.verdicts[-1] == 1 and time.monotonic() - hung_at >= MAX_AGE_S
    wait_for(lambda: Generation.objects.filter(job=job, number=2).exists(), timeout=60,
             what="the restarted worker to finish the recovery")
    relaunch = f"job {job.pk} generation 2 launched"
    wait_for(lambda: relaunch in worker.proc.log(), timeout=10, what="the restarted worker's relaunch in its log")
    assert relaunch not in cluster.procs["worker1"].log()
    assert worker.healthcheck() == 0
    # Sweeps go on: none of them relaunches again.
    sweeps = worker.proc.log().count("jobs.tasks.sweep[")
    wait_for(lambda: worker.proc.log().count("jobs.tasks.sweep[") >= sweeps + 8, timeout=30, what="more sweeps")
    assert list(Generation.objects.filter(job=job).values_list("number", flat=True).order_by("number")) == [1, 2]
    assert Incident.objects.get(job=job).relaunched_at is not None
    assert cluster.procs["beat"].alive, "beat is a process of its own: the worker's death did not take it"


def _event(cluster, token, node, job, kind, detail) -> None:
    body = {"events": [{"key": f"{kind}-{node.hostname}", "kind": kind, "job": str(job.pk), "generation": 1,
                        "time": time.time(), "detail": detail}]}
    status, answer = api(cluster, token, "POST", f"/api/v1/nodes/{node.pk}/events", body)
    assert status in (200, 202), answer
