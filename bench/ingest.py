"""Telemetry ingest through the real HTTP endpoint vs a raw PostgreSQL ``COPY`` of the same rows.

Many simulated agents (threads, one keep-alive connection and one node token each) post
``TelemetryBatch`` bodies to ``POST /api/v1/nodes/{id}/telemetry`` on real ``daphne`` servers
(the production ASGI server, one process per core, agents spread over them as a load balancer
would) backed by PostgreSQL. The same rows are then written with psycopg's ``cursor.copy`` into
the same table — the fastest thing a user could do without Nightwatch — and the two are
interleaved run by run. Every run starts from an empty table and ends by counting the rows, so a
request that "succeeded" without storing its samples cannot inflate the figure.

Reported: GPU samples per second through HTTP (the metric; target 10,000 = 100,000 GPUs at one
sample per 10 s), p50/p99 request latency, COPY's rate and the ratio HTTP / COPY.

    python -m bench.ingest [--quick] [--runs N] [--servers K] [--agents N] [--batch SAMPLES]

Needs PostgreSQL: ``BENCH_DATABASE_URL`` (default ``postgres://postgres@127.0.0.1:5432/nightwatch_bench``,
created and migrated when missing; its telemetry table is emptied, so the name must contain
"bench").
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

from bench._common import arguments, emit, median, spread

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/nightwatch_bench"
TARGET = 10_000.0
GPUS_PER_NODE = 8


# --- the database and the fleet ------------------------------------------------------------------

def prepare_database(url: str) -> None:
    import psycopg

    parts = urllib.parse.urlsplit(url)
    name = parts.path.lstrip("/")
    if "bench" not in name:
        raise SystemExit(f"refusing to empty tables of {name!r}: the benchmark database's name must contain 'bench'")
    admin = urllib.parse.urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=server_env(url),
                   check=True)


def server_env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    # DEBUG keeps every SQL statement in memory and slows every query down: production has it off.
    # Under ASGI each request may run on a new thread, and a persistent connection (CONN_MAX_AGE > 0)
    # stays open for every thread that ever ran one: PostgreSQL runs out of connections. So: 0.
    env.update(DATABASE_URL=url, DEBUG="0", LOG_LEVEL="WARNING", DJANGO_SETTINGS_MODULE="controlplane.settings",
               PYTHONPATH=str(ROOT), DB_CONN_MAX_AGE="0")
    return env


def make_fleet(url: str, agents: int) -> list[tuple[int, str]]:
    """``agents`` nodes with fresh agent tokens: [(node id, raw token)]."""
    os.environ.update({k: v for k, v in server_env(url).items() if k in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE",
                                                                             "DEBUG")})
    import django

    django.setup()
    from core.models import ApiToken
    from nodes.models import Node

    fleet = []
    for i in range(agents):
        node, _ = Node.objects.get_or_create(hostname=f"bench-{i:04d}",
                                             defaults={"address": f"10.9.{i // 250}.{i % 250}"})
        ApiToken.objects.filter(node=node).delete()
        _, raw = ApiToken.issue(name=f"bench {i}", scope="agent", node=node)
        fleet.append((node.pk, raw))
    from django.db import connection

    connection.close()
    return fleet


def empty_samples(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE nodes_nodegpusample, nodes_nodegpuminute")
        conn.execute("UPDATE nodes_gpu SET last_sample = '{}', last_sample_at = NULL")


def count_samples(url: str) -> int:
    import psycopg

    with psycopg.connect(url) as conn:
        # A row holds a node's GPUs at one moment; its bitmask says which: count the GPU samples.
        return conn.execute("SELECT coalesce(sum(length(replace(gpus::bit(64)::text, '0', ''))), 0) "
                            "FROM nodes_nodegpusample").fetchone()[0]


# --- the servers --------------------------------------------------------------------------------

def serve(port: int) -> None:
    """Run one daphne server in this process (``--serve PORT``)."""
    from daphne.cli import CommandLineInterface

    CommandLineInterface().run(["-b", "127.0.0.1", "-p", str(port), "--verbosity", "0",
                                "controlplane.asgi:application"])


def start_servers(url: str, count: int, first_port: int) -> list[subprocess.Popen]:
    procs = []
    for i in range(count):
        cmd = [sys.executable, "-m", "bench.ingest", "--serve", str(first_port + i)]
        # A file, not a pipe: nobody reads it while the server runs, and a full pipe would stall it.
        log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server; closed in stop_servers
        proc = subprocess.Popen(cmd, cwd=ROOT, env=server_env(url), stdout=subprocess.DEVNULL, stderr=log)
        proc.log = log
        procs.append(proc)
    deadline = time.monotonic() + 60
    for i, proc in enumerate(procs):
        while True:
            if proc.poll() is not None:
                proc.log.seek(0)
                raise SystemExit(f"server {i} exited: {proc.log.read().decode()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", first_port + i, timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"server {i} did not answer /healthz within 60 s")
            time.sleep(0.2)
    return procs


def stop_servers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.log.close()


# --- the workload -------------------------------------------------------------------------------

def sample(node: int, gpu: int, at: float, i: int) -> dict:
    """A realistic sample: every counter the NVML source reports, values that vary."""
    return {"node": str(node), "gpu": gpu, "time": at, "reachable": True, "temperature_c": 60.0 + (i % 17) / 2,
            "memory_used": (40 + i % 30) * 2**30, "memory_free": (40 - i % 30) * 2**30,
            "utilization_pct": float(90 + i % 10), "power_w": 400.0 + i % 50, "sm_clock_mhz": 1980,
            "throttle_reasons": 0, "ecc_corrected_volatile": i % 3, "ecc_uncorrected_volatile": 0,
            "ecc_corrected_aggregate": 12, "ecc_uncorrected_aggregate": 0, "ecc_corrected_recent": i % 3,
            "ecc_uncorrected_recent": 0, "retired_pages": 0, "retired_pages_pending": False,
            "remapped_rows_correctable": 0, "remapped_rows_uncorrectable": 0, "remap_pending": False,
            "remap_failed": False, "xid_total": 0, "xid_recent": 0, "recent_xid_codes": [],
            "nvlink_replay_errors": 0, "nvlink_recovery_errors": 0, "nvlink_crc_flit_errors": 0,
            "nvlink_crc_data_errors": 0, "nvlink_errors_recent": 0, "pcie_replays": 1, "window_s": 600.0}


def workload(fleet: list[tuple[int, str]], batches: int, batch: int, epoch: float) -> list[list[bytes]]:
    """Per agent, its request bodies, encoded once up front (a real agent's CPU is not ours)."""
    per_gpu = batch // GPUS_PER_NODE
    bodies = []
    for node, _ in fleet:
        mine = []
        for b in range(batches):
            start = epoch + b * per_gpu
            samples = [sample(node, gpu, start + k, k) for k in range(per_gpu) for gpu in range(GPUS_PER_NODE)]
            mine.append(json.dumps({"samples": samples}, separators=(",", ":")).encode())
        bodies.append(mine)
    return bodies


def run_http(fleet, bodies, ports, samples_per_body: int) -> dict:
    """Every agent posts its bodies back to back; returns samples/s and request latencies."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    ready = threading.Barrier(len(fleet) + 1)

    def agent(index: int) -> None:
        node, token = fleet[index]
        conn = http.client.HTTPConnection("127.0.0.1", ports[index % len(ports)], timeout=120)
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        mine = []
        ready.wait()
        for body in bodies[index]:
            started = time.perf_counter()
            conn.request("POST", f"/api/v1/nodes/{node}/telemetry", body, headers)
            response = conn.getresponse()
            answer = response.read()
            mine.append(time.perf_counter() - started)
            if response.status != 202:
                with lock:
                    failures.append(f"{response.status}: {answer[:300]!r}")
        conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(fleet))]
    for t in threads:
        t.start()
    ready.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise SystemExit(f"{len(failures)} requests failed, e.g. {failures[0]}")
    samples = sum(len(mine) for mine in bodies) * samples_per_body
    latencies.sort()
    return {"seconds": elapsed, "samples": samples, "rate": samples / elapsed, "requests": len(latencies),
            "p50_ms": 1000 * latencies[len(latencies) // 2], "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)]}


#: The raw table's charted columns, as COPY writes them: a row per node and moment, a value per GPU.
COPY_COLUMNS = ["node_id", "time", "gpus", "temperature_c", "utilization_pct", "memory_used_mib", "power_w",
                "sm_clock_mhz"]


def copy_rows(bodies) -> tuple[list[str], list[tuple]]:
    """The same samples as the HTTP run, laid out as the raw table stores them (one row per node
    and moment, a value per GPU), decoded and grouped before the clock starts."""
    from datetime import UTC, datetime

    moments: dict[tuple[int, float], dict[int, dict]] = {}
    for mine in bodies:
        for body in mine:
            for s in json.loads(body)["samples"]:
                moments.setdefault((int(s["node"]), s["time"]), {})[s["gpu"]] = s
    rows = []
    for (node, at), gpus in moments.items():
        ordered = [gpus.get(g) for g in range(max(gpus) + 1)]

        def each(name, convert, ordered=ordered):
            return [convert(s[name]) if s and s.get(name) is not None else None for s in ordered]

        rows.append((node, datetime.fromtimestamp(at, tz=UTC), sum(1 << g for g in gpus),
                     each("temperature_c", round), each("utilization_pct", round),
                     each("memory_used", lambda b: b >> 20), each("power_w", round), each("sm_clock_mhz", int)))
    return COPY_COLUMNS, rows


def run_copy(url: str, columns: list[str], rows: list[tuple]) -> dict:
    import psycopg

    with psycopg.connect(url) as conn:
        started = time.perf_counter()
        with conn.cursor() as cur, cur.copy(f"COPY nodes_nodegpusample ({', '.join(columns)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        conn.commit()
        elapsed = time.perf_counter() - started
    samples = sum(bin(row[2]).count("1") for row in rows)
    return {"seconds": elapsed, "samples": samples, "rate": samples / elapsed}


# --- main ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    own.add_argument("--servers", type=int, default=os.cpu_count() or 2)
    own.add_argument("--agents", type=int)
    own.add_argument("--batches", type=int, help="requests per agent per run")
    own.add_argument("--batch", type=int, default=256, help="samples per request (8 GPUs x batch/8 samples)")
    own.add_argument("--port", type=int, default=18700)
    opts, rest = own.parse_known_args(argv)
    if opts.serve:
        serve(opts.serve)
        return
    args = arguments(__doc__.splitlines()[0], rest)
    agents = opts.agents or (16 if args.quick else 48)
    batches = opts.batches or (8 if args.quick else 20)
    url = os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL)

    prepare_database(url)
    fleet = make_fleet(url, agents)
    servers = start_servers(url, opts.servers, opts.port)
    ports = [opts.port + i for i in range(opts.servers)]
    http_runs, copy_runs = [], []
    try:
        # A warm-up request per agent: connections, token caches and query plans are not what we measure.
        empty_samples(url)
        per_body = opts.batch // GPUS_PER_NODE * GPUS_PER_NODE
        # Recent times: samples older than the raw retention are accepted but not stored.
        epoch = time.time() - 2 * 3600
        run_http(fleet, workload(fleet, 1, opts.batch, epoch - 600), ports, per_body)
        for run in range(args.runs):
            bodies = workload(fleet, batches, opts.batch, epoch)  # each run starts from empty tables
            empty_samples(url)
            result = run_http(fleet, bodies, ports, per_body)
            stored = count_samples(url)
            if stored != result["samples"]:
                raise SystemExit(f"run {run}: {result['samples']} samples accepted but {stored} stored")
            http_runs.append(result)
            columns, rows = copy_rows(bodies)
            empty_samples(url)
            copy_runs.append(run_copy(url, columns, rows))
            print(f"run {run + 1}/{args.runs}: HTTP {result['rate']:,.0f} samples/s (p50 {result['p50_ms']:.0f} ms, "
                  f"p99 {result['p99_ms']:.0f} ms, {result['requests']} requests), COPY {copy_runs[-1]['rate']:,.0f} "
                  f"samples/s", flush=True)
    except SystemExit:
        for proc in servers:
            proc.log.seek(0)
            print(proc.log.read().decode()[-3000:], file=sys.stderr)
        raise
    finally:
        stop_servers(servers)
        empty_samples(url)
    rates = [r["rate"] for r in http_runs]
    ratios = [h["rate"] / c["rate"] for h, c in zip(http_runs, copy_runs)]
    emit("ingest", metric="http_samples_per_s", value=round(median(rates)), target=TARGET, better="higher",
         unit="GPU samples/s", runs=args.runs, spread=[round(v) for v in spread(rates)],
         details={"p99_ms": round(median([r["p99_ms"] for r in http_runs]), 1),
                  "p50_ms": round(median([r["p50_ms"] for r in http_runs]), 1),
                  "copy_samples_per_s": round(median([c["rate"] for c in copy_runs])),
                  "http_over_copy": round(median(ratios), 3), "http_over_copy_spread": [round(v, 3) for v in
                                                                                       spread(ratios)],
                  "servers": opts.servers, "agents": agents, "requests_per_agent": batches,
                  "samples_per_request": opts.batch,
                  "server": "daphne (ASGI), DEBUG off, PostgreSQL",
                  "runs": [{"http": h, "copy": c} for h, c in zip(http_runs, copy_runs)]})


if __name__ == "__main__":
    main()
