"""What in-memory snapshots cost a training run, and what they save after a SIGKILL.

examples/train.py (a small transformer, 2 ranks, gloo on CPU) runs under a real torchrun, the
configurations interleaved run by run: no snapshots, a snapshot every step, and every ``K``
steps. Each rank records when each of its steps ended and how long the training thread waited
for snapshots (in ``take``: the immediate copy and the wait for the previous snapshot; in
``before_update``: the background copy of parameters and optimizer state; and collecting the
state dict, which a snapshot shares with a checkpoint).

- ``every1_over_none``: steady-state step time (the median after the warm-up) with a snapshot
  every step over none, target 1.02 (the issue's 2 %);
- blocking per snapshot as a fraction of the no-snapshot step time, and the dip: the step times
  of the K steps after a snapshot (every K) over the no-snapshot median, position by position,
  since the background serialisation, hashing and copy compete with those steps;
- lost steps per SIGKILL: a rank killed mid-step at seeded steps, restarted by torchrun, with
  snapshots every step vs disk checkpoints alone (every ``DISK_EVERY`` steps): completed steps
  that had to be trained again.

Run: ``python -m bench.snapshot [--quick]``. ``--worker DIR`` is the per-rank side, started by
torchrun: it wraps the hooks' timing around examples/train.py and writes DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import random
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import emit, median, spread

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--dim", "128", "--layers", "2", "--heads", "4", "--seq-len", "64", "--vocab", "256", "--batch-size", "8"]
K = 10
DISK_EVERY = 20
WARMUP = 10
CONFIGS = {"none": 0, "every1": 1, f"every{K}": K}


def worker(directory: Path) -> None:
    """Inside torchrun: record step ends and snapshot waits, then run examples/train.py."""
    from agents.hooks import api, snapshot

    ends: list[float] = []
    waits: list[float] = []
    captures: list[float] = []
    original_step, original_ready = api.Hooks.step, snapshot.Snapshotter.before_update
    original_capture = api.Hooks._capture

    def capture(self: Any) -> Any:
        started = time.perf_counter()
        captured = original_capture(self)
        captures.append(time.perf_counter() - started)
        return captured

    def step(self: Any, loss: Any) -> Any:
        outcome = original_step(self, loss)
        ends.append(time.perf_counter())
        return outcome

    def before_update(self: Any) -> None:
        started = time.perf_counter()
        original_ready(self)
        waits.append(time.perf_counter() - started)

    api.Hooks.step = step  # type: ignore[method-assign]
    api.Hooks._capture = capture  # type: ignore[method-assign]
    snapshot.Snapshotter.before_update = before_update  # type: ignore[method-assign]
    hooks: list[Any] = []
    original_init = api.Hooks.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        hooks.append(self)

    api.Hooks.__init__ = init  # type: ignore[method-assign]
    sys.argv = ["examples/train.py", *sys.argv[3:]]
    runpy.run_module("examples.train", run_name="__main__", alter_sys=True)
    snapshotter = hooks[0].snapshotter if hooks else None
    record = {"ends": ends, "capture_s": captures, "take_s": snapshotter.blocking if snapshotter else [],
              "ready_s": waits, "start_step": hooks[0].step_count if hooks else 0}
    (directory / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


def torchrun(directory: Path, args: list[str], *, max_restarts: int = 0, timeout: float = 300.0) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.1", "-m", "bench.snapshot",
               "--worker", str(directory), *args]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTWATCH_")}
    environment.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                        "NIGHTWATCH_SNAPSHOT_DIR": str(directory / "memory")})
    done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr


def steady(record: dict[str, Any]) -> list[float]:
    """Step durations after the warm-up."""
    ends = record["ends"]
    return [b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1:], strict=False)]


def measure_cost(runs: int, steps: int, root: Path) -> dict[str, Any]:
    figures: dict[str, list[Any]] = {name: [] for name in CONFIGS}
    for run in range(runs):
        for name, every in CONFIGS.items():
            directory = root / f"{name}-{run}"
            torchrun(directory, [*MODEL, "--steps", str(steps), "--ckpt-every", "0",
                                 "--snapshot-every", str(every)])
            records = [json.loads((directory / f"rank{r}.json").read_text()) for r in (0, 1)]
            figures[name].append(records)
            shutil.rmtree(directory, ignore_errors=True)
        medians = {name: median([d for r in figures[name][-1] for d in steady(r)]) for name in CONFIGS}
        print(f"run {run + 1}: median step " + ", ".join(f"{n} {v * 1000:.1f} ms" for n, v in medians.items()),
              flush=True)
    return figures


def summarise_cost(figures: dict[str, list[Any]]) -> dict[str, Any]:
    per_run = {name: [median([d for r in records for d in steady(r)]) for records in runs]
               for name, runs in figures.items()}
    every_k = f"every{K}"
    ratio_1 = [a / b for a, b in zip(per_run["every1"], per_run["none"], strict=True)]
    ratio_k = [a / b for a, b in zip(per_run[every_k], per_run["none"], strict=True)]
    blocking = {}
    for name in ("every1", every_k):
        records = [r for run_records in figures[name] for r in run_records]
        skip = WARMUP // CONFIGS[name]
        # The training thread's part: collect_state (blobs, state-dict views) and take (copies).
        takes = [c + t for r in records for c, t in zip(r["capture_s"][skip:], r["take_s"][skip:], strict=False)]
        # before_update runs every step; only the first after a snapshot waits for its copy.
        readies = sum(sum(r["ready_s"][WARMUP:]) for r in records)
        snapshots = sum(len(r["ready_s"][WARMUP:]) for r in records) / CONFIGS[name]
        blocked = median(takes) + readies / snapshots
        blocking[name] = {"capture_and_take_s": median(takes), "before_update_s": readies / snapshots,
                          "per_snapshot_s": blocked, "over_step": blocked / median(per_run["none"])}
    dip = []
    for position in range(K):  # the step times 1..K steps after a snapshot (the K-th takes the next), every K
        durations = [b - a for records in figures[every_k] for r in records
                     for i, (a, b) in enumerate(zip(r["ends"], r["ends"][1:], strict=False))
                     if i >= WARMUP and (r["start_step"] + i + 1) % K == position]
        dip.append(median(durations) / median(per_run["none"]))
    return {"step_s": per_run, "every1_over_none": ratio_1, f"every{K}_over_none": ratio_k,
            "blocking": blocking, f"dip_after_snapshot_every{K}": dip}


def measure_lost(crashes: list[int], steps: int, root: Path) -> dict[str, Any]:
    lost: dict[str, list[int]] = {"snapshots": [], "disk_only": []}
    for crash in crashes:
        for name, every in (("snapshots", 1), ("disk_only", 0)):
            directory = root / f"lost-{name}-{crash}"
            output = torchrun(directory, [*MODEL, "--steps", str(steps), "--ckpt-every", str(DISK_EVERY),
                                          "--ckpt-dir", str(directory / "ckpt"), "--snapshot-every", str(every),
                                          "--crash-at", str(crash), "--crash-rank", "1"], max_restarts=1)
            resumed = [int(s) for s in re.findall(r"rank 0\] INFO resumed from step (\d+)", output)]
            lost[name].append(crash - 1 - (resumed[0] if resumed else 0))
            shutil.rmtree(directory, ignore_errors=True)
        print(f"killed at step {crash}: lost {lost['snapshots'][-1]} steps with snapshots, "
              f"{lost['disk_only'][-1]} with disk checkpoints every {DISK_EVERY}", flush=True)
    return lost


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int)
    args = parser.parse_args()
    runs = args.runs or (3 if args.quick else 5)
    steps = 40 if args.quick else 80
    root = Path(tempfile.mkdtemp(prefix="nightwatch-bench-snapshot-"))
    try:
        cost = summarise_cost(measure_cost(runs, steps, root))
        draw = random.Random("nightwatch-snapshot")
        crashes = [draw.randint(DISK_EVERY + 2, 2 * DISK_EVERY - 1) for _ in range(2 if args.quick else runs)]
        lost = measure_lost(crashes, 2 * DISK_EVERY + 5, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = cost["every1_over_none"]
    emit("snapshot", metric="every1_over_none", value=round(median(ratios), 4), target=1.02, better="lower",
         unit="ratio", runs=runs, spread=[round(v, 4) for v in spread(ratios)],
         details={**cost, "lost_steps": lost, "crash_steps": crashes, "disk_every": DISK_EVERY, "k": K,
                  "model_args": MODEL, "steps": steps, "warmup": WARMUP,
                  "note": "2 ranks, gloo on CPU: the background copy competes with compute for the same cores"})


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]))
    else:
        main()
