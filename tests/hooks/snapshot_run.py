"""Runs examples/train.py the way torchrun would, with snapshot faults planted from outside it.

``python -m tests.hooks.snapshot_run ARGS...`` under torchrun, with
``SNAPSHOT_FAULTS=ATTEMPT:KIND:RANK:STEP,...``; each fault fires on attempt ATTEMPT only: torchrun's
restart count plus the round of in-process restarts (``agents.hooks.inprocess``), so that the same
faults drive a run restarted by ``torchrun --max-restarts`` and one whose ranks restart in process:

- ``copy``: rank RANK SIGKILLs itself from the snapshot thread in the middle of the snapshot of
  step STEP: its own copy is written (shard and manifest, no marker), its partner has received
  nothing. That snapshot is torn: the resume must take the one before it.
- ``lose``: at step STEP, once the snapshot before it is committed on both copies, rank RANK
  removes its own snapshots (its node's memory is gone) and SIGKILLs itself mid-step: the resume
  must fetch its copy from the partner.
- ``kill``: rank RANK SIGKILLs itself mid-step at step STEP (after backward, before the update),
  whatever the snapshot thread is doing.
- ``stop``: rank RANK SIGSTOPs itself mid-step at step STEP: a hung rank, which stays stopped until
  someone kills it (the agent's supervisor does, with in-process restarts on).
"""

from __future__ import annotations

import os
import runpy
import shutil
import signal
import sys
from typing import Any


def main() -> None:
    from agents.hooks import api, inprocess, snapshot
    from agents.hooks.snapshot_store import OWN

    rank = int(os.environ.get("RANK", "0"))
    planned: dict[int, dict[str, int]] = {}
    for spec in filter(None, os.environ.get("SNAPSHOT_FAULTS", "").split(",")):
        when, kind, who, step = spec.split(":")
        if int(who) == rank:
            planned.setdefault(int(when), {})[kind] = int(step)

    def due(kind: str) -> int | None:
        """The step of this attempt's fault ``kind`` (the attempt is read when asked: in process it moves on)."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + inprocess.round_number()
        return planned.get(attempt, {}).get(kind)

    original_step = api.Hooks.step

    def step(self: Any, loss: Any) -> Any:
        coming = self.step_count + 1
        if due("lose") == coming:
            self.snapshotter.wait()
            shutil.rmtree(self.snapshotter.store.place(rank, OWN))
            print(f"rank {rank} lost its snapshots and is killed at step {coming}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if due("kill") == coming:
            print(f"rank {rank} killed at step {coming}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if due("stop") == coming:
            print(f"rank {rank} stopped at step {coming}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return original_step(self, loss)

    original_replicate = snapshot.Snapshotter._replicate

    def replicate(self: Any, key: Any, *args: Any) -> bool:
        if due("copy") == key.step:
            print(f"rank {rank} killed in the middle of the snapshot copy of step {key.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return original_replicate(self, key, *args)

    api.Hooks.step = step  # type: ignore[method-assign]
    snapshot.Snapshotter._replicate = replicate  # type: ignore[method-assign]
    sys.argv = ["examples/train.py", *sys.argv[1:]]
    runpy.run_module("examples.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
