"""Redis down: the API answers (never a 500) and what it could not queue happens once Redis is back.

A Redis server of the test's own (its own port) serves the cache, the Celery broker and the channel
layer of a real control plane (daphne) and worker (with beat). The test kills it, talks to the API
as an agent (heartbeat, an exit report), as the training hooks (a step report, with a job token) and
as an operator (GET), restarts it, and waits for the exit to be handled: its stop confirmed and its
incident opened, by the worker, from the message the web process could not publish.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
from websockets.exceptions import InvalidStatus

from tests.e2e.cluster import FAILURE_QUEUES, Cluster, Proc, api, wait_for
from tests.e2e.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]


@pytest.fixture
def outage(transactional_db, tmp_path, request):
    from django.conf import settings
    from django.db import connection

    server = RedisServer(tmp_path / "redis")
    server.start()
    cluster = Cluster(tmp_path, database_name=connection.settings_dict["NAME"], redis_db=0, settings={
        "REDIS_URL": server.url, "NIGHTWATCH_OUTBOX_INTERVAL_S": "1",
        # The test signs a dashboard session in: the server must share its key.
        "SECRET_KEY": settings.SECRET_KEY,
        # Nodes of this test are driven by hand: none may turn unreachable while it pauses.
        "NIGHTWATCH_HEARTBEAT_MISSES": "100"})
    try:
        cluster.start_web()
        # Beat as a process of its own, as in production (docker-compose.yml): both must ride out the outage.
        cluster.procs["beat"] = Proc("beat", [sys.executable, "-m", "celery", "-A", "controlplane", "beat",
                                              "--loglevel=INFO", "-s", str(tmp_path / "beat-schedule")],
                                     env=cluster.env, log_dir=cluster.logs)
        worker = cluster._start_celery("worker", ["-Q", f"{FAILURE_QUEUES},checkpoints"])
        wait_for(lambda: "ready." in worker.log() or not worker.alive, timeout=60, what="the worker to start")
        yield cluster, server
    finally:
        cluster.close()
        server.kill()
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            print(cluster.dump_logs())


def _running_job():
    """A node with an agent token, and a job the sweeper placed there (generation 1), with the job
    token of its training processes."""
    from core.models import ApiToken
    from core.tokens import job_token_for
    from jobs.models import Generation, Job
    from nodes.models import Node

    node = Node.objects.create(hostname="node-r", address="127.0.0.1", health="healthy")
    _, agent = ApiToken.issue(name="agent", scope="agent", node=node)
    job = Job.objects.create(name="outage", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             created_by="test")
    wait_for(lambda: Generation.objects.filter(job=job, number=1).exists(), timeout=30,
             what="the sweeper to place the job")
    job.refresh_from_db()
    return node, agent, job, job_token_for(job, 1, node)


def test_the_api_answers_while_redis_is_down_and_queued_work_runs_when_it_returns(outage, tokens):
    from core.models import OutboxMessage
    from jobs.models import Generation, Incident

    cluster, server = outage
    node, agent, job, job_token = _running_job()
    session = _session("otto")  # the operator of the e2e cast, signed in to the dashboard
    server.kill()
    started = time.monotonic()

    status, body = api(cluster, agent, "POST", f"/api/v1/nodes/{node.pk}/heartbeat",
                       {"node_id": str(node.pk), "seq": 1, "time": time.time()})
    assert status == 200, body
    report = {"job": str(job.pk), "generation": 1, "rank": 0, "step": 1, "loss": 2.5, "grad_norm": 1.0,
              "world_size": 2, "data_cursor": 8, "samples": 4, "phases": {"compute": 0.1}, "time": time.time()}
    status, body = api(cluster, job_token, "POST", f"/api/v1/jobs/{job.pk}/reports",
                       {"job": str(job.pk), "generation": 1, "reports": [report], "events": [], "windows": []})
    assert status == 202, body
    status, body = api(cluster, tokens["operator"], "GET", f"/api/v1/jobs/{job.pk}")
    assert status == 200 and body["last_step"] == 1, body
    status, body = api(cluster, "", "GET", "/readyz")  # a load balancer keeps this process in rotation
    assert status == 200 and body["status"] == "degraded" and body["checks"]["broker"].startswith("error"), body
    status, body = api(cluster, "nw_not-a-token", "GET", "/api/v1/jobs")  # failed-token counting uses the cache
    assert status == 401, body
    exited = {"key": "exit-1", "kind": "exited", "job": str(job.pk), "generation": 1, "time": time.time(),
              "detail": {"exit_code": 1, "ranks": [{"rank": 1, "local_rank": 1, "signal": 9}],
                         "error_line": "killed by the test"}}
    status, body = api(cluster, agent, "POST", f"/api/v1/nodes/{node.pk}/events", {"events": [exited]})
    assert status in (200, 202), body
    with pytest.raises(InvalidStatus):  # a live page is refused at once (the browser retries), not hung
        asyncio.run(_watch(cluster, session, job.pk, until=lambda frame: True))
    down_for = time.monotonic() - started
    assert down_for < 10, f"the six requests took {down_for:.1f} s without Redis"
    # Nothing could be queued: the exit's task waits in the outbox, and no worker has handled it.
    assert OutboxMessage.objects.filter(task="jobs.tasks.handle_exit").count() == 1
    assert not Incident.objects.filter(job=job).exists()

    server.start()
    wait_for(lambda: "node-r" in Generation.objects.get(job=job, number=1).stopped_nodes, timeout=60,
             what="the exit report to be handled after Redis returned")
    incident = wait_for(lambda: Incident.objects.filter(job=job).first(), timeout=30, what="the incident")
    assert incident.evidence["signal"] == "exit"
    wait_for(lambda: not OutboxMessage.objects.exists(), timeout=30, what="the outbox to be empty")
    # The API answered from Redis again: a heartbeat after the return.
    status, _ = api(cluster, agent, "POST", f"/api/v1/nodes/{node.pk}/heartbeat",
                    {"node_id": str(node.pk), "seq": 2, "time": time.time()})
    assert status == 200
    # Live pages work again: a page opened now gets its snapshot, then the push of an operator's pause.
    paused = asyncio.run(_watch(cluster, session, job.pk, until=lambda frame: "banner" in frame.get("html", {}),
                                then=lambda: api(cluster, tokens["operator"], "POST", f"/api/v1/jobs/{job.pk}/pause",
                                                 {"reason": "after the Redis outage"})))
    assert paused["type"] == "update"
    assert cluster.procs["worker"].alive and cluster.procs["beat"].alive, "the outage ended neither"
    web_log = cluster.procs["web"].log()
    assert "Traceback" not in web_log and '" 500 ' not in web_log, "the outage failed a request somewhere"


def _session(username: str) -> str:
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.auth.models import User
    from django.contrib.sessions.backends.db import SessionStore

    user = User.objects.get(username=username)
    session = SessionStore()
    session.update({SESSION_KEY: str(user.pk), BACKEND_SESSION_KEY: "django.contrib.auth.backends.ModelBackend",
                    HASH_SESSION_KEY: user.get_session_auth_hash()})
    session.create()
    return session.session_key


async def _watch(cluster, session: str, job_id: int, *, until, then=None, timeout: float = 30) -> dict:
    """Open the job's live page; after its snapshot run ``then`` (in a thread), and return the first
    frame for which ``until`` holds."""
    from websockets.asyncio.client import connect

    async with asyncio.timeout(timeout):
        async with connect(f"ws://127.0.0.1:{cluster.port}/ws/dashboard/jobs/{job_id}/", open_timeout=10,
                           additional_headers={"Cookie": f"sessionid={session}"}, origin=cluster.url,
                           max_size=2**24) as ws:
            snapshot = json.loads(await ws.recv())
            assert snapshot["type"] == "snapshot", snapshot
            if then is not None:
                await asyncio.to_thread(then)
            while True:
                frame = json.loads(await ws.recv())
                if until(frame):
                    return frame
