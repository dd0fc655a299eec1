"""How long a checkpoint stalls training: Nightwatch's async save vs a synchronous DCP save.

A ~100M-parameter model with Adam state (~1.2 GB of float32) is trained step by step and
checkpointed through the hooks' ``Checkpointer`` both ways, interleaved run by run:

- synchronous: the training thread waits for the whole save (DCP write);
- async: it waits inside ``save`` (buffers, blobs, DCP setup) and then, after the next
  forward/backward pass, in ``before_update`` until the background copy of parameters and
  optimizer state is done, exactly where the hooks wait in a real run.

The metric is the median over runs of async stall / sync stall (target <= 0.10). Each save is
committed (sha256 of every file, manifest, marker) before the next one starts. The first async
save also allocates the staging buffers that later saves reuse; it is measured once, before the
runs, as ``first_async_block_s``. ``compute_*`` show how much the background copy slows the
forward/backward it overlaps.

    python -m bench.ckpt_blocking [--quick]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from agents.hooks import state
from agents.hooks.checkpointer import Checkpointer
from agents.hooks.staging import stable_tensors
from agents.hooks.topology import Topology
from bench._common import arguments, emit, median, spread, timed

WIDTH, LAYERS = 4096, 6  # 6 x (4096 x 4096 + 4096) = 100.7M parameters
BATCH = 32


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    optimizer = torch.optim.Adam(model.parameters())
    train_step(model, torch.randn(BATCH, WIDTH))
    optimizer.step()  # materialises Adam's exp_avg and exp_avg_sq
    return model, optimizer


def train_step(model: nn.Module, batch: torch.Tensor) -> float:
    """Forward and backward of one batch; returns the seconds it took."""
    started = time.perf_counter()
    model.zero_grad(set_to_none=True)
    model(batch).pow(2).mean().backward()
    return time.perf_counter() - started


def start_save(checkpointer: Checkpointer, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    snapshot = state.collect_state(model, optimizer, scheduler=None, scaler=None,
                                   progress=state.Progress(step=step), rank=0)
    return checkpointer.save(step, snapshot, {"config_hash": "bench", "world_size": 1, "data_cursor": 0,
                                              "parts": state.saved_parts(set(snapshot))},
                             stable=stable_tensors(model, optimizer))


def finish_save(checkpointer: Checkpointer) -> float:
    """Wait for the commit, delete the files; returns seconds from the start of the save to the commit."""
    commit = checkpointer.wait()
    if commit is None:
        raise RuntimeError("checkpoint failed; see the log")
    shutil.rmtree(commit.path)
    return commit.total_s


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    model, optimizer = build()
    batch = torch.randn(BATCH, WIDTH)
    figures: dict[str, list[float]] = {k: [] for k in (
        "sync_stall_s", "async_stall_s", "async_save_s", "async_wait_s", "sync_total_s", "async_total_s",
        "compute_plain_s", "compute_during_copy_s", "ratio")}
    directory = Path(tempfile.mkdtemp(prefix="nightwatch-bench-"))
    try:
        sync = Checkpointer(directory, Topology(), generation=0, run_id="5", use_async=False)
        overlapped = Checkpointer(directory, Topology(), generation=0, run_id="a", use_async=True)
        first_async_block = start_save(overlapped, 0, model, optimizer)
        overlapped.before_update()
        finish_save(overlapped)
        for run in range(1, args.runs + 1):
            figures["compute_plain_s"].append(train_step(model, batch))
            sync_stall = start_save(sync, run, model, optimizer)
            optimizer.step()
            figures["sync_total_s"].append(finish_save(sync))

            async_save = start_save(overlapped, run, model, optimizer)
            figures["compute_during_copy_s"].append(train_step(model, batch))
            async_wait = timed(overlapped.before_update)
            optimizer.step()
            figures["async_total_s"].append(finish_save(overlapped))

            for key, value in (("sync_stall_s", sync_stall), ("async_save_s", async_save),
                               ("async_wait_s", async_wait), ("async_stall_s", async_save + async_wait),
                               ("ratio", (async_save + async_wait) / sync_stall)):
                figures[key].append(value)
            print(f"run {run}: sync stalls {sync_stall:.3f}s, async stalls {async_save:.3f}s + "
                  f"{async_wait:.3f}s, ratio {figures['ratio'][-1]:.3f}", flush=True)
        sync.close()
        overlapped.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    ratios = figures.pop("ratio")
    # The copy does not vanish: it competes with the forward/backward it overlaps. Counting that
    # slowdown as checkpoint cost too gives the effective ratio.
    slowdown = median(figures["compute_during_copy_s"]) - median(figures["compute_plain_s"])
    effective = (median(figures["async_stall_s"]) + max(0.0, slowdown)) / median(figures["sync_stall_s"])
    emit("ckpt_blocking", metric="async_block_over_sync", value=round(median(ratios), 4), target=0.10,
         better="lower", unit="ratio", runs=args.runs, spread=[round(v, 4) for v in spread(ratios)],
         details={"parameters": sum(p.numel() for p in model.parameters()),
                  "state_bytes": sum(p.numel() * 3 * p.element_size() for p in model.parameters()),
                  "batch": BATCH, "ratios": ratios, **figures, "first_async_block_s": first_async_block,
                  "effective_cost_over_sync": round(effective, 4),
                  "note": "single process on CPU; stall = time the training thread waits for checkpointing"})


if __name__ == "__main__":
    main()
