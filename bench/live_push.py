"""Live push to dashboards vs polling the REST API: how soon a step report reaches 100 browsers.

One real ``daphne`` (the production ASGI server) with the Redis channel layer, backed by
PostgreSQL. ``--clients`` WebSocket clients (default 100) open the job page's socket
(``/ws/dashboard/jobs/<id>/``) with a signed-in viewer's session; a simulated training job posts
its step reports through the real hooks API (``POST /api/v1/jobs/<id>/reports``, the generation's job token),
one step every ``--every`` seconds. Each client notes when each step arrives.

The alternative, in the same run and interleaved with it run by run: the same number of clients
polling ``GET /api/v1/jobs/<id>`` every second — what Determined's and torchft's dashboards do —
each noticing a step when ``last_step`` reaches it.

Latency is measured from the commit of the report, taken as the moment its 202 came back: the
view answers right after the transaction commits (one small query later), and the push cannot
start before the relay's next read of the table (every 50 ms), which only sees committed rows.
The details also give the figure from the moment the POST was *sent* — an upper bound that adds
the request's own handling time. Reported: the push's p95 in ms (target 250), p50, the polling
figures and the ratio push / poll. Also: a burst of back-to-back reports, and how many messages a
second one client received meanwhile (the relay coalesces to a few a second).

    python -m bench.live_push [--quick] [--runs N] [--clients 100] [--reports 10] [--every 0.4]

Needs PostgreSQL (``BENCH_DATABASE_URL``, default ``postgres://postgres@127.0.0.1:5432/nightwatch_bench_live``,
created and migrated when missing) and Redis (``BENCH_REDIS_URL``, default ``redis://127.0.0.1:6379/13``;
the benchmark uses it as the channel layer).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from bench._common import arguments, emit, median, spread
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/nightwatch_bench_live"
DEFAULT_REDIS = "redis://127.0.0.1:6379/13"
TARGET_P95_MS = 250.0
POLL_EVERY_S = 1.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# --- the server and the job ----------------------------------------------------------------------

class Server:
    """One daphne on the benchmark database and Redis, and a running job with an agent token and
    a viewer (session for the sockets, token for the pollers)."""

    def __init__(self, db_url: str, redis_url: str):
        from bench.ingest import prepare_database, server_env

        self.var = Path(tempfile.mkdtemp(prefix="nw-live-push-"))
        self.env = {**server_env(db_url), "REDIS_URL": redis_url, "NIGHTWATCH_VAR_DIR": str(self.var)}
        prepare_database(db_url)
        import redis

        redis.Redis.from_url(redis_url).flushdb()
        os.environ.update({k: self.env[k] for k in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "DEBUG",
                                                    "NIGHTWATCH_VAR_DIR")})
        import django

        django.setup()
        self._make_job()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.var / "daphne.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
                                      "controlplane.asgi:application"], cwd=ROOT, env=self.env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as r:  # noqa: S310 - our server
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("daphne did not come up: " + (self.var / "daphne.log").read_text()[-2000:])
            time.sleep(0.2)
        self.step = 0
        self.report_errors = 0

    def _make_job(self) -> None:
        from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
        from django.contrib.auth.models import Group, User
        from django.contrib.sessions.backends.db import SessionStore

        from core.models import ApiToken
        from core.roles import ensure_roles
        from core.tokens import job_token_for
        from jobs import services
        from jobs.models import Generation, Job
        from nodes.models import Node

        ensure_roles()
        tag = uuid.uuid4().hex[:8]
        Node.objects.create(  # the node the job is placed on
            hostname=f"bench-{tag}", address="127.0.0.1", health="healthy")
        viewer = User.objects.create_user(f"bench-viewer-{tag}")
        viewer.groups.add(Group.objects.get(name="viewer"))
        _, self.viewer_token = ApiToken.issue(name=f"bench {tag}", scope="viewer", user=viewer)
        session = SessionStore()
        session.update({SESSION_KEY: str(viewer.pk), BACKEND_SESSION_KEY: "django.contrib.auth.backends.ModelBackend",
                        HASH_SESSION_KEY: viewer.get_session_auth_hash()})
        session.create()
        self.session = session.session_key
        job = Job.objects.create(name=f"bench-{tag}", entrypoint="examples/train.py", nproc_per_node=2,
                                 accelerator="cpu", created_by="bench")
        services.start_job(job, actor="bench")
        job.refresh_from_db()
        self.job, self.generation = job.pk, job.generation
        # What the hooks hold: the job token of the generation, as its launch delivers it.
        placed = Generation.objects.get(job=job, number=job.generation).nodes.first()
        self.hooks_token = job_token_for(job, job.generation, placed)

    def report(self) -> tuple[int, float, float]:
        """Post the next step of both ranks, as the hooks do; returns (step, sent_at, answered_at)."""
        self.step += 1
        now = time.time()
        reports = [{"job": str(self.job), "generation": self.generation, "rank": rank, "step": self.step,
                    "loss": 2.0 + random.random() * 0.1, "grad_norm": 1.0, "world_size": 2,  # noqa: S311
                    "data_cursor": self.step * 16, "samples": 8, "phases": {"compute": 0.1}, "time": now}
                   for rank in (0, 1)]
        body = json.dumps({"job": str(self.job), "generation": self.generation, "reports": reports, "events": []})
        for attempt in range(5):  # like the hooks: a failed post is retried (replays are recognised)
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            sent = time.monotonic()
            conn.request("POST", f"/api/v1/jobs/{self.job}/reports", body=body,
                         headers={"Authorization": f"Bearer {self.hooks_token}", "Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            answered = time.monotonic()
            conn.close()
            if response.status == 202:
                return self.step, sent, answered
            self.report_errors += 1
            time.sleep(0.2 * (attempt + 1))
        raise SystemExit(f"report refused: {response.status}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# --- push: WebSocket clients ---------------------------------------------------------------------

class Sockets:
    """``n`` clients on the job page's socket, in an event loop of their own (a thread)."""

    def __init__(self, server: Server, n: int, clock=time.monotonic):
        """``server``: anything with ``port``, ``job`` and a viewer's ``session``; ``clock``: what each
        arrival is stamped with (wall time where it is compared with the database's ``received_at``)."""
        self.server, self.n, self.clock = server, n, clock
        self.arrivals: list[dict[int, float]] = [{} for _ in range(n)]
        #: When the relay sent each step (the frame's ``relayed_at``, the server's wall clock).
        self.relayed: list[dict[int, float]] = [{} for _ in range(n)]
        self.frames: list[list[float]] = [[] for _ in range(n)]
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._open_all(), self.loop).result(timeout=120)

    async def _open_all(self) -> None:
        self.handshakes = asyncio.Semaphore(20)  # as browsers arrive: not all in the same millisecond
        self.sockets = await asyncio.gather(*(self._open(i) for i in range(self.n)))
        self.tasks = [asyncio.ensure_future(self._listen(i, ws)) for i, ws in enumerate(self.sockets)]

    async def _open(self, i: int):
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidMessage

        for attempt in range(5):
            try:
                async with self.handshakes:
                    ws = await connect(f"ws://127.0.0.1:{self.server.port}/ws/dashboard/jobs/{self.server.job}/",
                                       additional_headers={"Cookie": f"sessionid={self.server.session}"},
                                       origin=f"http://127.0.0.1:{self.server.port}", max_size=2**24,
                                       open_timeout=60)
                break
            except (InvalidMessage, OSError):
                if attempt == 4:
                    raise
                await asyncio.sleep(0.5 * (attempt + 1))
        snapshot = json.loads(await ws.recv())
        assert snapshot["type"] == "snapshot", snapshot
        return ws

    async def _listen(self, i: int, ws) -> None:
        async for raw in ws:
            now = self.clock()
            frame = json.loads(raw)
            self.frames[i].append(now)
            for point in frame.get("points") or []:
                self.arrivals[i].setdefault(point["step"], now)
                if frame.get("relayed_at") is not None:
                    self.relayed[i].setdefault(point["step"], frame["relayed_at"])

    def close(self) -> None:
        async def shut():
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*(ws.close() for ws in self.sockets), return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# --- the alternative: polling the REST API every second ---------------------------------------------

class Pollers:
    def __init__(self, server: Server, n: int):
        self.server, self.n = server, n
        self.arrivals: list[dict[int, float]] = [{} for _ in range(n)]
        #: When the relay sent each step (the frame's ``relayed_at``, the server's wall clock).
        self.relayed: list[dict[int, float]] = [{} for _ in range(n)]
        self.stop_flag = threading.Event()
        self.requests = self.errors = 0
        self.threads = [threading.Thread(target=self._poll, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _poll(self, i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
        seen = self.server.step
        next_at = time.monotonic() + random.random() * POLL_EVERY_S  # noqa: S311 - clients start at random phases
        while not self.stop_flag.is_set():
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += POLL_EVERY_S
            try:
                conn.request("GET", f"/api/v1/jobs/{self.server.job}",
                             headers={"Authorization": f"Bearer {self.server.viewer_token}"})
                response = conn.getresponse()
                body = json.loads(response.read())
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
                self.errors += 1
                continue
            now = time.monotonic()
            self.requests += 1
            if response.status != 200:
                self.errors += 1
                continue
            last = body.get("last_step") or 0
            for step in range(seen + 1, last + 1):
                self.arrivals[i].setdefault(step, now)
            seen = max(seen, last)
        conn.close()

    def close(self) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(5)


# --- one run -------------------------------------------------------------------------------------

def measure(server: Server, clients, reports: int, every: float, settle: float) -> dict:
    """Post ``reports`` steps ``every`` seconds apart; the latency of each (client, step)."""
    posted = []
    for _ in range(reports):
        posted.append(server.report())
        time.sleep(every)
    time.sleep(settle)
    from_sent, from_answer, missing = [], [], 0
    for arrivals in clients.arrivals:
        for step, sent, answered in posted:
            arrived = arrivals.get(step)
            if arrived is None:
                missing += 1
                continue
            from_sent.append((arrived - sent) * 1000)
            from_answer.append(max(0.0, arrived - answered) * 1000)
    if not from_sent:
        raise SystemExit("no step reached any client")
    silent = sum(1 for arrivals in clients.arrivals if not any(step in arrivals for step, _, _ in posted))
    return {"p50_ms": statistics.median(from_answer), "p95_ms": _percentile(from_answer, 0.95),
            "p50_from_sent_ms": statistics.median(from_sent), "p95_from_sent_ms": _percentile(from_sent, 0.95),
            "samples": len(from_sent), "missing": missing, "silent_clients": silent}


def burst(server: Server, sockets: Sockets, reports: int) -> dict:
    """Back-to-back reports: how many messages a second does a browser get?"""
    before = [len(f) for f in sockets.frames]
    started = time.monotonic()
    last = None
    for _ in range(reports):
        last = server.report()
    elapsed = time.monotonic() - started
    time.sleep(1.0)
    got = [len(f) - b for f, b in zip(sockets.frames, before, strict=True)]
    missing = sum(1 for a in sockets.arrivals if last[0] not in a)
    return {"reports": reports, "seconds": round(elapsed, 2), "reports_per_s": round(reports / elapsed, 1),
            "max_messages_per_client": max(got), "messages_per_s_per_client": round(max(got) / (elapsed + 1.0), 2),
            "clients_missing_last_step": missing}


def main(argv: list[str] | None = None) -> None:
    import argparse

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--clients", type=int, default=100)
    extra.add_argument("--reports", type=int)
    extra.add_argument("--every", type=float, default=0.4)
    known, rest = extra.parse_known_args(argv)
    args = arguments(__doc__.splitlines()[0], rest)
    reports = known.reports or (8 if args.quick else 20)
    db_url = os.environ.get("BENCH_DATABASE_URL", DEFAULT_DB)
    redis_url = os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS)
    try:
        import psycopg
        import redis

        psycopg.connect(db_url.rsplit("/", 1)[0] + "/postgres", connect_timeout=3).close()
        redis.Redis.from_url(redis_url, socket_connect_timeout=3).ping()
    except Exception as exc:  # noqa: BLE001 - any reason it cannot run is reported, not a figure
        emit("live_push", metric="push_p95_ms", value=None, target=TARGET_P95_MS, better="lower", unit="ms",
             runs=0, spread=None, details={}, skipped=f"needs PostgreSQL and Redis: {exc}")
        return

    server = Server(db_url, redis_url)
    push_runs, poll_runs = [], []
    try:
        server.report()  # the first step moves the job to running; not measured
        sockets = Sockets(server, known.clients)
        try:
            for run in range(args.runs):
                push_runs.append(measure(server, sockets, reports, known.every, settle=1.0))
                print(f"run {run + 1}: push p50 {push_runs[-1]['p50_ms']:.0f} ms, p95 {push_runs[-1]['p95_ms']:.0f} ms",
                      flush=True)
                pollers = Pollers(server, known.clients)
                try:
                    time.sleep(POLL_EVERY_S)  # every poller has polled once
                    poll_runs.append(measure(server, pollers, reports, known.every, settle=POLL_EVERY_S + 0.5))
                finally:
                    pollers.close()
                poll_runs[-1].update(requests=pollers.requests, failed_requests=pollers.errors)
                print(f"run {run + 1}: poll p50 {poll_runs[-1]['p50_ms']:.0f} ms, p95 {poll_runs[-1]['p95_ms']:.0f} ms",
                      flush=True)
            bursts = burst(server, sockets, 40)
        finally:
            sockets.close()
    finally:
        server.stop()

    push_p95 = [r["p95_ms"] for r in push_runs]
    poll_p95 = [r["p95_ms"] for r in poll_runs]
    ratios = [a / b for a, b in zip(push_p95, poll_p95)]
    print(f"push p95 {median(push_p95):.0f} ms vs polling every {POLL_EVERY_S:g} s p95 {median(poll_p95):.0f} ms "
          f"(ratio {median(ratios):.2f}); burst: {bursts}", flush=True)
    emit("live_push", metric="push_p95_ms", value=round(median(push_p95), 1), target=TARGET_P95_MS, better="lower",
         unit="ms", runs=args.runs, spread=[round(v, 1) for v in spread(push_p95)],
         details={"clients": known.clients, "reports_per_run": reports, "report_every_s": known.every,
                  "push_p50_ms": round(median([r["p50_ms"] for r in push_runs]), 1),
                  "poll_p50_ms": round(median([r["p50_ms"] for r in poll_runs]), 1),
                  "poll_p95_ms": round(median(poll_p95), 1),
                  "push_over_poll_p95": round(median(ratios), 3),
                  "push_runs": push_runs, "poll_runs": poll_runs, "burst": bursts,
                  "report_retries": server.report_errors,
                  "measured_from": "the report's 202 (sent right after its commit); *_from_sent_ms: from the POST "
                                   "being sent, an upper bound",
                  "server": "1 daphne (ASGI), Redis channel layer, PostgreSQL, DEBUG off"})


if __name__ == "__main__":
    main(sys.argv[1:])
