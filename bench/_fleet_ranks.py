"""What the simulated training ranks send: the one place that mirrors ``agents.hooks``.

The fleet benchmark's ranks must cost the control plane what real ranks cost, so their messages
are built here exactly as ``agents.hooks.telemetry.Telemetry`` builds them and batched as
``agents.hooks.reporter.Reporter._next_batch`` batches them: rank 0 reports every step, the other
ranks only the steps they flag (a simulated rank flags none), and at every cross-rank exchange
(``GuardSettings.check_every`` steps) rank 0 reports one ``NodeWindow`` per node built by
``agents.hooks.windows`` from every rank's timings. When the hooks change what ranks send, this
module is the one to follow them.
"""

from __future__ import annotations

import math
import time
from typing import Any

from agents.hooks.guards import GuardSettings
from agents.hooks.reporter import BATCH_LIMIT, BUCKETS, CHECKPOINT, EVENT, REPORT, WINDOW
from agents.hooks.windows import RankTimings, node_windows
from agents.protocol import dump
from agents.protocol.hooks import CheckpointCommit, Event, StepReport

CHECK_EVERY = GuardSettings().check_every  # steps between cross-rank exchanges
SLOW_FACTOR = 1.6  # a straggler's compute time, relative to the others'

SAMPLES_PER_RANK = 4
TOKENS_PER_SAMPLE = 2048


def loss_at(step: int) -> float:
    return 2.0 + 8.0 / math.sqrt(step + 1)


def phases(rank: int, slow_rank: int | None) -> dict[str, float]:
    """One step's timings: the straggler computes longer, everyone else waits for it in the collectives."""
    compute = 0.8 * (SLOW_FACTOR if rank == slow_rank else 1.0)
    wait = 0.1 + (0.8 * (SLOW_FACTOR - 1) if slow_rank is not None and rank != slow_rank else 0.0)
    return {"input": 0.02, "compute": round(compute, 4), "optimizer": round(wait, 4), "checkpoint": 0.0}


def step_records(*, job: str, generation: int, rank: int, world_size: int, step: int,
                 phases: dict[str, float]) -> list[tuple[str, dict[str, Any]]]:
    """The records one rank spools for one finished step (``Telemetry.step_done``): a step report
    from rank 0, nothing from the others (they report only flagged steps)."""
    if rank != 0:
        return []
    report = StepReport(job=job, generation=generation, rank=rank, step=step, loss=loss_at(step) + rank * 1e-6,
                        grad_norm=1.0, world_size=world_size, data_cursor=step * world_size * SAMPLES_PER_RANK,
                        samples=SAMPLES_PER_RANK, tokens=SAMPLES_PER_RANK * TOKENS_PER_SAMPLE, phases=phases,
                        time=time.time())
    return [(REPORT, dump(report))]


def window_records(*, job: str, generation: int, step: int, world_size: int, nproc: int,
                   slow_rank: int | None) -> list[tuple[str, dict[str, Any]]]:
    """Rank 0's records at an exchange step (``Telemetry.exchange``): a window per node, from every
    rank's timings over the steps since the previous exchange."""
    if step % CHECK_EVERY:
        return []
    rows = []
    for rank in range(world_size):
        timings = RankTimings()
        for done in range(step - CHECK_EVERY + 1, step + 1):
            timings.add(done, phases(rank, slow_rank))
        rows.append(timings.row(rank // nproc))
    return [(WINDOW, dump(window)) for window in node_windows(rows, job=job, generation=generation, time=time.time())]


def start_records(*, job: str, generation: int, step: int) -> list[tuple[str, dict[str, Any]]]:
    """Rank 0's events when the loop starts (``Hooks.__init__``: "model", which ends the start-up allowance)."""
    event = Event(job=job, generation=generation, rank=0, step=step, kind="model", key=f"0:0:{step}:model:0",
                  message="model: 1,000,000 parameters, 2048 tokens per sample",
                  detail={"parameters": 1_000_000, "tokens_per_sample": TOKENS_PER_SAMPLE}, time=time.time())
    return [(EVENT, dump(event))]


def checkpoint_records(*, job: str, generation: int, step: int, path: str, world_size: int,
                       manifest: dict[str, Any], config_hash: str) -> list[tuple[str, dict[str, Any]]]:
    """Rank 0's records once a checkpoint's marker is on disk (``Telemetry.checkpoint_committed``)."""
    size = sum(entry["size"] for entry in manifest["files"])
    saved = Event(job=job, generation=generation, rank=0, step=step, kind="checkpoint_saved",
                  key=f"0:0:{step}:checkpoint_saved:0", message=f"checkpoint saved at step {step}: {path}",
                  detail={"path": path, "blocking_s": 0.01, "total_s": 0.05}, time=time.time())
    commit = CheckpointCommit(job=job, generation=generation, step=step, path=path, loss=loss_at(step),
                              config_hash=config_hash, data_cursor=manifest["data_cursor"], world_size=world_size,
                              size_bytes=size, blocking_s=0.01, total_s=0.05, manifest=manifest)
    return [(EVENT, dump(saved)), (CHECKPOINT, dump(commit))]


def next_batch(job: str, records: list[tuple[str, dict[str, Any]]]) -> tuple[int, dict[str, Any]]:
    """``Reporter._next_batch``: how many records at the head of the spool go in one ReportBatch, and the batch."""
    generation = records[0][1]["generation"]
    batch: dict[str, Any] = {"job": job, "generation": generation} | {b: [] for b in BUCKETS.values()}
    taken = 0
    for kind, body in records:
        if kind == CHECKPOINT or body["generation"] != generation:
            break
        bucket = batch[BUCKETS[kind]]
        if len(bucket) == BATCH_LIMIT:
            break
        bucket.append(body)
        taken += 1
    return taken, batch
