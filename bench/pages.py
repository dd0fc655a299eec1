"""Dashboard pages at fleet size: server time and first paint in Chromium, for 1,024 nodes and a
4,096-rank job.

One daphne process (production settings, pooled connections) on a PostgreSQL database filled the
way a fleet fills it: 1,024 nodes × 8 GPUs with their latest readings (16 racks of 64), an hour of
raw telemetry for a node, a 4,096-rank job on 512 of them with a day of steps (6,000 charted),
node windows (512 nodes × 60 windows), 30 checkpoints with a rollback branch and a timeline of
state changes and checkpoint activity. Measured, interleaved page by page, ``--runs`` times:

- **server time**: a signed-in GET of the whole page (first byte to last) from this process;
- **first paint**: Chromium (Debian's, through Playwright) opens the page; the browser's
  ``first-contentful-paint`` entry.

Targets (issue 19): server time <= 1 s and first paint <= 2 s for the overview, /nodes/ and the
job page. The alternative an operator has is the page as it was drawn before (every node a table
row, every rank a row): gone from the code, so there is no ratio; the figures stand against the
targets. The JSON names each page's median and spread.

    python -m bench.pages [--quick] [--runs N]

Needs PostgreSQL: database ``nightwatch_pages_bench`` (recreated from a migrated template).
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench._common import arguments, emit, median, spread
from bench._fleet_services import base_env, fresh_database
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "nightwatch_pages_bench"
NODES, GPUS, JOB_NODES, RANKS_PER_NODE = 1024, 8, 512, 8
SERVER_TARGET_S, PAINT_TARGET_S = 1.0, 2.0
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def populate() -> dict:
    """The fleet, the job and a viewer's session; returns the session key and the page paths."""
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.auth.models import Group, User
    from django.contrib.sessions.backends.db import SessionStore
    from django.db import connection

    from checkpoints.models import Checkpoint
    from core.events import EventKind, record_event
    from core.roles import ensure_roles
    from jobs.models import Generation, Job, NodeWindow, StepMetric
    from nodes.models import GPU, Node, NodeGpuSample

    ensure_roles()
    now = datetime.now(UTC)
    nodes = Node.objects.bulk_create([
        Node(hostname=f"r{i // 64:02d}-gpu{i % 64:02d}", address=f"10.{i // 64}.0.{i % 64}", last_heartbeat_at=now,
             health="degraded" if i % 97 == 5 else "healthy", labels={"rack": f"r{i // 64:02d}"},
             lemon_count=3 if i == 777 else 0, schedulability="drained" if i == 777 else "active")
        for i in range(NODES)])
    GPU.objects.bulk_create([
        GPU(node=node, index=g, name="NVIDIA H100 80GB HBM3", health="healthy", last_sample_at=now,
            last_sample={"temperature_c": 40.0 + (node.pk * 7 + g) % 45, "utilization_pct": 90.0 + g,
                         "memory_used": (40 + g) * 2**30, "memory_free": (40 - g) * 2**30, "power_w": 600.0})
        for node in nodes for g in range(GPUS)], batch_size=4000)
    NodeGpuSample.objects.bulk_create([
        NodeGpuSample(node=nodes[0], time=now - timedelta(seconds=10 * i), gpus=2**GPUS - 1,
                      temperature_c=[50 + (i + g) % 9 for g in range(GPUS)], utilization_pct=[95] * GPUS,
                      memory_used_mib=[40_960] * GPUS, power_w=[600] * GPUS, sm_clock_mhz=[1980] * GPUS)
        for i in range(360)])
    job = Job.objects.create(name="llm-4096", entrypoint="train.py", nnodes=JOB_NODES, nproc_per_node=RANKS_PER_NODE,
                             created_by="bench", state="running", generation=2, last_step=86_400)
    first = Generation.objects.create(job=job, number=1, world_size=JOB_NODES * RANKS_PER_NODE, ended_at=now)
    second = Generation.objects.create(job=job, number=2, world_size=JOB_NODES * RANKS_PER_NODE)
    second.nodes.set(nodes[:JOB_NODES])
    StepMetric.objects.bulk_create([
        StepMetric(job=job, generation=2, rank=0, step=step, loss=2.0 + 1 / step, grad_norm=1.0,
                   world_size=JOB_NODES * RANKS_PER_NODE, data_cursor=step * 4096, samples=8, tokens=8192,
                   phases={"input": 0.01, "compute": 0.8, "optimizer": 0.05}, reported_at=now)
        for step in range(86_400 - 6_000 + 1, 86_401)], batch_size=5000)
    NodeWindow.objects.bulk_create([
        NodeWindow(job=job, generation=2, node=node, first_step=last - 9, last_step=last, ranks=RANKS_PER_NODE,
                   step_median_s=0.86, step_max_s=1.7 if node == 300 else 0.9,
                   slowest_rank=2403 if node == 300 else node * RANKS_PER_NODE,
                   slowest_s=1.6 if node == 300 else 0.87, phases={"input": 0.01, "compute": 0.8, "optimizer": 0.05},
                   slowest_phases={"input": 0.01, "compute": 1.5 if node == 300 else 0.81, "optimizer": 0.05},
                   reported_at=now - timedelta(seconds=86_400 - last))
        for last in range(86_400 - 590, 86_401, 10) for node in range(JOB_NODES)], batch_size=5000)
    parent = None
    for step in range(2_880, 86_401, 2_880):
        parent = Checkpoint.objects.create(job=job, generation=first if step < 40_000 else second, step=step,
                                           location=f"/ckpt/llm-4096/step-{step}", state="verified", parent=parent)
        record_event(EventKind.CHECKPOINT_COMMIT, actor="node:r00-gpu00", job=job, reason=f"step {step} committed",
                     evidence={"checkpoint": parent.pk, "step": step})
        record_event(EventKind.CHECKPOINT_VERIFY, actor="system:verifier", job=job, reason="verified",
                     old_state="committed", new_state="verified", evidence={"checkpoint": parent.pk, "step": step})
    viewer = User.objects.create_user("bench-viewer")
    viewer.groups.add(Group.objects.get(name="viewer"))
    session = SessionStore()
    session.update({SESSION_KEY: str(viewer.pk), BACKEND_SESSION_KEY: "django.contrib.auth.backends.ModelBackend",
                    HASH_SESSION_KEY: viewer.get_session_auth_hash()})
    session.create()
    with connection.cursor() as cursor:  # the planner's statistics, as autovacuum keeps them in a live database
        cursor.execute("ANALYZE")
    return {"session": session.session_key,
            "pages": {"overview": "/", "nodes": "/nodes/", "job": f"/jobs/{job.pk}/", "node": f"/nodes/{nodes[0].pk}/"}}


def server_time(port: int, path: str, session: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    started = time.perf_counter()
    conn.request("GET", path, headers={"Cookie": f"sessionid={session}"})
    response = conn.getresponse()
    body = response.read()
    elapsed = time.perf_counter() - started
    conn.close()
    if response.status != 200 or b'id="page"' not in body:
        raise SystemExit(f"GET {path}: HTTP {response.status}, {len(body)} bytes")
    return elapsed


def first_paint(browser, url: str, session: str) -> float:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.add_cookies([{"name": "sessionid", "value": session, "url": url}])
    page = context.new_page()
    page.goto(url, wait_until="load")
    # The paint entry may be recorded after "load": wait for it (10 s at most).
    paint = page.evaluate("""() => new Promise((resolve) => {
        const found = (entries) => entries.find((e) => e.name === "first-contentful-paint");
        const now = found(performance.getEntriesByType("paint"));
        if (now) return resolve(now.startTime);
        new PerformanceObserver((list) => { const e = found(list.getEntries()); if (e) resolve(e.startTime); })
            .observe({ type: "paint", buffered: true });
        setTimeout(() => resolve(null), 10000);
    })""")
    context.close()
    if paint is None:
        raise SystemExit(f"{url}: no first-contentful-paint entry")
    return paint / 1000


def main(argv: list[str] | None = None) -> None:
    args = arguments(__doc__.splitlines()[0], argv)
    work = Path(tempfile.mkdtemp(prefix="nw-pages-bench-"))
    fresh_database(DATABASE, "nightwatch_pages_bench_template")
    env = base_env(DATABASE, 10, work / "var")
    os.environ.update({k: env[k] for k in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "DEBUG",
                                           "NIGHTWATCH_VAR_DIR", "DB_POOL_MAX_SIZE")})
    import django

    django.setup()
    started = time.perf_counter()
    world = populate()
    print(f"populated {NODES} nodes x {GPUS} GPUs and a {JOB_NODES * RANKS_PER_NODE}-rank job "
          f"in {time.perf_counter() - started:.0f} s", flush=True)
    port = free_port()
    log = open(work / "daphne.log", "ab")  # noqa: SIM115 - closed below
    server = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                               "controlplane.asgi:application"],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):  # noqa: S310 - ours
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("daphne did not come up: " + (work / "daphne.log").read_text()[-2000:]) from None
                time.sleep(0.2)
        from playwright.sync_api import sync_playwright

        figures: dict[str, dict[str, list[float]]] = {name: {"server_s": [], "paint_s": []} for name in world["pages"]}
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            for path in world["pages"].values():  # warm: templates, connections, query plans
                server_time(port, path, world["session"])
                first_paint(browser, f"http://127.0.0.1:{port}{path}", world["session"])
            for run in range(args.runs):
                for name, path in world["pages"].items():
                    figures[name]["server_s"].append(server_time(port, path, world["session"]))
                    figures[name]["paint_s"].append(first_paint(browser, f"http://127.0.0.1:{port}{path}",
                                                                world["session"]))
                print(f"run {run + 1}/{args.runs}: " + ", ".join(
                    f"{name} {f['server_s'][-1]:.2f} s / paint {f['paint_s'][-1]:.2f} s"
                    for name, f in figures.items()), flush=True)
            browser.close()
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    details = {name: {"server_s": round(median(f["server_s"]), 3), "server_spread": [round(v, 3) for v in
                                                                                     spread(f["server_s"])],
                      "paint_s": round(median(f["paint_s"]), 3),
                      "paint_spread": [round(v, 3) for v in spread(f["paint_s"])],
                      "server_target_s": SERVER_TARGET_S, "paint_target_s": PAINT_TARGET_S}
               for name, f in figures.items()}
    worst = max(d["server_s"] for d in details.values())
    emit("pages", metric="slowest_page_server_s", value=worst, target=SERVER_TARGET_S, better="lower", unit="s",
         runs=args.runs, spread=[min(d["server_s"] for d in details.values()), worst],
         details={"nodes": NODES, "gpus": NODES * GPUS, "ranks": JOB_NODES * RANKS_PER_NODE, "pages": details,
                  "slowest_paint_s": max(d["paint_s"] for d in details.values()), "paint_target_s": PAINT_TARGET_S})


if __name__ == "__main__":
    main()
