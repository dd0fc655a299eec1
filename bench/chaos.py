"""Goodput under injected failures: Nightwatch vs plain ``torchrun --max-restarts``, same faults.

A seeded fault schedule (``bench/_faults.py``: exponential gaps with a chosen mean time between
failures; rank SIGKILL, rank SIGSTOP, agent death, a scripted Xid, a NaN loss, a corrupted newest
checkpoint, a control-plane outage) is played against the example job (``examples/train.py``,
2 ranks on CPU/gloo, 0.1 s steps) on two sides at the same time (so both share the machine's
load; ``--one-at-a-time`` runs them one after the other), each for the same wall time:

- **Nightwatch**: daphne + a Celery worker with beat + two node agents (node-b a spare), the
  job launched through the API with ``checkpoint_policy.interval: auto`` (Young/Daly). When the
  job pauses, the harness plays the on-call human: after ``--human-response-s`` it approves the
  resume through the API (counted as a human intervention). A killed agent is restarted after
  ``--agent-restart-s`` like systemd would; an outage restarts daphne on the same port.
- **plain torchrun**: ``torch.distributed.run --standalone --max-restarts=N`` with a fixed
  checkpoint interval; the hooks resume from the newest checkpoint in ``--ckpt-dir`` that passes
  their manifest check. Faults that need a part plain torchrun does not have (agent, control
  plane, GPU telemetry) are recorded as not applicable.

From the per-rank ``--log-samples`` lines (``bench/_goodput.py``): ETTR, lost steps, samples
trained twice or skipped; per fault: detection (Nightwatch: the incident; torchrun: its first log
line about the failed worker) and recovery (the first step of the next resumed segment) time.
Writes ``bench/results/chaos.json`` and ``docs/benchmarks/chaos.md`` + ``chaos.png``.

    python -m bench.chaos [--quick] [--runs N] [--seed S] [--duration S] [--mtbf S] [--sides nightwatch,torchrun]

``--quick``: one run of 180 s, MTBF 30 s (about 4 minutes with start-up). Full: three runs of 30
minutes, MTBF 3 minutes (about 95 minutes; ``make bench`` runs one, ``make bench-chaos`` three).
Every finished run is kept under ``bench/results/chaos-runs/`` (``bench/_chaos_runs.py``) and the
report covers the newest ``--spread`` (3) runs made with exactly the same settings, whichever
invocation made them: ``make bench``'s one run and a later ``--runs 2`` report a spread over three
(``--fresh``: this invocation's runs only).
Needs PostgreSQL and Redis: ``BENCH_DATABASE_URL`` (default ``postgres://postgres@127.0.0.1:5432/nightwatch_bench_chaos``;
created, migrated and emptied: the name must contain "bench") and ``BENCH_CHAOS_REDIS_DB``
(default 10, flushed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from pathlib import Path

from bench import _chaos_runs
from bench import _faults as F
from bench._common import command_line, emit, median, spread
from bench._goodput import Record, account, percentiles, stream_positions
from bench.recovery import MARKER  # the variable bench.recovery.marked() looks for

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/nightwatch_bench_chaos"
REDIS_DB = int(os.environ.get("BENCH_CHAOS_REDIS_DB", "10"))
STEP_S = 0.1
WORLD_SIZE, BATCH_SIZE = 2, 4
#: Larger than any run's data (30 min x ~8 steps/s x 8 samples), so every id has one position.
DATASET_SIZE = 200_000
TARGET_ETTR = 0.90
SHARD_SKIP = {"manifest.json", "COMMITTED", ".metadata"}
POLL_S = 0.1
#: Nightwatch side: heartbeats every second, a node unreachable after this many missed.
HEARTBEAT_MISSES = 10
STARTUP_FLOOR_S = 20


def train_args(work: Path, ckpt_every: int) -> list[str]:
    return ["--steps", "100000000", "--ckpt-every", str(ckpt_every), "--min-step-time", str(STEP_S),
            "--dataset-size", str(DATASET_SIZE), "--batch-size", str(BATCH_SIZE),
            "--log-samples", str(work / "samples"), "--fault-file", str(work / "fault.json")]


# --- what both sides share -----------------------------------------------------------------------

class Side:
    """One side of the comparison: starts the job, injects faults into it, and keeps the record."""

    name = "side"

    def __init__(self, base: Path, opts: argparse.Namespace):
        from bench.recovery import Tail

        self.opts = opts
        self.work = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=base))
        (self.work / "samples").mkdir()
        self.tail = Tail(self.work, ("samples/rank*.jsonl",))
        self.t0 = time.time()
        self.injected: list[dict] = []
        self.corrupted: list[dict] = []  # {"path", "step", "at"}
        self.commits: dict[str, dict] = {}  # checkpoint dir -> {"step", "committed_at"}
        self.notes: list[str] = []
        self._nan_order: dict | None = None
        self._last_scan = 0.0

    # Every side implements these.
    def start(self) -> None: ...
    def ranks(self) -> dict[int, int]: ...
    def stop(self) -> None: ...
    def findings(self) -> dict: return {}

    def tick(self) -> None:
        now = time.time()
        # Renaming keeps the file's mtime, so the poll's time is when the order fired.
        if self._nan_order and not self._nan_order.get("fired_at") and (self.work / "fault.json.done").exists():
            self._nan_order["fired_at"] = round(now - self.t0, 3)
        if now - self._last_scan > 1.0:
            self._last_scan = now
            self._scan_commits()

    def _scan_commits(self) -> None:
        for marker in committed_markers(self.work / "ckpt"):
            key = str(marker.parent)
            if key not in self.commits:
                try:
                    step = json.loads(marker.read_text()).get("step")
                    self.commits[key] = {"step": step, "committed_at": marker.stat().st_mtime}
                except (OSError, ValueError):
                    continue

    def last_step(self) -> int:
        steps = [r["step"] for _, r in self.tail.samples()[-8:]]
        return max(steps) if steps else 0

    def running_rank(self, rank: int, deadline: float) -> int | None:
        while time.time() < deadline:
            pid = self.ranks().get(rank)
            if pid:
                return pid
            time.sleep(0.2)
        return None

    def inject(self, fault: F.Fault, end: float) -> dict:
        entry = {"kind": fault.kind, "scheduled_s": fault.at, "target": fault.target}
        try:
            entry.update(self.apply(fault, end))
        except Exception as error:  # noqa: BLE001 - a fault that could not be injected is reported, not fatal
            entry.update(applied=False, note=f"injection failed: {error!r}")
        entry.setdefault("at_s", round(time.time() - self.t0, 3))
        self.injected.append(entry)
        print(f"  [{self.name}] {entry['at_s']:7.1f} s {fault.kind:21} "
              f"{'applied' if entry.get('applied') else 'NOT applied'} {entry.get('note', '')}", flush=True)
        return entry

    def apply(self, fault: F.Fault, end: float) -> dict:
        deadline = min(time.time() + 30, end)
        if fault.kind in (F.RANK_KILL, F.RANK_HANG):
            pid = self.running_rank(fault.rank, deadline)
            if pid is None:
                return {"applied": False, "note": "no running rank within 30 s"}
            pid = self.worker(pid)  # a hang stops the process that trains, as a kill kills it
            at = time.time()
            os.kill(pid, signal.SIGKILL if fault.kind == F.RANK_KILL else signal.SIGSTOP)
            return {"applied": True, "at_s": round(at - self.t0, 3), "pid": pid}
        if fault.kind == F.NAN:
            order = {"nan_at_step": self.last_step() + 1, "rank": fault.rank}
            staging = self.work / "fault.json.tmp"
            staging.write_text(json.dumps(order))
            (self.work / "fault.json.done").unlink(missing_ok=True)
            os.replace(staging, self.work / "fault.json")
            self._nan_order = {**order}
            return {"applied": True, "order": self._nan_order}
        if fault.kind == F.CORRUPT_CHECKPOINT:
            self._scan_commits()
            corrupted = corrupt_newest(self.work / "ckpt")
            note = "no committed checkpoint yet: only the crash" if corrupted is None else ""
            if corrupted:
                corrupted["at"] = time.time()
                self.corrupted.append(corrupted)
            pid = self.running_rank(fault.rank, deadline)
            if pid is None:
                return {"applied": corrupted is not None, "corrupted": corrupted, "note": "no running rank to kill"}
            pid = self.worker(pid)
            at = time.time()
            os.kill(pid, signal.SIGKILL)
            return {"applied": True, "at_s": round(at - self.t0, 3), "corrupted": corrupted and
                    {"path": corrupted["path"], "step": corrupted["step"]}, "note": note}
        return self.apply_own(fault, end)

    def apply_own(self, fault: F.Fault, end: float) -> dict:
        return {"applied": False, "note": f"not applicable to {self.name}"}

    def worker(self, pid: int) -> int:
        """The process that trains for the rank ``ranks()`` named (see ``tests.e2e.cluster.worker_of``):
        a SIGKILL, like the OOM killer's, or a SIGSTOP goes to it, not to a warm client standing for
        it (stopping a client, which only waits, hangs nothing)."""
        return pid

    def records(self) -> list[Record]:
        return [Record.parse(seen, r) for seen, r in self.tail.samples()]


def committed_markers(root: Path) -> list[Path]:
    """Every ``COMMITTED`` marker under ``root``. Checkpoint retention deletes directories while
    we walk, so a walk that loses a directory under its feet is simply made again."""
    for _ in range(5):
        try:
            return list(root.glob("**/COMMITTED"))
        except FileNotFoundError:
            continue
    return []


def corrupt_newest(root: Path) -> dict | None:
    """Flip 64 bytes in the middle of the biggest shard of the newest committed checkpoint."""
    committed = []
    for marker in committed_markers(root):
        try:
            committed.append((marker.stat().st_mtime, marker))
        except FileNotFoundError:  # deleted by retention since the walk
            continue
    committed = [marker for _, marker in sorted(committed)]
    if not committed:
        return None
    directory = committed[-1].parent
    shards = sorted((p for p in directory.iterdir() if p.is_file() and p.name not in SHARD_SKIP),
                    key=lambda p: p.stat().st_size)
    if not shards:
        return None
    shard = shards[-1]
    with open(shard, "r+b") as f:
        middle = max(0, shard.stat().st_size // 2 - 32)
        f.seek(middle)
        chunk = f.read(64)
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in chunk))
    step = json.loads((directory / "COMMITTED").read_text()).get("step")
    return {"path": str(directory), "shard": shard.name, "step": step}


# --- Nightwatch ----------------------------------------------------------------------------------

class NightwatchSide(Side):
    name = "nightwatch"

    def __init__(self, base: Path, opts: argparse.Namespace, schedule: list[F.Fault], url: str):
        super().__init__(base, opts)
        self.schedule, self.url = schedule, url
        self.cluster = None
        self.job_id: int | None = None
        self.pending: list[tuple[float, str, str]] = []  # (when, action, target)
        self.paused_since: float | None = None
        self.interventions: list[dict] = []
        self.interval_seen: list[tuple[float, int | None]] = []

    def start(self) -> None:
        from bench.recovery import bootstrap_token, operator_token, prepare
        from nodes.models import Node
        from tests.e2e.cluster import Cluster, api, wait_for
        from tests.ports import free_port

        prepare(self.url)
        name = urllib.parse.urlsplit(self.url).path.lstrip("/")
        self.cluster = Cluster(self.work / "cluster", database_name=name, redis_db=REDIS_DB, settings={
            "DATABASE_URL": self.url, "DEBUG": "0", "NIGHTWATCH_HEARTBEAT_INTERVAL_S": "1",
            # The job's checkpoint_policy.dir (work/ckpt) must lie inside the checkpoint root.
            "NIGHTWATCH_CHECKPOINT_ROOT": str(self.work),
            # Unreachable after 10 s of silence (production: 3 x 5 s): longer than a restarting agent
            # is away, as in production, where systemd restarts it within a second or two.
            "NIGHTWATCH_HEARTBEAT_MISSES": str(HEARTBEAT_MISSES),
            # Scaled like progress_timeout_s: a generation that starts in 3-7 s here is hung after
            # 3 x its slowest start but not before 20 s (production floor: 60 s).
            "NIGHTWATCH_STARTUP_TIMEOUT_FLOOR_S": str(STARTUP_FLOOR_S),
            "NIGHTWATCH_SWEEP_INTERVAL_S": "0.5", "NIGHTWATCH_GPU_MTBF_HOURS": str(self.opts.gpu_mtbf_hours)})
        self.cluster.start_web()
        self.cluster.start_worker(checkpoint_worker=True)
        self.operator, self.oncall = operator_token(), oncall_token()
        self.t0 = time.time()  # the nodes come up: the side's clock starts (the Xid is scripted from here)
        for host in ("node-a", "node-b"):
            self.start_agent(host, bootstrap_token())
        wait_for(lambda: Node.objects.filter(health="healthy").count() == 2, timeout=60, what="two healthy nodes")
        Node.objects.filter(hostname="node-b").update(is_spare=True)
        body = {"name": "chaos", "entrypoint": "examples/train.py", "nnodes": 1, "nproc_per_node": WORLD_SIZE,
                "accelerator": "cpu", "rdzv_port": free_port(), "args": train_args(self.work, self.opts.ckpt_every),
                # Young/Daly; until it has a recommendation the script's --ckpt-every stands (the API
                # refuses interval_steps beside interval: auto).
                "checkpoint_policy": {"dir": str(self.work / "ckpt"), "interval": "auto",
                                      **({"snapshot_every": 1} if self.opts.inprocess else {})},
                "recovery_policy": {"backoff_seconds": 0, "progress_timeout_s": self.opts.progress_timeout,
                                    # the same restart budget as plain torchrun's --max-restarts
                                    "max_restarts": self.opts.max_restarts, "window_minutes": 60,
                                    **({"inprocess_restarts": self.opts.inprocess} if self.opts.inprocess else {})}}
        status, job = api(self.cluster, self.operator, "POST", "/api/v1/jobs", body)
        if status != 201:
            raise RuntimeError(f"launch refused ({status}): {job}")
        self.job_id = job["id"]

    def start_agent(self, host: str, token: str | None = None) -> None:
        """(Re)start a node's agent; node-a's scenario holds the scheduled Xids still to come,
        timed from this start (the scripted source plays events at offsets from its own start)."""
        now = time.time()
        events = [{"at": f"{max(0.0, self.t0 + f.at - now):.3f}s", "gpu": 0, "xid": F.XID_CODE}
                  for f in self.schedule if f.kind == F.XID and host == F.PRIMARY_NODE and self.t0 + f.at > now]
        self.cluster.start_agent(host, bootstrap_token=token, scenario={"gpus": 1, "events": events},
                                 extra=["--warm-workers", "true"] if self.opts.inprocess else None)

    def job(self):
        from jobs.models import Job

        return Job.objects.get(pk=self.job_id)

    def ranks(self) -> dict[int, int]:
        from tests.e2e.cluster import rank_pids

        return rank_pids(self.job_id, self.job().generation, self.cluster.tmp)

    def worker(self, pid: int) -> int:
        from tests.e2e.cluster import worker_of

        return worker_of(pid)

    def job_node(self) -> str | None:
        from jobs.models import Generation

        generation = Generation.objects.filter(job_id=self.job_id).order_by("-number").first()
        hosts = list(generation.nodes.values_list("hostname", flat=True)) if generation else []
        return hosts[0] if hosts else None

    def apply_own(self, fault: F.Fault, end: float) -> dict:
        if fault.kind == F.AGENT_DEATH:
            host = self.job_node() or F.PRIMARY_NODE
            proc = self.cluster.procs[f"agent-{host}"]
            at = time.time()
            os.kill(proc.popen.pid, signal.SIGKILL)  # the agent only: its torchrun lives in a session of its own
            self.pending.append((at + self.opts.agent_restart_s, "restart_agent", host))
            return {"applied": True, "at_s": round(at - self.t0, 3), "node": host}
        if fault.kind == F.XID:
            # Scripted into node-a's telemetry before its agent started; it fires at the scheduled time.
            return {"applied": True, "at_s": fault.at, "node": F.PRIMARY_NODE, "job_node": self.job_node()}
        if fault.kind == F.CONTROL_PLANE_OUTAGE:
            at = time.time()
            self.cluster.procs["web"].kill(signal.SIGKILL)
            self.cluster.procs["web"].popen.wait(10)
            self.pending.append((at + fault.duration_s, "restart_web", "web"))
            return {"applied": True, "at_s": round(at - self.t0, 3)}
        return super().apply_own(fault, end)

    def tick(self) -> None:
        super().tick()
        now = time.time()
        for item in [p for p in self.pending if p[0] <= now]:
            self.pending.remove(item)
            _, action, target = item
            if action == "restart_agent":
                self.start_agent(target)
            else:
                self.cluster.start_web()
            print(f"  [{self.name}] {time.time() - self.t0:7.1f} s {action} {target}", flush=True)
        if any(action == "restart_web" for _, action, _ in self.pending):
            return  # the API is down: nobody can look at the job, nor approve anything
        self.human()

    def human(self) -> None:
        """The on-call person: a paused job is looked at and approved after the response time."""
        from tests.e2e.cluster import api

        job = self.job()
        if not self.interval_seen or self.interval_seen[-1][1] != job.recommended_interval_steps:
            self.interval_seen.append((round(time.time() - self.t0, 1), job.recommended_interval_steps))
        if job.state != "paused":
            self.paused_since = None
            return
        now = time.time()
        if self.paused_since is None:
            self.paused_since = now
            return
        if now - self.paused_since < self.opts.human_response_s:
            return
        status, body = api(self.cluster, self.oncall, "POST", f"/api/v1/jobs/{self.job_id}/approve",
                           {"reason": f"chaos bench: on-call approves after {self.opts.human_response_s:g} s"})
        self.interventions.append({"paused_at_s": round(self.paused_since - self.t0, 2),
                                   "approved_at_s": round(now - self.t0, 2), "pause_reason": job.pause_reason,
                                   "status": status, "answer": None if status == 200 else body})
        self.paused_since = None if status == 200 else now  # refused: look again after another response time
        print(f"  [{self.name}] {now - self.t0:7.1f} s on-call approves ({status}): {job.pause_reason}", flush=True)

    def stop(self) -> None:
        from jobs.choices import JobState
        from tests.e2e.cluster import api

        if self.cluster is None:
            self.tail.close()
            return
        try:
            if self.job_id and self.cluster.procs["web"].alive and self.job().state not in JobState.TERMINAL:
                api(self.cluster, self.operator, "POST", f"/api/v1/jobs/{self.job_id}/cancel",
                    {"reason": "chaos bench: the run's time is up"})
        finally:
            self.tail.close()
            self.cluster.close()

    def findings(self) -> dict:
        from jobs.models import Incident

        incidents = [{"at_s": round(i.detected_at.timestamp() - self.t0, 3), "kind": i.kind, "decision": i.decision,
                      "state": i.state} for i in Incident.objects.filter(job_id=self.job_id).order_by("detected_at")]
        job = self.job()
        return {"incidents": incidents, "human_interventions": self.interventions, "final_state": job.state,
                "generations": job.generation, "recommended_interval_steps": self.interval_seen,
                "detections": [(i["at_s"], i["kind"]) for i in incidents]}


def oncall_token() -> str:
    from django.contrib.auth.models import Group, User

    from core.models import ApiToken

    user, _ = User.objects.get_or_create(username="bench-oncall")
    user.groups.add(Group.objects.get(name="oncall"))
    return ApiToken.issue(name="bench pager", scope="oncall", user=user)[1]


# --- plain torchrun ------------------------------------------------------------------------------

class PlainSide(Side):
    name = "torchrun"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NIGHTWATCH", "DATABASE_URL", "REDIS_URL"))}
        env.update({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO",
                    MARKER: str(self.work)})
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD_SIZE}", "--standalone",
                f"--max-restarts={self.opts.max_restarts}", "examples/train.py",
                *train_args(self.work, self.opts.ckpt_every), "--ckpt-dir", str(self.work / "ckpt")]
        self.log = open(self.work / "torchrun.log", "ab")  # noqa: SIM115 - closed in stop()
        self.t0 = time.time()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.exited_at: float | None = None

    def ranks(self) -> dict[int, int]:
        from bench.recovery import marked

        attempts: dict[int, dict[int, int]] = {}
        for pid, env in marked(str(self.work)).items():
            restart = [e for e in env if e.startswith(b"TORCHELASTIC_RESTART_COUNT=")]
            rank = [e for e in env if e.startswith(b"RANK=")]
            if restart and rank:
                attempts.setdefault(int(restart[0].split(b"=")[1]), {})[int(rank[0].split(b"=")[1])] = pid
        return attempts[max(attempts)] if attempts else {}

    def tick(self) -> None:
        super().tick()
        if self.exited_at is None and self.proc.poll() is not None:
            self.exited_at = time.time()
            print(f"  [{self.name}] {self.exited_at - self.t0:7.1f} s torchrun exited ({self.proc.returncode})",
                  flush=True)

    def stop(self) -> None:
        from bench.recovery import marked, stop_group

        self.tail.close()
        if hasattr(self, "proc"):
            stop_group(self.proc)
            self.log.close()
        for pid in marked(str(self.work)):  # torchrun starts each worker in a session of its own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def findings(self) -> dict:
        from bench.recovery import FAILURE_LINE, glog_time

        text = (self.work / "torchrun.log").read_text(errors="replace").splitlines()
        times = (glog_time(line, self.t0) for line in text if FAILURE_LINE.search(line))
        detections = sorted(t - self.t0 for t in times if t is not None)
        return {"detections": [(round(d, 3), "worker_failed") for d in detections], "human_interventions": [],
                "exited_at_s": self.exited_at and round(self.exited_at - self.t0, 2),
                "returncode": self.proc.returncode, "max_restarts": self.opts.max_restarts}


# --- one run of one side -------------------------------------------------------------------------

#: Set when the run is cut short (SIGTERM, a failed side): every side's loop ends and cleans up.
ABORT = threading.Event()


def play(side: Side, schedule: list[F.Fault], duration_s: float) -> dict:
    try:
        side.start()
        end = side.t0 + duration_s
        pending = list(schedule)
        while time.time() < end:
            if ABORT.is_set():
                raise RuntimeError(f"{side.name}: run aborted")
            side.tick()
            if pending and time.time() >= side.t0 + pending[0].at:
                side.inject(pending.pop(0), end)
            time.sleep(POLL_S)
        side.tick()
        records = side.records()
    finally:
        side.stop()
    return summarise_side(side, records, duration_s)


def summarise_side(side: Side, records: list[Record], duration_s: float) -> dict:
    from agents.hooks.data import epoch_permutation

    positions = stream_positions(epoch_permutation(DATASET_SIZE, 0, seed=0))
    ledger = account(records, wall_s=duration_s, position=positions)
    extra = side.findings()
    starts = [(s.seen - side.t0, s.step) for s in ledger.segment_starts]
    corrupt_loaded = corrupt_loads(side, ledger.segment_starts)
    detections = sorted(extra["detections"])  # (s after start, what noticed it)
    faults = sorted(side.injected, key=lambda e: e["at_s"])
    for fault in faults:
        fired = fault.get("order", {}).get("fired_at") if fault["kind"] == F.NAN else None
        fault["effective_at_s"] = fired or fault["at_s"]
    attribute(faults, detections, starts, duration_s)
    naive_loaded = []
    for t, _ in starts[1:]:
        seen = side.t0 + t
        earlier = [c for c in side.corrupted if c["at"] < seen]
        newest = max((c for c in side.commits.items() if c[1]["committed_at"] < seen),
                     key=lambda c: c[1]["committed_at"], default=None)
        if newest and any(c["path"] == newest[0] for c in earlier):
            naive_loaded.append({"at_s": round(t, 2), "newest_dir": newest[0], "step": newest[1]["step"]})
    steps = sorted((r.seen - side.t0, r.step) for r in records if r.rank == 0)
    by_kind: dict[str, dict] = {}
    for kind in F.KINDS:
        rows = [f for f in faults if f["kind"] == kind]
        if rows:
            by_kind[kind] = {
                "injected": sum(1 for f in rows if f.get("applied")), "scheduled": len(rows),
                "detection_s": percentiles([f["detection_s"] for f in rows if f.get("detection_s") is not None]),
                "recovery_s": percentiles([f["recovery_s"] for f in rows if f.get("recovery_s") is not None]),
                "detected": sum(1 for f in rows if f.get("detection_s") is not None),
                "recovered": sum(1 for f in rows if f.get("recovery_s") is not None)}
    first_step = starts[0][0] if starts else None
    return {"system": side.name, **ledger.as_dict(), "first_step_s": first_step and round(first_step, 2),
            # the same ratio without the cold start, which a 3-minute run on a loaded machine is dominated by
            "ettr_after_first_step": round(ledger.productive_s / (duration_s - first_step), 4)
            if first_step is not None and first_step < duration_s else None,
            "faults": faults, "by_kind": by_kind,
            "corrupt_checkpoints_loaded": len(corrupt_loaded), "corrupt_loads": corrupt_loaded,
            "newest_dir_was_corrupt_at_resume": len(naive_loaded), "naive_resume_cases": naive_loaded,
            "corrupted": [{k: v for k, v in c.items() if k != "at"} for c in side.corrupted],
            "human_interventions_count": len(extra.get("human_interventions", [])),
            "segment_starts": [[round(t, 2), s] for t, s in starts], "timeline": thin(steps), **extra}


def corrupt_loads(side: Side, starts: list) -> list[dict]:
    """The resumes that loaded a checkpoint directory corrupted before them. The script names what
    each run or round restored in its first sample line (``restored``): a corrupted directory there
    is a corrupt load. An in-memory snapshot of the same step is not: it has its own hashes, and an
    in-process restart, or a pause that saved a checkpoint at the step its snapshot holds, resumes
    from it with the disk copy of that step corrupted. A start the script named nothing for (a
    script without the field) is judged by its step, as before: one past a corrupted checkpoint's."""
    loads = []
    for start in starts[1:]:
        earlier = [c for c in side.corrupted if c["at"] < start.seen]
        if start.restored is not None:
            hit = any(Path(start.restored).resolve() == Path(c["path"]).resolve() for c in earlier)
        else:
            hit = any(c["step"] == start.step - 1 for c in earlier)
        if hit:
            loads.append({"at_s": round(start.seen - side.t0, 2), "step": start.step - 1,
                          "restored": start.restored})
    return loads


#: What each fault should be noticed as: Nightwatch's incident kinds, plain torchrun's failed worker.
#: Faults without an entry (outage, agent death) take whatever is noticed before the next fault.
NOTICED_AS = {F.RANK_KILL: {"crash", "hang", "worker_failed"}, F.CORRUPT_CHECKPOINT: {"crash", "hang", "worker_failed"},
              F.RANK_HANG: {"hang", "worker_failed"}, F.NAN: {"numerical"}, F.XID: {"hardware"}}


def attribute(faults: list[dict], detections: list[tuple[float, str]], starts: list[tuple[float, int]],
              duration_s: float) -> None:
    """Give each applied fault its detection and its recovery.

    Detection: the first detection of the kind the fault should cause, not yet given to an earlier
    fault and before the next fault that causes the same kind (faults overlap: a crash can come
    while the previous fault is still being handled).
    Recovery: the first resumed segment after the fault and before the next applied fault; a resume
    that only came after later faults is named in ``resumed_after_later_faults`` and not counted."""
    used: set[int] = set()
    applied = [f for f in faults if f.get("applied")]
    for i, fault in enumerate(applied):
        at = fault["effective_at_s"]
        until = applied[i + 1]["effective_at_s"] if i + 1 < len(applied) else duration_s
        wanted = NOTICED_AS.get(fault["kind"])
        # A detection of the same kind after a later fault that causes that kind belongs to the later one.
        rival = [f["effective_at_s"] for f in applied[i + 1:]
                 if wanted is None or NOTICED_AS.get(f["kind"], set()) & wanted]
        limit = rival[0] if rival else duration_s
        for j, (seen, kind) in enumerate(detections):
            if j in used or seen < at - 0.05 or seen >= limit:
                continue
            if wanted is None or kind in wanted:
                used.add(j)
                fault["detection_s"], fault["detected_as"] = round(seen - at, 3), kind
                break
        resumed = [(t, step) for t, step in starts[1:] if t > at]
        if resumed and resumed[0][0] < until:
            fault["recovery_s"], fault["resumed_step"] = round(resumed[0][0] - at, 3), resumed[0][1] - 1
        elif resumed:
            fault["resumed_after_later_faults"] = {"at_s": resumed[0][0], "kinds": [
                f["kind"] for f in applied[i + 1:] if f["effective_at_s"] < resumed[0][0]]}


def thin(points: list[tuple[float, int]], every: float = 0.5) -> list[list[float]]:
    """(wall s, step) points at most one per ``every`` seconds, plus every rewind: enough to plot."""
    out: list[list[float]] = []
    for t, step in points:
        if not out or t - out[-1][0] >= every or step < out[-1][1]:
            out.append([round(t, 2), step])
    return out


# --- main ----------------------------------------------------------------------------------------

def options(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="one 180 s run per side, MTBF 30 s")
    add("--runs", type=int, help="runs (same seed; default 1 with --quick, 3 otherwise)")
    add("--seed", type=int, help="the fault schedule's seed (default 1: ten faults in 30 minutes, every kind; "
                                 "44 with --quick: every kind in 3 minutes)")
    add("--duration", type=float, help="seconds per side (default 180 with --quick, 1800 otherwise)")
    add("--mtbf", type=float, help="mean seconds between faults (default 30 with --quick, 180 otherwise)")
    add("--warmup", type=float, default=45.0, help="no fault before this many seconds (the job's cold start)")
    add("--sides", default="nightwatch,torchrun", help="which sides to run")
    add("--one-at-a-time", dest="together", action="store_false",
        help="run the sides one after the other instead of at the same time (twice the wall time)")
    add("--ckpt-every", type=int, default=50, help="plain torchrun's fixed interval, Nightwatch's initial one")
    add("--max-restarts", type=int, default=30,
        help="plain torchrun's --max-restarts and Nightwatch's restart budget per hour (the scaled run's MTBF "
             "makes ~20 faults an hour expected: the budget is for storms beyond that)")
    add("--human-response-s", type=float, default=20.0, help="seconds before on-call answers a paused job")
    add("--agent-restart-s", type=float, default=5.0, help="seconds before a killed agent is restarted")
    add("--outage-s", type=float, help="control-plane outage length (default 10 with --quick, 30 otherwise)")
    add("--inprocess", type=int, default=0, metavar="N",
        help="the Nightwatch job's recovery_policy.inprocess_restarts (with snapshots every step and agents with "
             "warm workers); default 0: every crash restarts the generation")
    add("--progress-timeout", type=int, default=10, help="the Nightwatch job's recovery_policy.progress_timeout_s")
    add("--gpu-mtbf-hours", type=int, default=1, help="NIGHTWATCH_GPU_MTBF_HOURS: the MTBF assumed before history")
    add("--report-dir", default=str(ROOT / "docs" / "benchmarks"), help="where chaos.md and chaos.png go")
    add("--keep-logs", action="store_true", help="keep the temporary directory (logs) and say where")
    add("--spread", type=int, default=3,
        help="report the newest this many runs made with exactly these settings, earlier invocations' "
             "included (kept under bench/results/chaos-runs/; default 3); this invocation's runs always count")
    add("--fresh", action="store_true", help="report only this invocation's runs")
    opts = parser.parse_args(argv)
    opts.runs = opts.runs or (1 if opts.quick else 3)
    opts.seed = opts.seed if opts.seed is not None else (44 if opts.quick else 1)
    opts.duration = opts.duration or (180.0 if opts.quick else 1800.0)
    opts.mtbf = opts.mtbf or (30.0 if opts.quick else 180.0)
    opts.outage_s = opts.outage_s or (10.0 if opts.quick else 30.0)
    opts.sides = [s.strip() for s in opts.sides.split(",") if s.strip()]
    if opts.runs < 1 or opts.spread < 1:
        parser.error("--runs and --spread take a whole number of runs, at least 1")
    unknown = set(opts.sides) - {"nightwatch", "torchrun"}
    if unknown or not opts.sides:
        parser.error(f"--sides takes nightwatch and/or torchrun, not {sorted(unknown) or 'nothing'}")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = options(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that every side's clean-up runs
    url = os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL)
    schedule = F.fault_schedule(opts.seed, duration_s=opts.duration, mtbf_s=opts.mtbf, warmup_s=opts.warmup,
                                outage_s=opts.outage_s, world_size=WORLD_SIZE)
    print(f"fault schedule (seed {opts.seed}, {opts.duration:g} s per side, MTBF {opts.mtbf:g} s):")
    print(F.describe(schedule), flush=True)

    import torch  # noqa: F401 - recorded in the machine description

    from bench.recovery import prepare

    started = time.monotonic()
    if "nightwatch" in opts.sides:
        prepare(url)
        os.environ.update(DATABASE_URL=url, REDIS_URL=f"redis://127.0.0.1:6379/{REDIS_DB}", DEBUG="0",
                          DJANGO_SETTINGS_MODULE="controlplane.settings")
        import django

        django.setup()
    base = Path(tempfile.mkdtemp(prefix="nightwatch-bench-chaos-"))
    (base / "schedule.json").write_text(json.dumps([f.as_dict() for f in schedule], indent=1))
    mine = Invocation(opts)
    try:
        for run in range(opts.runs):
            run_started = time.monotonic()
            sides = [NightwatchSide(base, opts, schedule, url) if name == "nightwatch" else PlainSide(base, opts)
                     for name in opts.sides]
            batches = [sides] if opts.together else [[side] for side in sides]
            results: dict[str, dict] = {}
            for batch in batches:
                print(f"run {run + 1}/{opts.runs}: {' and '.join(s.name for s in batch)}", flush=True)
                for side, result in zip(batch, play_together(batch, schedule, opts.duration), strict=True):
                    results[side.name] = result
                    print(f"run {run + 1}/{opts.runs} {side.name:10} ETTR {result['ettr']:.3f}  lost steps "
                          f"{result['lost_steps']}  twice {result['trained_twice']}  skipped {result['skipped']}  "
                          f"corrupt loaded {result['corrupt_checkpoints_loaded']}  human "
                          f"{result['human_interventions_count']}", flush=True)
            mine.keep(results, time.monotonic() - run_started)
            if run + 1 < opts.runs:  # the report so far: a run cut short later keeps what is done
                finish(mine, schedule, opts, time.monotonic() - started)
    except Exception:
        traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        ABORT.set()
        if "nightwatch" in opts.sides:
            from django.db import connections

            connections.close_all()
        if opts.keep_logs:
            print(f"logs kept in {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    finish(mine, schedule, opts, time.monotonic() - started)


def play_together(sides: list[Side], schedule: list[F.Fault], duration_s: float) -> list[dict]:
    """Play the schedule against every side at once, each in a thread of its own (the injections
    wait for ranks, the on-call waits for pauses: one side must not hold the other's clock up).
    Both sides then share the machine's load, as they share the fault schedule."""
    results: list[dict | None] = [None] * len(sides)
    errors: list[BaseException] = []

    def one(index: int, side: Side) -> None:
        from django.db import connections

        try:
            results[index] = play(side, schedule, duration_s)
        except BaseException as error:  # noqa: BLE001 - re-raised by the main thread below
            ABORT.set()
            errors.append(error)
            if isinstance(side, NightwatchSide) and side.cluster is not None:
                print(side.cluster.dump_logs(), file=sys.stderr)
            traceback.print_exc()
        finally:
            connections.close_all()  # this thread's own connections

    threads = [threading.Thread(target=one, args=(i, side), name=side.name) for i, side in enumerate(sides)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
    except BaseException:
        ABORT.set()  # SIGTERM or ^C in the main thread: every side stops and cleans up
        for thread in threads:
            thread.join(120)
        raise
    if errors:
        raise RuntimeError(f"{len(errors)} side(s) failed: {errors[0]!r}") from errors[0]
    return [r for r in results if r is not None]


def conditions(opts: argparse.Namespace) -> dict:
    """Everything that shapes a run: runs are only reported together when these are equal."""
    return {"seed": opts.seed, "sides": opts.sides, "together": opts.together, "heartbeat_misses": HEARTBEAT_MISSES,
            "startup_floor_s": STARTUP_FLOOR_S, "duration_s": opts.duration, "mtbf_s": opts.mtbf,
            "quick": opts.quick, "ckpt_every": opts.ckpt_every, "plain_max_restarts": opts.max_restarts,
            "human_response_s": opts.human_response_s, "agent_restart_s": opts.agent_restart_s,
            "outage_s": opts.outage_s, "warmup_s": opts.warmup, "progress_timeout_s": opts.progress_timeout,
            "gpu_mtbf_hours": opts.gpu_mtbf_hours, "step_s": STEP_S, "world_size": WORLD_SIZE,
            "batch_size": BATCH_SIZE, **({"inprocess_restarts": opts.inprocess} if opts.inprocess else {})}


class Invocation:
    """This invocation's finished runs, each also kept on disk (``bench/_chaos_runs.py``)."""

    def __init__(self, opts: argparse.Namespace):
        self.setup = conditions(opts)
        self.command = command_line("chaos")
        self.revision = _chaos_runs.commit(ROOT)
        self.runs: list[dict] = []
        self.all_kept = True

    def keep(self, results: dict[str, dict], elapsed_s: float) -> None:
        run = _chaos_runs.record(self.setup, results, command=self.command, revision=self.revision,
                                 elapsed_s=elapsed_s)
        self.runs.append(run)
        try:
            _chaos_runs.save(run)
        except OSError as error:  # the report still covers this invocation's runs
            self.all_kept = False
            print(f"chaos: run not kept for later reports: {error}", file=sys.stderr)

    def reported(self, opts: argparse.Namespace) -> list[dict]:
        """The runs the report covers, oldest first: this invocation's, and unless ``--fresh`` the
        newest earlier ones with the same conditions up to ``--spread`` in all."""
        if opts.fresh or not self.all_kept:
            return self.runs
        return _chaos_runs.newest(self.setup, max(opts.spread, len(self.runs))) or self.runs


def finish(mine: Invocation, schedule: list[F.Fault], opts: argparse.Namespace, elapsed: float) -> None:
    from bench import _chaos_report

    kept = mine.reported(opts)
    results = {side: [run["results"][side] for run in kept if side in run["results"]] for side in opts.sides}
    results = {side: rows for side, rows in results.items() if rows}
    ettr = {name: [r["ettr"] for r in rows] for name, rows in results.items()}
    details = {"schedule": [f.as_dict() for f in schedule], "runs": results,
               "run_info": [{k: run[k] for k in ("finished_at", "commit", "command", "elapsed_s")}
                            | {"ettr": {side: r["ettr"] for side, r in run["results"].items()}} for run in kept],
               "ettr": {name: {"median": round(median(v), 4), "spread": spread(v), "runs": v}
                        for name, v in ettr.items()},
               "setup": {**mine.setup, "elapsed_s": round(elapsed)}}
    primary = "nightwatch" if ettr.get("nightwatch") else next(iter(ettr))
    result = emit("chaos", metric=f"ettr_{primary}", value=round(median(ettr[primary]), 4), target=TARGET_ETTR,
                  better="higher", unit="ratio", runs=len(ettr[primary]),
                  spread=[round(v, 4) for v in spread(ettr[primary])], details=details)
    _chaos_report.write(result, Path(opts.report_dir))


if __name__ == "__main__":
    main()
