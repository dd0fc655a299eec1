"""Curves from real small runs of ``examples/train.py`` with faults injected for real, for
``bench.detect``: the committed fixture ``bench/real_traces.json`` and its loader.

Regenerate the fixture (2 CPU ranks under torchrun, about 400 steps a run, a few minutes)::

    python -m bench.real_traces

Each scenario is one torchrun of ``bench._record_train`` (``examples.train`` with a recorder) with
one fault flag of ``examples/train.py``; what every rank's hooks saw at every step (loss, gradient
norm, learning rate, the step's phases) is kept:

- ``benign``: no fault: the real curve's noise (4 samples a rank a step), checkpoint stalls every
  50 steps, the machine's own jitter;
- ``corrupt-2`` / ``corrupt-1``: every rank's batch partly replaced by random tokens for 2 steps /
  1 step (``--corrupt-batch-at``): a real loss spike, labelled ``spike`` (a pause is right);
- ``nan``: a NaN loss on rank 1 (``--inject-nan-at``): labelled ``nan``;
- ``straggler``: rank 1 busy-computes 40 ms more per step from step 200 (``--slow-rank``):
  labelled ``straggler`` (rank 1, node 0).

The runs are real, so the figures are not bit-for-bit reproducible (timing, and gloo's reduction
order); the command and the seeds are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _traces

FIXTURE = Path(__file__).with_name("real_traces.json")
STEPS = 400
CKPT_EVERY = 50
COMMAND = "python -m bench.real_traces"

#: name -> (extra flags of examples/train.py, labels: (kind, start, end, rank, node))
SCENARIOS: dict[str, tuple[list[str], list[tuple[str, int, int, int | None, int | None]]]] = {
    "benign": ([], []),
    "corrupt-2": (["--corrupt-batch-at", "250", "--corrupt-steps", "2", "--corrupt-fraction", "0.5"],
                  [("spike", 250, 251, None, None)]),
    "corrupt-1": (["--corrupt-batch-at", "300", "--corrupt-steps", "1", "--corrupt-fraction", "0.3"],
                  [("spike", 300, 300, None, None)]),
    "nan": (["--inject-nan-at", "250", "--fault-rank", "1"], [("nan", 250, 250, 1, 0)]),
    "straggler": (["--slow-rank", "1", "--slow-ms", "40", "--slow-from", "200"],
                  [("straggler", 200, STEPS, 1, 0)]),
}


def _round(values: list[float], digits: int = 5) -> list[float | None]:
    out: list[float | None] = []
    for v in values:
        out.append(None if v != v or v in (float("inf"), float("-inf")) else float(f"{v:.{digits}g}"))
    return out


def run_scenario(name: str, workdir: Path) -> dict[str, Any]:
    flags, labels = SCENARIOS[name]
    record = workdir / name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "bench._record_train", "--steps", str(STEPS), "--ckpt-dir", str(workdir / f"{name}-ckpt"),
               "--ckpt-every", str(CKPT_EVERY), "--seed", "0", *flags]
    env = {**os.environ, "NIGHTWATCH_BENCH_RECORD": str(record), "OMP_NUM_THREADS": "1"}
    for key in ("NIGHTWATCH_JOB", "NIGHTWATCH_SERVER", "NIGHTWATCH_TOKEN"):
        env.pop(key, None)  # a standalone run: no control plane
    started = time.monotonic()
    subprocess.run(command, env=env, check=True, timeout=900, cwd=Path(__file__).resolve().parent.parent,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = [json.loads((record / f"rank{r}.json").read_text()) for r in range(2)]
    return {
        "name": name, "flags": flags, "steps": min(len(r) for r in ranks), "seconds": round(time.monotonic() - started),
        "losses": [_round([s["loss"] for s in r]) for r in ranks],
        "grad_norms": _round([s["grad_norm"] for s in ranks[0]]),
        "lrs": _round([s["lr"] for s in ranks[0]]),
        "phases": [{p: _round([s["phases"][p] for s in r], 4) for p in _traces.PHASES} for r in ranks],
        "labels": [{"kind": k, "start": a, "end": b, "rank": rk, "node": nd} for k, a, b, rk, nd in labels],
    }


def generate(path: Path = FIXTURE) -> None:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for name in SCENARIOS:
            runs.append(run_scenario(name, Path(tmp)))
            print(f"{name}: {runs[-1]['steps']} steps in {runs[-1]['seconds']} s", flush=True)
    meta = {"command": COMMAND, "torch": torch.__version__, "ranks": 2, "nodes": 1,
            "train": "examples/train.py defaults (TinyLM dim 32, 2 layers, batch 4 a rank, AdamW lr 3e-3, "
                     f"warm-up 10), --seed 0, --ckpt-every {CKPT_EVERY}", "generated": time.strftime("%Y-%m-%d")}
    path.write_text(json.dumps({"meta": meta, "runs": runs}, separators=(",", ":")) + "\n")
    print(f"wrote {path} ({path.stat().st_size // 1024} KB)")


def _label(d: dict[str, Any], detail: dict[str, Any] | None = None) -> _traces.Label:
    return _traces.Label(d["kind"], d["start"], d["end"], rank=d["rank"], node=d["node"], detail=detail or {})


def load(path: Path = FIXTURE) -> tuple[list[_traces.LossTrace], list[_traces.TimingTrace]]:
    """The fixture's runs as loss traces (every run but the straggler's, whose loss is an ordinary
    curve) and step-time traces (every run: the others have checkpoint stalls and the machine's
    jitter, and no straggler)."""
    data = json.loads(path.read_text())
    losses, timings = [], []
    for run in data["runs"]:
        steps = run["steps"]
        nan = float("nan")
        curves = [[nan if v is None else v for v in rank[:steps]] for rank in run["losses"]]
        loss_labels = [_label(d) for d in run["labels"] if d["kind"] != "straggler"]
        if run["name"] != "straggler":
            losses.append(_traces.LossTrace(f"real-{run['name']}", steps, curves,
                                            [nan if v is None else v for v in run["grad_norms"][:steps]],
                                            [v or 0.0 for v in run["lrs"][:steps]], loss_labels))
        phases = [[{p: rank[p][t] or 0.0 for p in _traces.PHASES} for t in range(steps)] for rank in run["phases"]]
        timing_labels = [_label(d, {"phase": "compute", "pattern": "steady"}) for d in run["labels"]
                         if d["kind"] == "straggler"]
        timing_labels += [_traces.Label("checkpoint_stall", s, s + 2) for s in range(CKPT_EVERY, steps + 1, CKPT_EVERY)]
        timings.append(_traces.TimingTrace(f"real-{run['name']}", steps, phases, [0] * len(phases), timing_labels))
    return losses, timings


if __name__ == "__main__":
    generate()
