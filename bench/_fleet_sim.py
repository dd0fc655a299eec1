"""One process of the fleet simulator: many node agents and their training ranks on one event loop.

Started by ``bench.fleet`` as ``python -m bench._fleet_sim PLAN.json``, a few per run. Each node
does what ``agents.agent.daemon.Agent`` does, over real HTTP with real tokens: registers with its
bootstrap token, heartbeats at the interval registration answers, samples 8 GPUs at the agent's
default telemetry interval into an outbox it flushes as the agent's does (events and command acks
in order, before telemetry),
runs the commands heartbeat answers carry (a launch "starts" a generation, a stop ends it) and
reports exits. Each rank of a started generation trains one step a second and delivers its
spool as ``agents.hooks.reporter.Reporter`` does, with the generation's job token; rank 0 also
polls control and commits tiny but real checkpoints (a DCP directory with a manifest and commit
marker, copied from a template) on the job's interval, which the checkpoint worker verifies.

Faults arrive on stdin as JSON lines and are acted on at once; the process prints one JSON status
line a second (registered nodes, undelivered records, the moment each fault landed, its request
book so far) until stdin closes or SIGTERM arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import shutil
import signal
import sys
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any
from urllib.parse import quote

from agents import __version__
from agents.agent import wake
from agents.agent.config import AgentConfig
from agents.hooks.manifest import checkpoint_dirname, write_manifest
from agents.hooks.reporter import newest_step_age
from agents.http import Unreachable, retry_delay
from agents.protocol import dump, parse
from agents.protocol.agent import (
    ACK_PATH,
    COMMAND_WAIT_PATH,
    EVENTS_PATH,
    HEARTBEAT_PATH,
    MAX_EVENTS_PER_BATCH,
    MAX_SAMPLES_PER_BATCH,
    REGISTER_PATH,
    TELEMETRY_PATH,
    AgentStarted,
    Command,
    CommandAck,
    CommandWaitResponse,
    ExitReport,
    GpuInfo,
    GpuSample,
    HealthReport,
    Heartbeat,
    HeartbeatResponse,
    LaunchedDetail,
    LaunchPayload,
    RankExit,
    Register,
    RegisterResponse,
    RunningGeneration,
    XidDetail,
    compact,
)
from agents.protocol.hooks import CHECKPOINTS_PATH, CONTROL_PATH, REPORTS_PATH, progress_header
from bench import _fleet_ranks as ranks_wire
from bench._fleet_http import Book, Client

GPUS = 8


def _agent_default(name: str, otherwise: float) -> float:
    """The real agent's default for a setting (``AgentConfig``), so the simulator follows it."""
    found = {f.name: f.default for f in dataclasses.fields(AgentConfig)}
    return float(found.get(name, otherwise))


TELEMETRY_INTERVAL_S = _agent_default("telemetry_interval_s", 10.0)
#: Samples wait up to this long to share a request with later ones (0: each batch goes at once);
#: an event or an ack goes at once and takes them along.
TELEMETRY_BATCH_S = _agent_default("telemetry_batch_s", 0.0)
FLUSH_INTERVAL_S = 1.0  # Reporter's flush_interval
CONTROL_INTERVAL_S = 5.0  # Reporter's control_interval
MAX_BACKOFF_S = 10.0  # Reporter's max_backoff
DECISION_POLL_S, DECISION_WINDOW_S = 0.2, 20.0  # agents.agent.daemon
XID_CODE = 79  # "GPU has fallen off the bus": critical (agents.health.CRITICAL_XIDS)
CONFIG_HASH = "fleet-bench"
#: Agent events of injected faults whose delivery the simulator times (``Sim.fault_events``).
FAULT_EVENTS = frozenset({"exited", "xid"})
STEP_S = 1.0
#: A node whose agent and ranks hold more undelivered records than this is behind: in steady state
#: each rank holds at most a second or two of steps and the outbox one telemetry sample per GPU.
BEHIND = 64
#: Connections of a simulator process for its nodes' events and acks (a few a second in all).
URGENT_CONNECTIONS = 32
#: Samples per telemetry request in a calibration: 8 GPUs x 3 samples, what an agent at the defaults
#: sends (a sample every 10 s, batched for 30 s).
CALIBRATION_SAMPLES = GPUS * 3


def fate_of(error: Unreachable) -> int | str:
    """A request that got no answer to act on: the 5xx it got, or why none came (``timeout``: the
    client gave up, as the reporter does after its timeout; ``error``: the connection failed)."""
    if error.status is not None:
        return error.status
    return "timeout" if "TimeoutError" in str(error) else "error"


class Rank:
    """One training process's reporter: a spool delivered oldest first, backing off on refusal."""

    def __init__(self, gen: Generation, local: int):
        self.gen, self.local = gen, local
        self.rank = gen.node_rank * gen.nproc + local
        self.progress_header = progress_header(self.rank)  # as the reporter sends it
        self.spool: deque[tuple[str, dict[str, Any]]] = deque()
        self.failures = 0
        self.retry_at = 0.0
        self.control_seen = float("-inf")
        self.wake = asyncio.Event()

    async def run(self) -> None:
        while not self.gen.ended:
            try:  # a reporter with nothing spooled sends nothing: only rank 0 (control) wakes regardless
                idle = not self.spool and self.rank != 0
                await asyncio.wait_for(self.wake.wait(), None if idle else FLUSH_INTERVAL_S)
            except TimeoutError:
                pass
            self.wake.clear()
            if time.monotonic() >= self.retry_at and not self.gen.stale:
                try:
                    await self.deliver()
                    if self.rank == 0 and time.monotonic() - self.control_seen >= CONTROL_INTERVAL_S:
                        await self.fetch_control()
                except Unreachable as error:
                    self.failures += 1
                    self.retry_at = time.monotonic() + retry_delay(self.failures, cap=MAX_BACKOFF_S,
                                                                   retry_after=error.retry_after)

    async def deliver(self) -> None:
        client, gen = self.gen.agent.client, self.gen
        while self.spool and not gen.stale:
            head = list(self.spool)[:2 * ranks_wire.BATCH_LIMIT] if len(self.spool) > 1 else [self.spool[0]]
            if head[0][0] == ranks_wire.CHECKPOINT:
                status, answer = await self.request(client, "checkpoints", "POST",
                                                    CHECKPOINTS_PATH.format(job=gen.job_path), head[0][1])
                taken = 1
            else:
                taken, batch = ranks_wire.next_batch(gen.job, head)
                age = newest_step_age(batch, everything=taken == len(self.spool), now=time.time())
                if age is not None:  # as the reporter says it (``Reporter._next_batch``)
                    batch["newest_step_age_s"] = age
                status, answer = await self.request(client, "reports", "POST", REPORTS_PATH.format(job=gen.job_path),
                                                    batch, headers=self.progress_header)
                if status == 202 and isinstance(answer.get("control"), dict):
                    self.apply_control(answer["control"])
            if status == 409:
                gen.stale = True
                return
            for _ in range(taken):
                kind, _body = self.spool.popleft()
                gen.agent.sim.delivered[kind] = gen.agent.sim.delivered.get(kind, 0) + 1
            self.failures = 0

    async def request(self, client: Client, endpoint: str, method: str, path: str, body: Any = None,
                      **options: Any) -> tuple[int, dict[str, Any]]:
        """``client.request`` with the generation's token; rank 0's requests (the ones the hang sweep
        hears a job by) each leave their fate in the simulator's ``fates``."""
        if self.rank != 0:
            return await client.request(endpoint, method, path, self.gen.token, body, **options)
        started = time.time()
        try:
            status, answer = await client.request(endpoint, method, path, self.gen.token, body, **options)
        except Unreachable as error:
            self.gen.agent.sim.fate(self.gen.job, started, endpoint, fate_of(error))
            raise
        self.gen.agent.sim.fate(self.gen.job, started, endpoint, status)
        return status, answer

    async def fetch_control(self) -> None:
        gen = self.gen
        path = CONTROL_PATH.format(job=gen.job_path) + f"?generation={gen.generation}&rank={self.rank}"
        status, answer = await self.request(gen.agent.client, "control", "GET", path)
        if status == 409:
            gen.stale = True
        elif status == 200:
            self.apply_control(answer)

    def apply_control(self, control: dict[str, Any]) -> None:
        self.control_seen = time.monotonic()
        if control.get("stale"):
            self.gen.stale = True
        if control.get("checkpoint_interval_steps"):
            self.gen.checkpoint_every = int(control["checkpoint_interval_steps"])


class Generation:
    """A job's generation on one node: ``nproc`` ranks stepping together once a second."""

    def __init__(self, agent: Agent, command: Command, payload: LaunchPayload):
        self.agent = agent
        self.job = command.job or ""
        self.job_path = quote(self.job, safe="")
        self.generation = command.generation or 0
        self.node_rank, self.nproc, self.nnodes = payload.node_rank, payload.nproc_per_node, payload.nnodes
        self.world_size = self.nnodes * self.nproc
        self.token = payload.hooks_token or ""
        self.ckpt_dir = payload.ckpt_dir
        self.step = _resumed_step(payload.resume_from)
        self.checkpoint_every = agent.sim.checkpoint_every
        self.started_at = time.time()
        self.ended = self.stale = self.hung = False
        self.slow_rank: int | None = None
        self.saving: asyncio.Task | None = None  # the checkpoint save in flight, if any
        self.ranks = [Rank(self, local) for local in range(self.nproc)]
        self.tasks = [asyncio.create_task(r.run()) for r in self.ranks] + [asyncio.create_task(self.train())]

    async def train(self) -> None:
        if self.node_rank == 0:
            self.ranks[0].spool.extend(ranks_wire.start_records(job=self.job, generation=self.generation,
                                                                step=self.step))
        while not self.ended and not self.stale:
            slow = self.slow_rank is not None
            await asyncio.sleep(STEP_S * (ranks_wire.SLOW_FACTOR if slow else 1.0) * random.uniform(0.98, 1.02))
            if self.hung or self.ended or self.stale:
                continue
            self.step += 1
            self.agent.sim.made += len(self.ranks)
            for rank in self.ranks:
                phases = ranks_wire.phases(rank.rank, self.slow_rank)
                rank.spool.extend(ranks_wire.step_records(job=self.job, generation=self.generation, rank=rank.rank,
                                                          world_size=self.world_size, step=self.step, phases=phases))
            if self.node_rank == 0:
                self.ranks[0].spool.extend(ranks_wire.window_records(
                    job=self.job, generation=self.generation, step=self.step, world_size=self.world_size,
                    nproc=self.nproc, slow_rank=self.slow_rank))
            if self.node_rank == 0 and self.checkpoint_every and self.step % self.checkpoint_every == 0:
                # The hooks save asynchronously (``Checkpointer.save``): training goes on while the files
                # are written, and a save waits only for the one before it. Awaited here, a write stalled
                # on this process's shared thread pool stopped the job: run N's storm found it hung.
                if self.saving is not None:
                    await self.saving
                self.saving = asyncio.create_task(self.checkpoint())

    async def checkpoint(self) -> None:
        template = self.agent.sim.templates.get(str(self.world_size))
        if not template or not self.ckpt_dir:
            return
        run_id = f"{random.getrandbits(24):06x}"
        directory = Path(self.ckpt_dir) / checkpoint_dirname(self.step, self.generation, run_id)
        fields = {"loss": ranks_wire.loss_at(self.step), "config_hash": CONFIG_HASH, "world_size": self.world_size,
                  "data_cursor": self.step * self.world_size * ranks_wire.SAMPLES_PER_RANK,
                  "generation": self.generation, "job": self.job,
                  "parts": ["model", "optim", "progress", "rng", "scheduler"], "amp": False, "step": self.step}
        manifest = await asyncio.to_thread(_write_checkpoint, Path(template), directory, fields)
        self.ranks[0].spool.extend(ranks_wire.checkpoint_records(
            job=self.job, generation=self.generation, step=self.step, path=str(directory),
            world_size=self.world_size, manifest=manifest, config_hash=CONFIG_HASH))
        self.ranks[0].wake.set()

    async def report_next(self) -> int:
        """Rank 0 trains its next step at once and reports it in a request of its own (calibration)."""
        self.step += 1
        phases = ranks_wire.phases(0, None)
        records = ranks_wire.step_records(job=self.job, generation=self.generation, rank=0,
                                          world_size=self.world_size, step=self.step, phases=phases)
        _, batch = ranks_wire.next_batch(self.job, records)
        status, _ = await self.agent.client.request("reports", "POST", REPORTS_PATH.format(job=self.job_path),
                                                    self.token, batch,
                                                    headers=self.ranks[0].progress_header)
        return status

    def end(self) -> None:
        self.ended = True
        for task in self.tasks:
            task.cancel()

    def backlog(self) -> int:
        return sum(len(r.spool) for r in self.ranks)


def _write_checkpoint(template: Path, directory: Path, fields: dict[str, Any]) -> dict[str, Any]:
    directory.mkdir(parents=True)
    for source in template.iterdir():
        shutil.copyfile(source, directory / source.name)
    return write_manifest(directory, fields)


def _resumed_step(resume_from: str | None) -> int:
    """The step a relaunch resumes at: the checkpoint directory's name says it (``step-00000040-…``)."""
    if not resume_from:
        return 0
    name = Path(resume_from).name
    return int(name.split("-")[1]) if name.startswith("step-") else 0


class Agent:
    """One node's agent (``agents.agent.daemon.Agent``) without the processes it would start."""

    def __init__(self, sim: Sim, node: dict[str, str], client: Client, beat_client: Client,
                 wait_client: Client | None, urgent_client: Client):
        self.sim, self.hostname, self.bootstrap = sim, node["hostname"], node["bootstrap"]
        self.address = node["address"]
        self.client = _From(client, self.address)
        self.urgent_client = _From(urgent_client, self.address)  # events and acks
        #: Heartbeats on a connection of their own, as the agent's heartbeat thread sends them: never
        #: queued in the simulator behind other nodes' bulk requests. With one shared pool, a fleet
        #: replaying its spools after the storm kept every connection busy with reports and
        #: telemetry, and heartbeats waited in the simulator for a free one until their nodes' deadlines
        #: ran out: 38 live nodes unreachable at 1,024 nodes (2026-12-02) that no agent would lose.
        self.beat_client = _From(beat_client, self.address)
        #: The command wait's long poll (``agents.agent.wake``), on a connection of its own as the
        #: agent's thread holds one; None: agents with ``command_wait: false``.
        self.wait_client = None if wait_client is None else _From(wait_client, self.address)
        self.beats_through = 0  # heartbeats answered 200 (``wake.HeartbeatCount``)
        self.owed = False  # the command wait said commands wait, and no heartbeat got through since
        self.beat_retry_after: float | None = None  # the last refused heartbeat's Retry-After
        self.beat_through = asyncio.Event()
        self.node_id = self.token = ""
        self.interval = 5.0
        self.outbox: deque[tuple[str, Any]] = deque()
        self.generations: dict[str, Generation] = {}
        self.ledger: dict[str, tuple[str, str]] = {}
        self.seq = 0
        self.decision_until = 0.0
        self.xid_gpu: int | None = None
        self.flush_wake = asyncio.Event()
        self.beat_wake = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        self.dead = False

    # --- life --------------------------------------------------------------------------------

    async def run(self, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.register()
        if self.dead:
            return
        self.add_event("agent_started", AgentStarted(agent_version=__version__, gpu_telemetry=True))
        self.tasks = [asyncio.create_task(self.heartbeats()), asyncio.create_task(self.telemetry()),
                      asyncio.create_task(self.flusher())]
        if self.wait_client is not None:
            self.tasks.append(asyncio.create_task(self.command_waits()))

    async def register(self) -> None:
        gpus = [GpuInfo(index=i, uuid=f"GPU-{self.hostname}-{i}", name="NVIDIA H100 80GB HBM3",
                        memory_total=80 * 2**30) for i in range(GPUS)]
        message = Register(bootstrap_token=self.bootstrap, hostname=self.hostname, address=self.address,
                           agent_version=__version__, labels={"rack": self.hostname[-6:-3]}, gpus=gpus)
        failures = 0
        while True:
            try:
                status, body = await self.client.request("register", "POST", REGISTER_PATH, None, dump(message))
            except Unreachable as error:
                failures += 1
                await asyncio.sleep(retry_delay(failures, cap=30.0, retry_after=error.retry_after))
                continue
            if status != 201:  # the agent gives up (RegistrationRefused, exit 2): so does its simulation
                self.sim.refused += 1
                self.dead = True
                print(f"{self.hostname}: registration refused ({status}): {body}", file=sys.stderr, flush=True)
                return
            answer = parse(RegisterResponse, body)
            self.node_id, self.token, self.interval = answer.node_id, answer.node_token, answer.heartbeat_interval_s
            self.sim.registered += 1
            return

    def die(self) -> None:
        """The node is gone: agent and ranks stop, nothing more is sent."""
        self.dead = True
        for task in self.tasks:
            task.cancel()
        for gen in self.generations.values():
            gen.end()

    # --- heartbeats and commands ---------------------------------------------------------------

    async def heartbeats(self) -> None:
        await asyncio.sleep(random.uniform(0, self.interval))
        refusals = 0
        while True:
            through = self.beats_through
            await self.heartbeat()
            refusals = 0 if self.beats_through > through else refusals + 1
            # The daemon's schedule: a refused heartbeat that commands wait for is retried after a
            # backoff, any other next due a little early (``wake.next_heartbeat_in``).
            wait = (DECISION_POLL_S if time.monotonic() < self.decision_until else
                    wake.next_heartbeat_in(self.interval, owed=self.owed, refusals=refusals,
                                           retry_after=self.beat_retry_after))
            try:
                await asyncio.wait_for(self.beat_wake.wait(), wait)
            except TimeoutError:
                pass
            self.beat_wake.clear()

    async def heartbeat(self) -> None:
        await self.heartbeat_status()

    async def heartbeat_status(self) -> int:
        """One heartbeat, its commands run; the HTTP status (0: unanswered)."""
        self.seq += 1
        running = [RunningGeneration(job=g.job, generation=g.generation, pids=[4242 + g.node_rank],
                                     started_at=g.started_at) for g in self.generations.values() if not g.ended]
        message = Heartbeat(node_id=self.node_id, seq=self.seq, time=time.time(), running=running,
                            spooled=len(self.outbox), interval_s=self.interval)
        try:
            path = HEARTBEAT_PATH.format(node_id=self.node_id)
            status, body = await self.beat_client.request("heartbeat", "POST", path, self.token, dump(message))
        except Unreachable as error:
            self.beat_retry_after = error.retry_after
            return 0
        if status == 200:
            self.beats_through += 1
            self.owed = False
            self.beat_through.set()
            answer = parse(HeartbeatResponse, body)
            self.interval = answer.heartbeat_interval_s or self.interval  # pacing, as the agent follows it
            for command in answer.commands:
                self.execute(command)
        return status

    async def command_waits(self) -> None:
        """``agents.agent.wake.CommandWait``: one long poll open; when it says a command waits,
        heartbeat now, and poll again once a heartbeat got through."""
        assert self.wait_client is not None
        path = f"{COMMAND_WAIT_PATH.format(node_id=self.node_id)}?timeout={wake.WAIT_S:g}"
        failures = 0
        while True:
            try:
                status, body = await self.wait_client.request("command_wait", "GET", path, self.token)
            except Unreachable as error:
                failures += 1
                await asyncio.sleep(retry_delay(failures, cap=max(self.interval, 1.0), retry_after=error.retry_after))
                continue
            failures = 0
            if status != 200:
                await asyncio.sleep(max(self.interval, 1.0))
                continue
            if not parse(CommandWaitResponse, body).commands:
                continue
            self.sim.wakeups += 1
            through = self.beats_through
            self.owed = True
            self.beat_wake.set()
            while self.beats_through <= through:
                self.beat_through.clear()
                await self.beat_through.wait()

    async def telemetry_batch(self) -> int:
        """One telemetry request as the fleet's agents send them: ``CALIBRATION_SAMPLES`` samples."""
        now = time.time()
        samples = [self.sample(i % GPUS, now - i // GPUS) for i in range(CALIBRATION_SAMPLES)]
        status, _ = await self.client.request("telemetry", "POST", TELEMETRY_PATH.format(node_id=self.node_id),
                                              self.token, {"samples": samples})
        return status

    def execute(self, command: Command) -> None:
        """``CommandRunner`` + the daemon's handlers: each idempotency key runs once, is acked every time."""
        if command.idempotency_key not in self.ledger:
            self.ledger[command.idempotency_key] = self.run_command(command)
        status, detail = self.ledger[command.idempotency_key]
        self.outbox.append(("ack", CommandAck(command_id=command.id, idempotency_key=command.idempotency_key,
                                              status=status, time=time.time(), job=command.job,
                                              generation=command.generation, detail=detail)))
        self.flush_wake.set()

    def run_command(self, command: Command) -> tuple[str, str]:
        if command.kind == "launch":
            payload = parse(LaunchPayload, command.payload)
            current = self.generations.get(command.job or "")
            if current is not None and not current.ended and current.generation == command.generation:
                return "done", "already running"
            if current is not None and not current.ended:
                self.stop(current)
            gen = Generation(self, command, payload)
            self.generations[gen.job] = gen
            self.add_event("launched", LaunchedDetail(pid=4242 + gen.node_rank, log_path=f"/sim/{gen.job}.log",
                                                      command=["torchrun"]), job=gen.job, generation=gen.generation)
            return "done", "torchrun started (simulated)"
        if command.kind == "stop":
            gen = self.generations.get(command.job or "")
            if gen is None or gen.ended or gen.generation != command.generation:
                return "done", "not running on this node"
            self.stop(gen)
            return "done", "stopped"
        if command.kind == "drain":
            self.add_event("drain_ack", {"reason": command.payload.get("reason", ""), "running": []})
            return "done", "draining: no new launches"
        self.add_event("health_check", HealthReport(ok=self.xid_gpu is None,
                                                    reason="" if self.xid_gpu is None else "Xid 79"),
                       job=command.job, generation=command.generation)
        return "done", "healthy" if self.xid_gpu is None else "Xid 79"

    def stop(self, gen: Generation) -> None:
        gen.end()
        self.add_event("stopped", ExitReport(exit_code=0, requested_stop=True, runtime_s=time.time() - gen.started_at),
                       job=gen.job, generation=gen.generation)

    # --- telemetry and the outbox ----------------------------------------------------------------

    async def telemetry(self) -> None:
        await asyncio.sleep(random.uniform(0, TELEMETRY_INTERVAL_S))
        loop = asyncio.get_running_loop()
        while True:
            now = time.time()
            waiting = any(kind == "telemetry" for kind, _ in self.outbox)
            self.outbox.extend(("telemetry", self.sample(gpu, now)) for gpu in range(GPUS))
            if not TELEMETRY_BATCH_S:
                self.flush_wake.set()
            elif not waiting:  # the oldest unsent sample sets when the batch goes
                loop.call_later(TELEMETRY_BATCH_S, self.flush_wake.set)
            await asyncio.sleep(TELEMETRY_INTERVAL_S)

    def sample(self, gpu: int, now: float) -> dict[str, Any]:
        busy = any(not g.ended for g in self.generations.values())
        xid = gpu == self.xid_gpu
        return dump(GpuSample(
            node=self.node_id, gpu=gpu, time=now, temperature_c=62.0 + gpu, memory_used=(60 if busy else 1) * 2**30,
            memory_free=(20 if busy else 79) * 2**30, utilization_pct=95.0 if busy else 0.0, power_w=650.0,
            sm_clock_mhz=1980, throttle_reasons=0, ecc_corrected_volatile=0, ecc_uncorrected_volatile=0,
            ecc_corrected_aggregate=0, ecc_uncorrected_aggregate=0, ecc_corrected_recent=0,
            ecc_uncorrected_recent=0, retired_pages=0, retired_pages_pending=False, remapped_rows_correctable=0,
            remapped_rows_uncorrectable=0, remap_pending=False, remap_failed=False, xid_total=int(xid),
            xid_recent=int(xid), recent_xid_codes=[XID_CODE] if xid else [], nvlink_replay_errors=0,
            nvlink_recovery_errors=0, nvlink_crc_flit_errors=0, nvlink_crc_data_errors=0, nvlink_errors_recent=0,
            pcie_replays=0))

    def add_event(self, kind: str, detail: Any, *, job: str | None = None, generation: int | None = None) -> None:
        self.sim.events += 1
        body = {"key": f"{self.hostname}-{self.sim.events}", "kind": kind, "time": time.time(),
                "detail": detail if isinstance(detail, dict) else compact(detail)}
        if job is not None:
            body.update(job=job, generation=generation)
        self.outbox.append(("event", body))
        self.flush_wake.set()

    async def flusher(self) -> None:
        """The daemon's two lanes (``Agent._loop``): refused telemetry waits out its backoff, but an
        event or an ack that comes meanwhile goes at once; the urgent lane backs off only when it is
        refused itself, and then telemetry waits with it. (One backoff for both held an Xid behind
        refused telemetry for up to 19 s, bench.fleet 2026-12-06: the simulator's delay, not the
        control plane's.)"""
        backoff = {"urgent": 0.1, "bulk": 0.1}
        due = {"urgent": 0.0, "bulk": 0.0}
        while True:
            now = time.monotonic()
            waiting = {"urgent": any(kind != "telemetry" for kind, _ in self.outbox),
                       "bulk": any(kind == "telemetry" for kind, _ in self.outbox)}
            lane = next((name for name in ("urgent", "bulk") if waiting[name] and now >= due[name]), None)
            if lane is None:
                turns = [due[name] - now for name in due if waiting[name]]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.flush_wake.wait(), min(turns) if turns else None)
                self.flush_wake.clear()
                continue
            try:
                await self.flush_one(urgent=lane == "urgent")
                backoff[lane] = 0.1
            except Unreachable as error:
                backoff[lane] = min(backoff[lane] * 2, self.interval)
                due[lane] = time.monotonic() + retry_delay(1, base=backoff[lane], cap=backoff[lane],
                                                           retry_after=error.retry_after)
                if lane == "urgent":
                    due["bulk"] = max(due["bulk"], due["urgent"])

    async def flush_one(self, *, urgent: bool = True) -> None:
        """The head run of one kind, as ``Outbox.flush`` sends it: events and acks (``urgent``) before
        telemetry."""
        first = [item for item in self.outbox if item[0] != "telemetry"] if urgent else []
        lane = first or [item for item in self.outbox if item[0] == "telemetry"]
        kind = lane[0][0]
        limit = {"telemetry": MAX_SAMPLES_PER_BATCH, "event": MAX_EVENTS_PER_BATCH, "ack": 1}[kind]
        run = []
        for record_kind, body in lane:
            if record_kind != kind or len(run) == limit:
                break
            run.append(body)
        if kind == "telemetry":
            status, _ = await self.client.request("telemetry", "POST", TELEMETRY_PATH.format(node_id=self.node_id),
                                                  self.token, {"samples": run})
        elif kind == "event":
            sent_at, outcome = time.time(), None
            try:
                status, _ = await self.urgent_client.request("events", "POST", EVENTS_PATH.format(
                    node_id=self.node_id), self.token, {"events": run})
                outcome = status
            except Unreachable as error:
                outcome = fate_of(error)
                raise
            finally:  # a fault's event: how long it waited in the outbox, how long its request took
                self.sim.fault_events.extend(
                    {"hostname": self.hostname, "kind": body["kind"], "outcome": outcome,
                     "outbox_s": round(sent_at - body["time"], 3), "request_s": round(time.time() - sent_at, 3)}
                    for body in run if body["kind"] in FAULT_EVENTS)
        else:
            ack = run[0]
            status, _ = await self.urgent_client.request("ack", "POST", ACK_PATH.format(
                node_id=self.node_id, command_id=ack.command_id), self.token, dump(ack))
            if status == 409 and ack.job in self.generations:
                self.generations[ack.job].end()
        sent = {id(body) for body in run}
        self.outbox = deque(item for item in self.outbox if id(item[1]) not in sent)

    def backlog(self) -> int:
        return len(self.outbox) + sum(g.backlog() for g in self.generations.values() if not g.ended)

    # --- faults --------------------------------------------------------------------------------

    def rank_exit(self, job: str) -> bool:
        gen = self.generations.get(job)
        if gen is None or gen.ended:
            return False
        gen.end()
        local = 3 % gen.nproc
        rank = gen.node_rank * gen.nproc + local
        self.add_event("exited", ExitReport(
            exit_code=1, ranks=[RankExit(rank=rank, local_rank=local, exit_code=1, pid=5000 + local)],
            root_cause_rank=rank, signature="traceback", error_line="RuntimeError: simulated rank failure",
            log_tail=["Traceback (most recent call last):", "RuntimeError: simulated rank failure"],
            runtime_s=time.time() - gen.started_at), job=gen.job, generation=gen.generation)
        self.decision_until = time.monotonic() + DECISION_WINDOW_S
        self.beat_wake.set()
        return True

    def xid(self, gpu: int) -> None:
        self.xid_gpu = gpu
        self.add_event("xid", XidDetail(gpu=gpu, code=XID_CODE))
        now = time.time()
        self.outbox.extend(("telemetry", self.sample(g, now)) for g in range(GPUS))


class _From:
    """A client whose requests come from one node's address (``Client.request``'s ``source``)."""

    def __init__(self, client: Client, address: str):
        self.client, self.address = client, address

    async def request(self, *args: Any, **options: Any) -> tuple[int, dict[str, Any]]:
        return await self.client.request(*args, source=self.address, **options)


class Sim:
    def __init__(self, plan: dict[str, Any]):
        self.plan = plan
        self.book = Book()
        self.registered = self.refused = self.events = 0
        self.wakeups = 0  # command waits answered "a command waits"
        #: Rank records (step reports, events, checkpoint commits) the control plane answered 2xx for.
        self.delivered: dict[str, int] = {}
        self.made = 0  # rank-steps trained
        self.checkpoint_every = int(plan.get("checkpoint_every", 0))
        self.templates: dict[str, str] = plan.get("templates", {})
        self.faults: list[dict[str, Any]] = []
        self.calibration: dict[str, Any] | None = None
        self.agents: dict[str, Agent] = {}
        #: Per job, what became of each of its rank 0's requests: [sent at (epoch s), endpoint, status or
        #: ``fate_of``'s word, seconds until then], written to ``plan["fates"]`` when the process stops.
        self.fates: dict[str, list[list[Any]]] = {}
        #: Each send of a fault's agent event (``FAULT_EVENTS``): node, kind, outcome (as ``fate_of``),
        #: seconds in the outbox before the send and seconds the request took. In the status line.
        self.fault_events: list[dict[str, Any]] = []
        #: The event loop holds tasks weakly: one nobody references may be collected mid-await.
        self.tasks: list[asyncio.Task] = []

    async def main(self) -> None:
        ports = self.plan["ports"]
        per_port = max(1, self.plan["connections"] // len(ports))
        clients = [Client(port, self.book, connections=per_port, timeout=self.plan.get("timeout", 5.0))
                   for port in ports]
        # Events and acks on connections of their own: a real agent's outbox sends them first on its
        # own connection, never behind other nodes' telemetry waiting for one of a shared pool. To the
        # process the proxy routes them to (``urgent_port``: ``--urgent-process``), or to the node's web.
        urgent_ports = [self.plan["urgent_port"]] if self.plan.get("urgent_port") else ports
        urgent = [Client(port, self.book, connections=URGENT_CONNECTIONS, timeout=self.plan.get("timeout", 5.0))
                  for port in urgent_ports]
        spread = self.plan.get("start_spread_s", 5.0)
        for i, node in enumerate(self.plan["nodes"]):
            port = ports[i % len(ports)]
            beats = Client(port, self.book, connections=1, timeout=self.plan.get("timeout", 5.0))
            waits = (Client(port, self.book, connections=1, timeout=wake.WAIT_S + wake.TRANSIT_S)
                     if self.plan.get("command_wait", True) else None)
            agent = Agent(self, node, clients[i % len(clients)], beats, waits, urgent[i % len(urgent)])
            self.agents[agent.hostname] = agent
            self.tasks.append(asyncio.create_task(agent.run(random.uniform(0, spread))))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        self.tasks.append(asyncio.create_task(self.read_faults(stop)))
        while not stop.is_set():
            self.status()
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
        self.status()
        if self.plan.get("fates"):
            Path(self.plan["fates"]).write_text(json.dumps(self.fates))

    def fate(self, job: str, started: float, endpoint: str, outcome: int | str) -> None:
        self.fates.setdefault(job, []).append([round(started, 3), endpoint, outcome, round(time.time() - started, 3)])

    def status(self) -> None:
        alive = [a for a in self.agents.values() if not a.dead]
        backlogs = [a.backlog() for a in alive]
        print(json.dumps({"t": time.time(), "registered": self.registered, "refused": self.refused,
                          "wakeups": self.wakeups,
                          "backlog": sum(backlogs),
                          "behind": sum(1 for b in backlogs if b > BEHIND),
                          "interval_max": max((a.interval for a in alive), default=0.0),
                          "delivered": self.delivered, "made": self.made,
                          "faults": self.faults, "fault_events": self.fault_events, "calibration": self.calibration,
                          "book": self.book.as_json()}), flush=True)

    async def read_faults(self, stop: asyncio.Event) -> None:
        reader = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            fault = json.loads(line)
            landed = self.inject(fault)
            if landed:
                self.faults.append({**fault, "at": time.time()})
        stop.set()

    def inject(self, fault: dict[str, Any]) -> bool:
        kind, agent = fault["kind"], self.agents.get(fault.get("hostname", ""))
        if kind == "calibrate":
            self.tasks.append(asyncio.create_task(self.calibrate(fault)))
            return False
        if kind == "node_death" and agent is not None:
            agent.die()
            return True
        if kind == "rank_exit" and agent is not None:
            return agent.rank_exit(fault["job"])
        if kind == "xid" and agent is not None:
            agent.xid(fault.get("gpu", 0))
            return True
        if kind in ("hang", "slow_rank"):
            hit = False
            for a in self.agents.values():
                gen = a.generations.get(fault["job"])
                if gen is not None and not gen.ended:
                    if kind == "hang":
                        gen.hung = True
                    else:
                        gen.slow_rank = fault["rank"]
                    hit = True
            return hit
        return False


    async def calibrate(self, order: dict[str, Any]) -> None:
        """``order["count"]`` requests of one kind (``heartbeat``, ``telemetry`` or ``report``), on top of
        the fleet's own traffic, ``order["concurrency"]`` at a time, each as its agent or rank 0 sends it;
        the status line's ``calibration`` says when they ended and how many were answered 2xx. What the
        control plane spent on them is measured from outside (``bench.fleet.cost``)."""
        agents = [a for a in self.agents.values() if a.token and not a.dead]
        trained = [g for a in agents for g in a.generations.values() if g.node_rank == 0 and not g.ended]
        kind, count = order["what"], int(order["count"])
        senders = {"heartbeat": [a.heartbeat_status for a in agents], "telemetry": [a.telemetry_batch for a in agents],
                   "report": [g.report_next for g in trained]}[kind]
        started, statuses, queue, refused = time.time(), Counter[int](), asyncio.Queue(), {}
        for i in range(count):
            queue.put_nowait(senders[i % len(senders)])

        async def worker() -> None:
            while not queue.empty():
                send = queue.get_nowait()
                for attempt in range(1, 6):  # a refusal (503) is waited out as the agents and hooks do
                    try:
                        statuses[await send()] += 1
                        break
                    except Unreachable as error:
                        if error.status != 503 or attempt == 5:
                            statuses[error.status or 0] += 1
                            break
                        refused[kind] = refused.get(kind, 0) + 1
                        await asyncio.sleep(retry_delay(attempt, retry_after=error.retry_after))

        await asyncio.gather(*(worker() for _ in range(int(order.get("concurrency", 4)))))
        answered = sum(n for status, n in statuses.items() if 200 <= status < 300)
        self.calibration = {"id": order["id"], "what": kind, "count": count, "answered": answered,
                            "statuses": {str(k): v for k, v in statuses.items()}, "refused": refused.get(kind, 0),
                            "samples": CALIBRATION_SAMPLES if kind == "telemetry" else 0,
                            "started": started, "ended": time.time()}
        self.status()


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    random.seed(plan.get("seed", 0))
    asyncio.run(Sim(plan).main())


if __name__ == "__main__":
    main()
