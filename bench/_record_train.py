"""``examples/train.py`` with a recorder: what each rank's hooks saw at every step (loss, gradient
norm, learning rate, whether the guard skipped it, the step's phases) is written to
``$NIGHTWATCH_BENCH_RECORD/rank<R>.json`` at exit. Run under torchrun by ``bench.real_traces``::

    NIGHTWATCH_BENCH_RECORD=/tmp/rec torchrun --standalone --nproc-per-node=2 -m bench._record_train --steps 400

The training is ``examples.train`` unchanged; the recorder wraps the hooks' own ``LossWatch.observe``
(for the learning rate the hooks read) and ``Telemetry.step_done`` (for the rest), so the figures are
exactly those the product's detectors judged in the run.
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path
from typing import Any

from agents.hooks import guards, telemetry
from examples import train

_steps: list[dict[str, Any]] = []
_last_lr: list[float | None] = [None]


def _install() -> None:
    observe = guards.LossWatch.observe
    step_done = telemetry.Telemetry.step_done

    def recording_observe(self: guards.LossWatch, loss: float, *, lr: float | None = None,
                          skipped: bool = False) -> guards.LossVerdict:
        _last_lr[0] = lr
        return observe(self, loss, lr=lr, skipped=skipped)

    def recording_step_done(self: telemetry.Telemetry, outcome: Any, decision: Any, verdict: Any, **kw: Any) -> None:
        _steps.append({"step": outcome.step, "loss": outcome.loss, "grad_norm": outcome.grad_norm,
                       "skipped": bool(outcome.skipped), "lr": _last_lr[0],
                       "phases": {"input": self._input_s, "compute": kw["compute_s"],
                                  "optimizer": kw["optimizer_s"], "checkpoint": kw["checkpoint_s"]},
                       "verdict": verdict.kind, "action": verdict.action})
        step_done(self, outcome, decision, verdict, **kw)

    guards.LossWatch.observe = recording_observe  # type: ignore[method-assign]
    telemetry.Telemetry.step_done = recording_step_done  # type: ignore[method-assign]


def _dump() -> None:
    out = Path(os.environ["NIGHTWATCH_BENCH_RECORD"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(_steps))


if __name__ == "__main__":
    _install()
    atexit.register(_dump)
    train.train(train.parse_args())
