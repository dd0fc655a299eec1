"""Runs examples/train.py the way torchrun would, with snapshot faults planted from outside it.

``python -m tests.hooks.snapshot_run ARGS...`` under torchrun, with
``SNAPSHOT_FAULTS=ATTEMPT:KIND:RANK:STEP,...``; each fault fires on attempt ATTEMPT only: torchrun's
restart count plus the round of in-process restarts (``agents.hooks.inprocess``), so that the same
faults drive a run restarted by ``torchrun --max-restarts`` and one whose ranks restart in process:

- ``copy``: rank RANK SIGKILLs itself from the snapshot thread in the middle of the snapshot of
  step STEP: its own copy is written (shard and manifest, no marker), its partner has received
  nothing. That snapshot is torn: the resume must take the one before it.
- ``lose``: at step STEP, once the snapshot before it is committed on both copies, rank RANK
  removes everything its node's memory holds of the job (its own snapshots, the copies it holds
  for its source) and SIGKILLs itself mid-step: the resume must fetch its copy from the partner.
  With ranks on nodes of their own (``SNAPSHOT_NODES``), or it takes the other ranks' along.
- ``kill``: rank RANK SIGKILLs itself mid-step at step STEP (after backward, before the update),
  whatever the snapshot thread is doing.
- ``stop``: rank RANK SIGSTOPs itself mid-step at step STEP: a hung rank, which stays stopped until
  someone kills it (the agent's supervisor does, with in-process restarts on).

``SNAPSHOT_NODES=ATTEMPT:NODE,NODE,...;...`` puts each rank on a node of its own for that attempt
(one rank per node, rank order): its node memory becomes ``$NIGHTWATCH_SNAPSHOT_DIR/NODE``, and the
hooks are told it is node ``RANK`` of one rank. ``0:a,b;1:b,c`` is a lost node: node a runs rank 0
until it dies, then the survivor b is renumbered rank 0 (the control plane places previous nodes
first) and the spare c joins as rank 1, with nothing in its memory.
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

    rank = int(os.environ.get("RANK", "0"))
    place_on_node(rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
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
            shutil.rmtree(self.snapshotter.store.directory)
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


def place_on_node(rank: int, attempt: int) -> None:
    plan = dict(entry.split(":") for entry in filter(None, os.environ.get("SNAPSHOT_NODES", "").split(";")))
    if str(attempt) not in plan:
        return
    nodes = plan[str(attempt)].split(",")
    from agents.hooks.snapshot_store import default_root

    os.environ["NIGHTWATCH_SNAPSHOT_DIR"] = str(default_root(os.environ.get("NIGHTWATCH_SNAPSHOT_DIR")) / nodes[rank])
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))


if __name__ == "__main__":
    main()
