"""Runs an examples/byo script the way torchrun would, with a fault planted from outside it.

``python -m tests.hooks.byo_run SCRIPT ARGS...`` under torchrun. The script itself stays the user's
(no fault flags in it); this wrapper patches ``Hooks.step`` before running it:

- ``BYO_FAULT=kill:RANK:CALL`` or ``stop:RANK:CALL``: on the first torchrun attempt, rank RANK
  SIGKILLs or SIGSTOPs itself at its CALL-th ``nw.step`` call, after that micro-batch's backward and
  before the hooks see it (a CALL that is not a multiple of the accumulation steps lands inside a
  window);
- ``BYO_HEARTBEAT=DIR``: each rank writes how many ``nw.step`` calls it finished to DIR/rank<r>
  (the progress a watchdog looks at);
- ``BYO_LOADER=stateful``: ``torch.utils.data.DataLoader`` is torchdata's ``StatefulDataLoader``
  for the script, so the same script exercises the other stateful-loader path.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    script, *argv = sys.argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    fault = os.environ.get("BYO_FAULT", "")
    heartbeat = os.environ.get("BYO_HEARTBEAT")
    if os.environ.get("BYO_LOADER") == "stateful":
        import torch.utils.data
        from torchdata.stateful_dataloader import StatefulDataLoader

        torch.utils.data.DataLoader = StatefulDataLoader  # type: ignore[misc]
    from agents.hooks import api

    original = api.Hooks.step
    calls = 0

    def step(self: api.Hooks, loss: Any) -> api.StepOutcome:
        nonlocal calls
        calls += 1
        if fault and first_attempt:
            kind, fault_rank, at = fault.split(":")
            if rank == int(fault_rank) and calls == int(at):
                os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        outcome = original(self, loss)
        if heartbeat:
            Path(heartbeat, f"rank{rank}").write_text(str(calls))
        return outcome

    api.Hooks.step = step  # type: ignore[method-assign]
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
