"""Fleet scale: hundreds of simulated nodes and thousands of ranks through the real control plane.

For each fleet size (64, 256, 1,024 nodes x 8 GPUs) the benchmark starts the control plane as
production runs it (``bench._fleet_services``: 2 daphne processes with pooled database connections,
the Celery workers and beat, PostgreSQL, Redis), then simulated node agents
and training ranks in a few processes (``bench._fleet_sim``) that speak the real wire protocol over
real HTTP with real tokens. Jobs are submitted through the API with an operator token and fill the
fleet: one of half of it, 64-node jobs while they fit in three eighths, 8-node jobs for the rest
(8,192 ranks at 1,024 nodes), with a sixteenth more nodes as idle spares on top for restarts. Before
the sizes, a calibration fleet of one job measures what one heartbeat, one step-report request and
one telemetry sample cost the control plane (``cost``). Once every job trains, a steady window
(10 minutes at the largest size) runs with seeded faults —
node death, rank exit, hang, Xid on one GPU, a slow rank, a Celery worker restart — and then a
reconnect storm (the web processes stopped for ``--outage`` seconds, then every spool replayed).

Reported per size: detection latency per fault kind (fault -> the incident or node-health row),
HTTP p50/p99 and errors per endpoint class, 503s, accepted requests per second against offered,
rows and bytes per hour per table (extrapolated to a day and a week), control-plane CPU seconds
per node per minute (daphne, Celery and the database's backends, from /proc), the Celery queue's
deepest point, dashboard server time (overview, /nodes/, the biggest job's page) and the storm's
flush time. The alternative a user would otherwise have at this scale is no control plane at
all, so the ratios are against the fleet's own offered load: accepted / offered, and at the
largest size accepted / the capacity measured at the smaller ones (the plateau). Live push: 20
WebSocket clients (``--browsers``) on the biggest job's page, connected to the web process that
serves WebSockets only, as a deployment's proxy routes ``/ws/``; each step's arrival against the
moment its row was stored, and, where PostgreSQL has ``track_commit_timestamp = on`` (a server
setting; it takes a restart), against its commit too. Also per size, to say why: what the Celery
queue held at its deepest, the sweeps that expired unrun and the longest pause between those that
ran (from the worker's log), and how long each role's wake-ups waited for a CPU.

    python -m bench.fleet [--quick] [--nodes 64,256,1024] [--duration S] [--largest-duration S] [--seed N]
                          [--cost-only | --cost-runs 0]

Needs PostgreSQL and Redis: databases ``nightwatch_fleet_bench_<nodes>`` (recreated from a migrated
``nightwatch_fleet_bench_template``; names must contain "bench") and Redis database
``BENCH_REDIS_DB`` (default 9, flushed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench import _fleet_measure as measure
from bench import _fleet_report as report
from bench._common import RESULTS, emit
from bench._fleet_http import merge, percentile
from bench._fleet_services import ControlPlane, database_url, fresh_database
from bench._fleet_sim import CALIBRATION_SAMPLES
from tests.e2e.cluster import wait_for

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_DB = "nightwatch_fleet_bench_template"
REDIS_DB = int(os.environ.get("BENCH_REDIS_DB", "9"))
GPUS = 8
PROGRESS_TIMEOUT_S = 20  # the jobs' recovery policy: a hang is declared after this long without a step
CHECKPOINT_EVERY = 60  # steps
HEARTBEAT_MISSES = 3  # the production default; the interval is the one heartbeat pacing asked for
SLACK_S = 2.0
FAULT_KINDS = ("node_death", "rank_exit", "hang", "xid", "slow_rank", "worker_restart")
#: The issue's targets: detection p95 per fault kind, seconds (node death: ``node_death_target_s``).
WAIT_ENDPOINT = "command_wait"  # the simulator books the agents' long polls under this name
DETECTION_TARGET_S = {"rank_exit": 2.0, "xid": 2.0, "hang": PROGRESS_TIMEOUT_S + SLACK_S}


def node_death_target_s(results: list[dict[str, Any]]) -> float:
    """A heartbeat timeout + 2 s, the timeout the one the largest interval asked for (pacing stretches
    it with the fleet: 5 s up to 250 nodes, 22 s at 1,088)."""
    interval = max((r.get("heartbeat_interval_s") or 5.0 for r in results), default=5.0)
    return round(interval * HEARTBEAT_MISSES + SLACK_S, 1)


# --- the job mix --------------------------------------------------------------------------------

def job_mix(nodes: int) -> list[int]:
    """Nodes per job, filling the training fleet: one of half the fleet, 64-node jobs in the next 3/8
    (while a few 8-node jobs are left), 8-node jobs for the rest. 1,024 nodes: 512 + 6 x 64 + 16 x 8,
    8,192 ranks."""
    sizes = [nodes // 2]
    left = nodes - nodes // 2
    while left - 64 >= nodes // 8 and sum(s for s in sizes if s == 64) + 64 <= nodes * 3 // 8:
        sizes.append(64)
        left -= 64
    sizes += [8] * (left // 8)
    return sizes


def spares(nodes: int) -> int:
    """Idle nodes on top of the training fleet (1/16 of it), so a drained or dead node's job has
    somewhere to restart, as a cluster keeps hot spares."""
    return nodes // 16


def submit_jobs(port: int, token: str, sizes: list[int]) -> list[int]:
    ids = []
    for i, nnodes in enumerate(sizes):
        body = {"name": f"fleet-{i}-{nnodes}n", "entrypoint": "examples/train.py", "nnodes": nnodes,
                "nproc_per_node": GPUS, "accelerator": "gpu", "rdzv_port": 29400 + i,
                "checkpoint_policy": {"interval": "fixed", "interval_steps": CHECKPOINT_EVERY, "keep_last": 2},
                "recovery_policy": {"backoff_seconds": 0, "progress_timeout_s": PROGRESS_TIMEOUT_S,
                                    "max_restarts": 20}}
        status, answer = call(port, token, "POST", "/api/v1/jobs", body)
        if status != 201:
            raise RuntimeError(f"job {i} refused ({status}): {answer}")
        ids.append(answer["id"])
    return ids


def call(port: int, token: str, method: str, path: str, body: Any = None, *,
         patience: float = 300.0) -> tuple[int, dict]:
    """One API request as an operator's client would make it: a 503 is waited out (Retry-After, jittered)
    for up to ``patience`` seconds; at 1,024 nodes admission control refused job submissions for 25 s."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,  # noqa: S310
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    deadline = time.monotonic() + patience
    while True:
        try:
            with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            if error.code != 503 or time.monotonic() > deadline:
                return error.code, json.loads(error.read() or b"{}")
            time.sleep(float(error.headers.get("Retry-After") or 1) * random.uniform(1, 1.5))


# --- setup inside Django (a subprocess: each fleet size has its own database) --------------------

def setup(nodes: int) -> None:
    """Print the operator's token and session and one bootstrap token per node (``--setup N``)."""
    import django

    django.setup()
    from django.contrib.auth.models import Group, User
    from django.test import Client

    from core.models import ApiToken
    from nodes.services.fleet import issue_bootstrap_token

    user = User.objects.create_user("fleet-operator")
    user.groups.add(Group.objects.get(name="operator"))
    _, operator = ApiToken.issue(name="fleet-ops", scope="operator", user=user)
    browser = Client()
    browser.force_login(user)
    hosts = [f"gpu-{i // 32:03d}-{i % 32:03d}" for i in range(nodes)]
    boot = [issue_bootstrap_token(name=f"boot-{h}", actor="bench.fleet", hostname=h)[1] for h in hosts]
    print(json.dumps({"operator": operator, "session": browser.cookies["sessionid"].value,
                      "nodes": [{"hostname": h, "bootstrap": b, "address": address(i)}
                                for i, (h, b) in enumerate(zip(hosts, boot))]}))


def address(index: int) -> str:
    """A simulated node's own address (what the proxy in front of the web processes forwards)."""
    number = index + 1
    return f"10.{number >> 16 & 255}.{number >> 8 & 255}.{number & 255}"


def checkpoint_templates(directory: Path, world_sizes: set[int]) -> dict[str, str]:
    """A tiny real DCP checkpoint per world size (every required part, an RNG state per rank)."""
    import torch
    import torch.distributed.checkpoint as dcp

    found = {}
    for world in sorted(world_sizes):
        path = directory / f"dcp-{world}"
        if not path.exists():
            state = {"model": {"w": torch.zeros(4)}, "optim": {"m": torch.zeros(4)}, "scheduler": {"n": torch.zeros(1)},
                     "progress": {"step": torch.zeros(1)}, **{f"rng.rank{r}": torch.zeros(1) for r in range(world)}}
            dcp.save(state, checkpoint_id=str(path))
        found[str(world)] = str(path)
    return found


# --- the simulator processes --------------------------------------------------------------------

class Simulators:
    """The simulator processes and the last status line of each."""

    def __init__(self, work: Path, ports: list[int], fleet: list[dict], processes: int, *, templates: dict,
                 seed: int, checkpoint_every: int = CHECKPOINT_EVERY, command_wait: bool = True,
                 urgent_port: int | None = None):
        self.work = work
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.status: list[dict] = [{} for _ in range(processes)]
        self.owner: dict[str, int] = {}
        (work / "logs").mkdir(parents=True, exist_ok=True)
        for p in range(processes):
            mine = fleet[p::processes]
            for node in mine:
                self.owner[node["hostname"]] = p
            plan = {"ports": ports, "nodes": mine, "seed": seed + p, "templates": templates,
                    "checkpoint_every": checkpoint_every, "connections": max(32, min(512, 4 * len(mine))),
                    "start_spread_s": min(20.0, 2.0 + len(fleet) / 100), "command_wait": command_wait,
                    "urgent_port": urgent_port, "fates": str(work / f"fates-{p}.json")}
            path = work / f"sim-{p}.json"
            path.write_text(json.dumps(plan))
            with (work / "logs" / f"sim-{p}.err").open("wb") as errors:
                proc = subprocess.Popen([sys.executable, "-m", "bench._fleet_sim", str(path)], cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True,
                                        start_new_session=True)
            self.procs.append(proc)
            reader = threading.Thread(target=self._read, args=(p, proc), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _read(self, index: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                log(f"simulator {index}: {line.strip()[:300]}")
                continue
            self.status[index] = message

    def send(self, fault: dict, hostname: str | None = None) -> None:
        if hostname is None:
            targets = self.procs
        else:  # a fault on a node no process owns (no job was placed) lands nowhere, and is reported so
            targets = [self.procs[self.owner[hostname]]] if hostname in self.owner else []
        for proc in targets:
            proc.stdin.write(json.dumps(fault) + "\n")
            proc.stdin.flush()

    def total(self, key: str) -> int:
        return sum(s.get(key, 0) for s in self.status)

    def maximum(self, key: str) -> float:
        return max((s.get(key, 0) for s in self.status), default=0)

    def delivered(self, kind: str) -> int:
        return sum(s.get("delivered", {}).get(kind, 0) for s in self.status)

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def landed(self) -> list[dict]:
        seen: dict[int, dict] = {}
        for s in self.status:
            for fault in s.get("faults", []):
                seen.setdefault(fault["id"], fault)  # a job-wide fault lands in several processes: the first
        return list(seen.values())

    def book(self) -> dict[str, dict[str, Counter[int]]]:
        """Every process's request book as of its last status line, added up."""
        return merge([s["book"] for s in self.status if s])

    def fates(self) -> dict[str, list[list[Any]]]:
        """What became of each job's rank 0's requests (``bench._fleet_sim.Sim.fates``), from every
        process that wrote its file on the way out (after ``close``)."""
        merged: dict[str, list[list[Any]]] = {}
        for path in sorted(self.work.glob("fates-*.json")):
            for job, fates in json.loads(path.read_text()).items():
                merged.setdefault(job, []).extend(fates)
        return {job: sorted(fates) for job, fates in merged.items()}

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for reader in self.readers:
            reader.join(10)


# --- one fleet size -----------------------------------------------------------------------------

def run_size(nodes: int, opts: argparse.Namespace, work: Path) -> dict[str, Any]:
    import psycopg

    database = f"nightwatch_fleet_bench_{nodes}"
    fleet = nodes + spares(nodes)
    with served(work, database, opts.max_heartbeats_per_s, opts.settings, urgent=opts.urgent_process) as (plane, slot):
        cast = register_cast(plane, fleet)
        sizes = job_mix(nodes)
        templates = checkpoint_templates(work.parent / "templates", {s * GPUS for s in sizes})
        processes = opts.processes or (1 if nodes <= 16 else 2 if nodes <= 256 else 3)
        sims = slot.sims = Simulators(work, plane.ports, cast["nodes"], processes, templates=templates, seed=opts.seed,
                                      command_wait=opts.command_wait, urgent_port=plane.urgent_port)
        conn = psycopg.connect(database_url(database), autocommit=True)
        log(f"{nodes} nodes: registering")
        # A fleet past the control plane's capacity registers through admission control's 503s, slowly, and
        # may never be whole: set-up waits have deadlines, and what a fleet reached by then is reported.
        healthy = "SELECT count(*) FROM nodes_node WHERE health = 'healthy'"
        running = "SELECT count(*) FROM jobs_job WHERE state = 'running' AND last_step >= 3"
        setup_figures = {"registered": settle(lambda: sims.total("registered") + sims.total("refused") == fleet,
                                              120 + fleet / 4, "every agent registered or refused"),
                         "healthy": settle(lambda: conn.execute(healthy).fetchone()[0] == fleet, 60 + fleet / 8,
                                           "every node healthy")}
        jobs = submit_jobs(plane.ports[0], cast["operator"], sizes)
        log(f"{nodes} nodes: {len(jobs)} jobs ({sizes}) submitted")
        setup_figures["jobs_training"] = settle(lambda: conn.execute(running).fetchone()[0] == len(jobs),
                                                180 + nodes / 8, "every job training")
        setup_figures.update(agents_registered=sims.total("registered"), registrations_refused=sims.total("refused"),
                             nodes_healthy=conn.execute(healthy).fetchone()[0],
                             jobs_running=conn.execute(running).fetchone()[0],
                             launch_delivery=measure.launch_delivery(conn, jobs))
        browsers, push_failed = None, None
        if opts.browsers:
            from bench.live_push import Sockets

            try:  # an overloaded server may refuse the handshakes: reported, not fatal to the run
                browsers = Sockets(SimpleNamespace(port=plane.ws_port, job=jobs[0], session=cast["session"]),
                                   opts.browsers, clock=time.time)
            except Exception as error:  # noqa: BLE001 - any failure to open them is the finding
                push_failed = f"{type(error).__name__}: {error}"
                log(f"{nodes} nodes: the browsers' sockets did not open ({push_failed})")
        try:
            result = steady(nodes, opts, plane, sims, conn, cast, jobs, sizes)
        finally:
            if browsers is not None:
                browsers.close()
        window = result.pop("window")
        result["live_push"] = (measure.live_push(conn, jobs[0], browsers.arrivals, window, browsers.relayed)
                               if browsers else
                               {"clients": opts.browsers, "error": push_failed} if push_failed else None)
        result["setup"] = setup_figures
        result["storm"] = storm(opts, plane, sims, conn, result["killed"])
        sent = [event for status in sims.status for event in status.get("fault_events", [])]
        for fault in result["faults"]:  # read last: a detection delayed past the window still counts, late
            if fault.get("at") is not None:
                latency = measure.detection(conn, fault)
                fault["detected_s"] = None if latency is None else round(latency, 2)
            kind = {"rank_exit": "exited", "xid": "xid"}.get(fault["kind"])
            if kind is not None:  # the agent's event of it, each time it was sent: where the time went
                fault["event_sends"] = [e for e in sent if e["hostname"] == fault.get("hostname") and e["kind"] == kind]
        sims.close()
        result["hangs"] = measure.hangs(conn, sims.fates())
        for hang in result["hangs"]:
            log(f"{nodes} nodes: hang of job {hang['job']}: its rank 0's requests in the {measure.HANG_LOOKBACK_S} s "
                f"before: {hang['requests']}; the last answered {hang['last_answered_s_before']} s before, "
                f"the last step report {hang['last_report_s_before']} s before")
        result.update(nodes=nodes, spares=fleet - nodes, ranks=sum(sizes) * GPUS, jobs=sizes,
                      max_heartbeats_per_s=opts.max_heartbeats_per_s, settings=opts.settings,
                      urgent_process=opts.urgent_process)
        conn.close()
        return result


@contextlib.contextmanager
def served(work: Path, database: str, max_heartbeats_per_s: float | None = None,
           settings: dict[str, str] | None = None, *, urgent: bool = False):
    """A control plane on a fresh ``database`` and a slot for its simulators, both closed on the way
    out; the plane's logs are printed when anything fails. ``max_heartbeats_per_s``: heartbeat pacing's
    rate (None: the control plane's default; 0: off); ``settings``: more ``NIGHTWATCH_*`` variables
    for the control plane's processes (``--setting``); ``urgent``: the agents' events and acks go to a
    web process of their own (``--urgent-process``)."""
    fresh_database(database, TEMPLATE_DB)
    plane = ControlPlane(work, database=database, redis_db=REDIS_DB, urgent=urgent)
    if max_heartbeats_per_s is not None:
        plane.env["NIGHTWATCH_MAX_HEARTBEATS_PER_S"] = str(max_heartbeats_per_s)
    plane.env.update(settings or {})
    fleet = SimpleNamespace(sims=None)
    try:
        plane.start()
        yield plane, fleet
    except BaseException:
        print(plane.dump_logs(), file=sys.stderr)
        raise
    finally:
        if fleet.sims is not None:
            fleet.sims.close()
        plane.close()


def register_cast(plane: ControlPlane, nodes: int) -> dict[str, Any]:
    """The operator's token and session and a bootstrap token per node, made in the plane's database."""
    made = subprocess.run([sys.executable, "-m", "bench.fleet", "--setup", str(nodes)], cwd=ROOT, env=plane.env,
                          check=True, capture_output=True, text=True)
    return json.loads(made.stdout.strip().splitlines()[-1])


# --- what one request costs -----------------------------------------------------------------------

COST_KINDS = ("heartbeat", "telemetry", "report")
COST_NODES = 8  # one 8-node job: the smallest fleet whose every request kind is real


def cost(opts: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Control-plane CPU per heartbeat, per step-report request and per telemetry sample: the web process
    (daphne, Django) and PostgreSQL's backends, read from /proc as in the steady window.

    A control plane of its own serves a small fleet of one training job; on top of its traffic the
    simulator sends ``opts.cost_requests`` requests of one kind, 4 at a time (``Sim.calibrate``). The
    CPU spent meanwhile, less the fleet's own rate measured just before, over the requests answered, is
    the cost of one. Each kind is measured ``opts.cost_runs`` times, interleaved: median and spread."""
    import psycopg

    database = "nightwatch_fleet_bench_cost"
    with served(work, database) as (plane, slot):
        cast = register_cast(plane, COST_NODES)
        templates = checkpoint_templates(work.parent / "templates", {COST_NODES * GPUS})
        sims = slot.sims = Simulators(work, plane.ports, cast["nodes"], 1, templates=templates, seed=opts.seed,
                                      command_wait=opts.command_wait)
        conn = psycopg.connect(database_url(database), autocommit=True)
        wait_for(lambda: sims.total("registered") == COST_NODES, timeout=120, what="the cost fleet registered")
        submit_jobs(plane.ports[0], cast["operator"], [COST_NODES])
        wait_for(lambda: conn.execute("SELECT count(*) FROM jobs_job WHERE state = 'running' AND last_step >= 3")
                 .fetchone()[0] == 1, timeout=180, what="the cost fleet's job training")
        runs: dict[str, list[float]] = {kind: [] for kind in COST_KINDS}
        for order, kind in enumerate(COST_KINDS * opts.cost_runs):
            runs[kind].append(_one_cost(plane, sims, conn, database, order=order, kind=kind,
                                        count=opts.cost_requests))
        conn.close()
    figures: dict[str, Any] = {"requests": opts.cost_requests, "runs": opts.cost_runs}
    for kind, name in (("heartbeat", "cpu_ms_per_heartbeat"), ("report", "cpu_ms_per_report"),
                       ("telemetry", "cpu_ms_per_telemetry_request")):
        figures[name] = round(statistics.median(runs[kind]), 2)
        figures[f"{name}_spread"] = [round(min(runs[kind]), 2), round(max(runs[kind]), 2)]
    figures["cpu_ms_per_telemetry_sample"] = round(figures["cpu_ms_per_telemetry_request"] / CALIBRATION_SAMPLES, 3)
    figures["telemetry_samples_per_request"] = CALIBRATION_SAMPLES
    return figures


def _one_cost(plane: ControlPlane, sims: Simulators, conn, database: str, *, order: int, kind: str,
              count: int) -> float:
    """CPU ms per request of one calibration burst, the fleet's own rate just before subtracted. The web
    processes and the database's backends only: the Celery worker runs beat's periodic sweeps, whose
    minute-by-minute work (rollups, partitions) would be read as the burst's."""
    def cpu() -> float:
        watched = [pid for name, pids in plane.pids().items() if name.startswith("web") for pid in pids]
        return sum(measure.cpu_seconds(watched + measure.backend_pids(conn, database)).values())

    quiet_started, quiet_cpu = time.monotonic(), cpu()
    time.sleep(COST_QUIET_S)
    background = (cpu() - quiet_cpu) / (time.monotonic() - quiet_started)
    started, before = time.monotonic(), cpu()
    sims.send({"kind": "calibrate", "id": order, "what": kind, "count": count, "concurrency": 4})
    wait_for(lambda: (sims.status[0].get("calibration") or {}).get("id") == order, timeout=300,
             what=f"{count} {kind} requests of the calibration")
    time.sleep(COST_SETTLE_S)  # the Celery work and database writes the burst caused
    spent = cpu() - before - background * (time.monotonic() - started)
    answered = sims.status[0]["calibration"]["answered"]
    if answered < count:
        raise RuntimeError(f"calibration: {count - answered} of {count} {kind} requests were not answered 2xx "
                           f"(statuses: {sims.status[0]['calibration']['statuses']})")
    return max(spent, 0.0) / answered * 1000


#: The fleet's own rate is read over this long before each burst; a burst's follow-up work over this long after.
COST_QUIET_S = 5.0
COST_SETTLE_S = 2.0


def settle(done, timeout: float, what: str) -> float | None:
    """Seconds until ``done()``, or None when the deadline passed first (logged, not fatal)."""
    started = time.monotonic()
    try:
        wait_for(done, timeout=timeout, what=what)
    except AssertionError:
        log(f"gave up waiting for {what} after {timeout:.0f} s: going on with the fleet as it is")
        return None
    return round(time.monotonic() - started, 1)


def fault_plan(rng: random.Random, jobs: list[int], sizes: list[int], placement: dict[int, list[str]],
               window: float) -> list[dict]:
    """The faults at seeded moments in the first 45% of the window, in a seeded order: node death,
    rank exit, Xid and hang each on a job of their own where the mix has enough (the biggest job
    takes the hang otherwise), the slow rank in the biggest job. The worker restart comes at 80%,
    once the others are detected: a restart in the middle of a hang's timeout would hold its verdict
    (the overload hold) and the two delays could not be told apart."""
    placed = [j for j in jobs if placement.get(j)]
    jobs = placed or jobs
    others = jobs[1:] or jobs
    victims = {kind: others[i % len(others)] for i, kind in enumerate(("node_death", "rank_exit", "xid"))}
    victims["hang"] = others[3] if len(others) > 3 else jobs[0]
    kinds = [kind for kind in FAULT_KINDS if kind != "worker_restart"]
    rng.shuffle(kinds)
    plan = []
    for i, kind in enumerate(kinds):
        fault: dict[str, Any] = {"id": i, "kind": kind, "offset": round(window * (0.05 + 0.4 * i / len(kinds)), 1)}
        if kind in ("node_death", "rank_exit", "xid"):
            fault.update(job=str(victims[kind]), hostname=rng.choice(placement.get(victims[kind]) or ["nowhere"]))
            if kind == "xid":
                fault["gpu"] = rng.randrange(GPUS)
        elif kind == "hang":
            fault["job"] = str(victims["hang"])
        else:
            fault.update(job=str(jobs[0]), rank=rng.randrange(GPUS))
        plan.append(fault)
    plan.append({"id": len(plan), "kind": "worker_restart", "offset": round(window * 0.8, 1)})
    return plan


def steady(nodes, opts, plane, sims, conn, cast, jobs, sizes) -> dict[str, Any]:
    # Faults go to jobs that train: at 1,024 nodes one job may still wait for nodes, and a rank exit
    # sent to it found no rank to end (the run of 2026-12-01 17:50 UTC reported it "not injected").
    placement = {job: [h for (h,) in conn.execute(
        "SELECT n.hostname FROM jobs_generation g JOIN jobs_generation_nodes gn ON gn.generation_id = g.id "
        "JOIN nodes_node n ON n.id = gn.node_id JOIN jobs_job j ON j.id = g.job_id "
        "WHERE g.job_id = %s AND g.number = j.generation AND j.state = 'running' AND j.last_step > 0", (job,))]
        for job in jobs}
    plan = fault_plan(random.Random(opts.seed), jobs, sizes, placement, opts.duration)
    database = plane.database
    before = measure.tables(conn)
    roles = {pid: role for role, pids in plane.pids().items() for pid in pids}  # the rest: PostgreSQL backends
    watched = list(roles) + measure.backend_pids(conn, database)
    cpu_before = measure.cpu_seconds(watched)
    sim_cpu_before = sum(measure.cpu_seconds(sims.pids()).values())
    # Who waited for a CPU, and how long a wake-up waited: the browsers' sockets are read in this
    # process, so its wait is part of the live push's last hop.
    sched_roles = {os.getpid(): "benchmark (browsers)", **dict.fromkeys(sims.pids(), "simulator")}
    sched_before = measure.schedstat(watched + list(sched_roles))
    made_before, delivered_before = sims.total("made"), sims.delivered("report")
    wakeups_before = sims.total("wakeups")
    book_before = sims.book()
    started = time.time()
    log(f"{nodes} nodes: steady window of {opts.duration:.0f} s, faults at {[f['offset'] for f in plan]}")
    depth, census, worker_away, pager = 0, {}, None, None
    # The workers that run sweeps (the default worker consumes their queue too), from where their logs are now.
    worker_logs = {log: log.stat().st_size if log.exists() else 0
                   for log in (plane.logs / "worker.log", plane.logs / "sweeper.log")}
    pending = list(plan)
    backends = set(watched)
    while time.time() - started < opts.duration:
        elapsed = time.time() - started
        while pending and pending[0]["offset"] <= elapsed:
            fault = pending.pop(0)
            if fault["kind"] == "worker_restart":
                worker_away = plane.restart_worker()
                new = [pid for pid in plane.pids().get("worker", [])]
                roles.update(dict.fromkeys(new, "worker"))
                backends.update(new)
                cpu_before.update({pid: 0.0 for pid in new})
            else:
                sims.send(fault, fault.get("hostname") if fault["kind"] in ("node_death", "rank_exit", "xid") else None)
        if pager is None and elapsed > opts.duration * 0.7:
            # On the operators' process (compose's ws: the dashboard's pages and sockets), and, for
            # comparison, on an ingest process, where a page waits behind the fleet's requests. In a
            # thread: the ingest process's 503s are waited out as a browser would, which held this
            # loop (and the faults after it) for minutes: windows of 178-238 s where 120 were asked.
            pager = Pages(plane, cast["session"], jobs[0])
        for pid in measure.backend_pids(conn, database):
            if pid not in backends:  # a backend opened during the window: counted from 0
                backends.add(pid)
                cpu_before.setdefault(pid, 0.0)
        now_depth = measure.queue_depth(plane.redis)
        if now_depth > depth:
            depth, census = now_depth, measure.queue_census(plane.redis)
        time.sleep(0.5)
    window = time.time() - started
    cpu_after = measure.cpu_seconds(list(backends))
    sched_after = measure.schedstat(list(backends) + list(sched_roles))
    used = {p: cpu_after[p] - cpu_before.get(p, cpu_after[p]) for p in cpu_after}
    cpu = sum(used.values())
    by_role: Counter[str] = Counter()
    for pid, seconds in used.items():
        by_role[roles.get(pid, "postgres")] += seconds
    sim_cpu = sum(measure.cpu_seconds(sims.pids()).values()) - sim_cpu_before
    made, delivered = sims.total("made") - made_before, sims.delivered("report") - delivered_before
    wakeups = sims.total("wakeups") - wakeups_before
    after = measure.tables(conn)
    book = since(book_before, sims.book())
    landed = {f["id"]: f for f in sims.landed()}
    faults = []
    for fault in plan:
        if fault["kind"] == "worker_restart":
            faults.append({**fault, "landed": worker_away is not None,
                           "away_s": None if worker_away is None else round(worker_away, 1)})
            continue
        hit = landed.get(fault["id"])
        faults.append({**fault, "landed": bool(hit), "at": hit and hit["at"], "detected_s": None})
    killed = {f["hostname"] for f in plan if f["kind"] == "node_death"}
    # Last: everything above is the window's, and the pages may still be waiting out refusals.
    pages, pages_on_ingest = pager.result() if pager is not None else ({}, {})
    offered = sum(sum(codes.values()) for codes in book["status"].values())
    accepted = sum(n for codes in book["status"].values() for code, n in codes.items() if 200 <= code < 300)
    fleet = nodes + spares(nodes)
    return {"window_s": round(window, 1), "window": (started, started + window), "faults": faults,
            "killed": sorted(killed),
            "cpu_s_per_node_minute": round(cpu / fleet / (window / 60), 4), "cpu_cores": round(cpu / window, 2),
            "cpu_cores_by_role": {role: round(seconds / window, 2) for role, seconds in sorted(by_role.items())},
            "simulator_cores": round(sim_cpu / window, 2),
            "run_queue_wait": measure.run_queue_wait(sched_before, sched_after, {**roles, **sched_roles}, window),
            "step_reports_made_per_s": round(made / window, 1),
            "step_reports_stored_per_s": round(delivered / window, 1),
            "queue_depth_max": depth, "queue_at_max": census,
            "discarded_tasks": measure.discarded_tasks(worker_logs),
            "sweep_gaps": measure.sweep_gaps(worker_logs),
            "dashboard_s": pages, "dashboard_on_ingest_s": pages_on_ingest,
            "heartbeat_interval_s": sims.maximum("interval_max"),
            "accepted_rps": round(accepted / window, 1), "attempted_rps": round(offered / window, 1),
            "false_unreachable": measure.unreachable_events(conn, started, time.time(), killed),
            "http": http_figures(book),
            "command_waits": command_waits(book, wakeups, window),
            "tables": measure.growth(before, after, window), "data": measure.data_per_day(before, after, window)}


def command_waits(book: dict, wakeups: int, window: float) -> dict[str, Any] | None:
    """The agents' long polls (``agents.agent.wake``): how many a second, how many woke their agent
    for a command, refused and failed. Their latency is the wait itself, not the server's work."""
    status = book["status"].get(WAIT_ENDPOINT)
    if not status:
        return None
    return {"per_s": round(sum(status.values()) / window, 1), "wakeups": wakeups, "503": status.get(503, 0),
            "errors": sum(n for code, n in status.items() if code == 0 or (code >= 400 and code != 503))}


#: How long the pages on an ingest process are tried, all three together.
PAGES_WITHIN_S = 90.0


class Pages(threading.Thread):
    """The dashboard's pages timed on the operators' process and on an ingest one, beside the loop."""

    def __init__(self, plane: ControlPlane, session: str, job: int):
        super().__init__(name="fleet-pages", daemon=True)
        self.args = (plane.ws_port, plane.ports[1], session, job)
        self.found: tuple[dict, dict] = ({}, {})
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        ws, ingest, session, job = self.args
        try:
            # The ingest process refuses most requests with a Retry-After of up to RETRY_AFTER_MAX_S:
            # without a deadline its three pages took up to 10 minutes to time (run S).
            self.found = (dashboard(ws, session, job), dashboard(ingest, session, job, within_s=PAGES_WITHIN_S))
        except BaseException as error:  # re-raised in the benchmark's thread by result()
            self.error = error

    def result(self) -> tuple[dict, dict]:
        self.join()
        if self.error is not None:
            raise self.error
        return self.found


def dashboard(port: int, session: str, job: int, *, within_s: float | None = None) -> dict[str, float | None]:
    """Server time of each page (median of 3, loopback: the wall time of the whole answer). A 503 from
    admission control is waited out as a browser's reload would (its Retry-After) and counted; after
    ``within_s`` each page is timed by what it got (None: no answer)."""
    timings: dict[str, float | None] = {}
    give_up = time.monotonic() + within_s if within_s is not None else float("inf")
    for name, path in (("overview", "/"), ("nodes", "/nodes/"), ("biggest_job", f"/jobs/{job}/")):
        runs, refused, size = [], 0, 0
        while len(runs) < 3 and refused < 30 and time.monotonic() < give_up:
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",  # noqa: S310
                                             headers={"Cookie": f"sessionid={session}"})
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310
                    size = len(response.read())
            except urllib.error.HTTPError as error:
                if error.code != 503:
                    raise
                refused += 1
                time.sleep(float(error.headers.get("Retry-After") or 1) * random.uniform(1, 1.5))
                continue
            runs.append(time.perf_counter() - started)
        timings[name] = round(statistics.median(runs), 3) if runs else None
        timings[f"{name}_kb"] = round(size / 1024, 1)
        timings[f"{name}_503"] = refused
    return timings


def storm(opts, plane: ControlPlane, sims: Simulators, conn, killed: list[str]) -> dict[str, Any]:
    """The web processes stop answering for ``opts.outage`` s; then: how long until no node is behind
    (or, on a fleet that was already behind, until the backlog is back where it was before)."""
    log(f"reconnect storm: web processes paused for {opts.outage:.0f} s")
    before = sims.book()
    backlog_before = sims.total("backlog")
    started = time.time()
    plane.pause_web(True)
    time.sleep(opts.outage)
    plane.pause_web(False)
    resumed = time.time()
    peak = sims.total("backlog")
    flushed = None
    while time.time() - resumed < opts.storm_limit:
        time.sleep(1.0)
        peak = max(peak, sims.total("backlog"))
        if sims.total("behind") == 0 or sims.total("backlog") <= backlog_before:  # back where it was
            flushed = time.time() - resumed
            break
    time.sleep(2.0)
    book = since(before, sims.book())
    server_errors = sum(n for codes in book["status"].values() for code, n in codes.items()
                        if code >= 500 and code != 503)
    return {"outage_s": opts.outage, "flush_s": None if flushed is None else round(flushed, 1),
            "backlog_before_records": backlog_before, "backlog_peak_records": peak, "server_errors": server_errors,
            "incidents": measure.incidents_between(conn, started, time.time()),
            "false_unreachable": measure.unreachable_events(conn, started, time.time(), set(killed))}


def since(before: dict, after: dict) -> dict[str, dict[str, Counter[int]]]:
    """What a merged book gained between two readings."""
    return {part: {endpoint: counts - before[part].get(endpoint, Counter()) for endpoint, counts in after[part].items()}
            for part in ("latency", "status")}


def http_figures(book: dict) -> dict[str, dict[str, Any]]:
    figures = {}
    for endpoint, histogram in sorted(book["latency"].items()):
        status = book["status"][endpoint]
        if endpoint == WAIT_ENDPOINT:  # a long poll: its latency is the wait (``command_waits``)
            continue
        if not status:
            continue
        p50, p99 = percentile(histogram, 0.5), percentile(histogram, 0.99)
        figures[endpoint] = {"requests": sum(status.values()), "p50_ms": p50 and round(p50 * 1000, 1),
                             "p99_ms": p99 and round(p99 * 1000, 1), "503": status.get(503, 0),
                             "errors": sum(n for code, n in status.items() if code == 0 or (code >= 400 and code
                                                                                           not in (409, 503)))}
    return figures


# --- the summary ---------------------------------------------------------------------------------

def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    per_kind: dict[str, list[float]] = {}
    missed: dict[str, int] = {}
    for r in results:
        for f in r["faults"]:
            if f["kind"] == "worker_restart":
                continue
            if f.get("detected_s") is None:
                missed[f["kind"]] = missed.get(f["kind"], 0) + 1
            else:
                per_kind.setdefault(f["kind"], []).append(f["detected_s"])
    detection = {k: {"p50_s": round(statistics.median(v), 2), "p95_s": round(_p95(v), 2), "n": len(v),
                     "target_p95_s": DETECTION_TARGET_S.get(k), "missed": missed.get(k, 0)}
                 for k, v in per_kind.items()}
    for kind, n in missed.items():
        detection.setdefault(kind, {"p50_s": None, "p95_s": None, "n": 0, "missed": n,
                                    "target_p95_s": DETECTION_TARGET_S.get(kind)})
    if "node_death" in detection:
        detection["node_death"]["target_p95_s"] = node_death_target_s(results)
    capacity = max(r["accepted_rps"] for r in results)
    largest = max(results, key=lambda r: r["nodes"])
    return {"detection": detection, "capacity_rps": capacity,
            "plateau": round(largest["accepted_rps"] / capacity, 3),
            "exponents": {name: report.exponent(points) for name, points in report.series(results).items()}}


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


def _setting(text: str) -> tuple[str, str]:
    """``--setting``'s argument: ``NIGHTWATCH_NAME=VALUE`` (the control plane's own variables only)."""
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"NIGHTWATCH_[A-Z0-9_]+", name):
        raise argparse.ArgumentTypeError(f"expected NIGHTWATCH_NAME=VALUE, got {text!r}")
    return name, value


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 nodes, a 60 s window, a 20 s outage: under 5 minutes")
    parser.add_argument("--nodes", help="comma-separated fleet sizes (default 64,256,1024; --quick: 64)")
    parser.add_argument("--duration", type=float, help="steady window per size, seconds (default 180; --quick 60)")
    parser.add_argument("--largest-duration", type=float, help="steady window of the largest size, seconds "
                        "(default 600: the issue's 10 minutes at 1,024 nodes; --quick: --duration)")
    parser.add_argument("--outage", type=float, help="reconnect storm: seconds the web stops (30; --quick 20)")
    parser.add_argument("--storm-limit", type=float, help="how long to wait for the spools to empty (120; --quick 60)")
    parser.add_argument("--processes", type=int, help="simulator processes (default: 1-3 by fleet size)")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--max-heartbeats-per-s", type=float, help="heartbeat pacing: the fleet's heartbeats a "
                        "second the control plane asks for (default: its NIGHTWATCH_MAX_HEARTBEATS_PER_S, 50; 0: off)")
    parser.add_argument("--setting", dest="settings", action="append", type=_setting, default=[],
                        metavar="NIGHTWATCH_NAME=VALUE", help="a setting of the control plane's processes for this "
                        "run, e.g. NIGHTWATCH_ADMISSION_WIDTH=2 (repeat for more); the result names them")
    parser.add_argument("--urgent-process", action=argparse.BooleanOptionalAction, default=True,
                        help="the agents' events and acks to a web process of their own, compose's urgent "
                        "(default; --no-urgent-process: to the ingest processes, with the rest)")
    parser.add_argument("--no-command-wait", dest="command_wait", action="store_false",
                        help="simulated agents without the command wait's long poll (agents' command_wait: false)")
    parser.add_argument("--cost-requests", type=int, default=1000, help="requests per calibration burst of the "
                        "per-request CPU cost (default 1000)")
    parser.add_argument("--cost-runs", type=int, help="calibration bursts per request kind (3; 0: skip)")
    parser.add_argument("--cost-only", action="store_true", help="measure only the per-request cost (no fleet sizes)")
    parser.add_argument("--browsers", type=int, default=20, help="WebSocket clients on the biggest job's page "
                        "during the steady window, for the live push's latency (0: none)")
    parser.add_argument("--add", action="store_true", help="add these sizes to bench/results/fleet.json's (a size "
                        "run again replaces its earlier figures) instead of starting a new result")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs, plans) for a post-mortem")
    parser.add_argument("--report", action="store_true", help="only regenerate docs/benchmarks/fleet.md from "
                        "bench/results/fleet.json")
    parser.add_argument("--setup", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    opts.settings = dict(opts.settings)
    # A SIGTERM (a CI step's timeout, an impatient person) runs the cleanup below like Ctrl-C does:
    # by default it ended only this process, leaving the control plane's processes running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if opts.report:
        report.write(json.loads((RESULTS / "fleet.json").read_text()))
        return
    if opts.setup:
        setup(opts.setup)
        return
    sizes = [int(n) for n in (opts.nodes or ("64" if opts.quick else "64,256,1024")).split(",")]
    opts.duration = opts.duration or (60.0 if opts.quick else 180.0)
    opts.largest_duration = opts.largest_duration or (opts.duration if opts.quick else 600.0)
    opts.outage = opts.outage or (20.0 if opts.quick else 30.0)
    opts.storm_limit = opts.storm_limit or (60.0 if opts.quick else 120.0)
    opts.cost_runs = 3 if opts.cost_runs is None else opts.cost_runs
    tmp = Path(tempfile.mkdtemp(prefix="nw-fleet-"))
    results: list[dict[str, Any]] = []
    costs: dict[str, Any] | None = None
    if opts.add and (RESULTS / "fleet.json").exists():
        earlier = json.loads((RESULTS / "fleet.json").read_text())["details"]
        results = [r for r in earlier["sizes"] if r["nodes"] not in sizes]
        costs = earlier.get("cost")
    try:
        if opts.cost_runs:
            log("per-request cost: a calibration fleet of one job")
            costs = cost(opts, tmp / "cost")
            log(f"per-request cost: {json.dumps(costs)}")
        if opts.cost_only:
            return
        for nodes in sizes:
            window = opts.largest_duration if nodes == max(sizes) else opts.duration
            results.append(run_size(nodes, argparse.Namespace(**{**vars(opts), "duration": window}), tmp / f"n{nodes}"))
            log(f"{nodes} nodes: {json.dumps({k: v for k, v in results[-1].items() if k != 'tables'})}")
            finish(results, costs)  # after every size: a later size that fails leaves the smaller ones reported
    finally:
        if opts.keep:
            log(f"the run's files are in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def finish(results: list[dict[str, Any]], costs: dict[str, Any] | None = None) -> None:
    summary = summarise(results)
    largest = max(results, key=lambda r: r["nodes"])
    detection_targets = {**DETECTION_TARGET_S, "node_death": node_death_target_s(results)}
    result = emit("fleet", metric="cpu_s_per_node_minute", value=largest["cpu_s_per_node_minute"], target=None,
                  better="lower", unit="CPU s per node per minute", runs=1, spread=None,
                  details={"nodes": largest["nodes"], "spares": largest.get("spares", 0), "ranks": largest["ranks"],
                           **summary, "cost": costs,
                           "targets": {"detection_p95_s": detection_targets, "plateau": 0.9, "dashboard_s": 1.0,
                                       "cpu_exponent": 1.0, "false_unreachable": 0, "server_errors": 0},
                           "sizes": results})
    report.write(result)


if __name__ == "__main__":
    main()
