"""Runs an examples/byo script the way torchrun would, with a fault planted from outside it.

``python -m tests.hooks.byo_run SCRIPT ARGS...`` under torchrun. The script itself stays the user's
(no fault flags in it); this wrapper patches ``Hooks.step`` before running it:

- ``BYO_FAULT=kill:RANK:CALL`` or ``stop:RANK:CALL``: on the first torchrun attempt, rank RANK
  SIGKILLs or SIGSTOPs itself at its CALL-th ``nw.step`` call, after that micro-batch's backward and
  before the hooks see it (a CALL that is not a multiple of the accumulation steps lands inside a
  window);
- ``BYO_FAULT=commit:0:N``: on the first attempt, rank 0 (the rank that commits) SIGKILLs itself
  in the middle of its N-th checkpoint commit, from the commit thread: every shard is written and
  ``manifest.json`` is on disk, the commit marker is not. The save is torn, and the resume must
  take the checkpoint before it;
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
        if fault.startswith(("kill:", "stop:")) and first_attempt:
            kind, fault_rank, at = fault.split(":")
            if rank == int(fault_rank) and calls == int(at):
                os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        outcome = original(self, loss)
        if heartbeat:
            Path(heartbeat, f"rank{rank}").write_text(str(calls))
        return outcome

    api.Hooks.step = step  # type: ignore[method-assign]
    if fault.startswith("commit:") and first_attempt and rank == int(fault.split(":")[1]):
        _kill_inside_commit(int(fault.split(":")[2]))
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def _kill_inside_commit(nth: int) -> None:
    """SIGKILL this process when its ``nth`` commit is about to write the marker."""
    from agents.hooks import manifest

    original = manifest._write_atomically
    commits = 0

    def write(path: Path, data: bytes) -> None:
        nonlocal commits
        if path.name == manifest.MARKER:
            commits += 1
            if commits == nth:
                print(f"killed inside the commit of {path.parent.name}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        original(path, data)

    manifest._write_atomically = write  # type: ignore[assignment]


if __name__ == "__main__":
    main()
