"""Who this process is among the ranks, and the side channels the hooks talk on.

The hooks never use the training's default process group. They create two gloo groups of their
own, in the same order on every rank:

- ``checkpoint_group`` for torch.distributed.checkpoint. ``async_save`` runs its collectives in a
  background thread; sharing the group DDP uses deadlocked the first async save (torch 2.13).
- ``sync_group`` for the hooks' own small exchanges from the training thread (consistency
  check, control agreement, resume choice). A group is an ordered stream of collectives, so it
  must not be shared with the checkpoint thread either.

In-memory snapshots (``snapshot.py``) get a third group, created by ``side_group`` only when they
are on, for the same reason: their copies to the partner rank run in a background thread.

gloo works on CPU tensors, so these exchanges never synchronise a GPU stream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agents.hooks import inprocess


@dataclass(frozen=True)
class Topology:
    """This process's place among the ranks; the default is a single process without groups."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node: int = 0  # torchrun's node rank (GROUP_RANK): which of the job's nodes this process runs on
    local_world_size: int = 1  # ranks on this node (torchrun's LOCAL_WORLD_SIZE)
    checkpoint_group: Any = None
    sync_group: Any = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def snapshot_shift(self) -> int:
        """How far a rank's snapshot partner is: one node on (``local_world_size`` ranks), so the
        copy survives the loss of this node; on a single node, the next rank. A shift by a constant
        is a ring, so every rank holds exactly one other rank's copy."""
        if self.world_size <= 1:
            return 0
        return self.local_world_size if 0 < self.local_world_size < self.world_size else 1

    @property
    def snapshot_partner(self) -> int:
        """The rank that holds a copy of this rank's snapshots."""
        return (self.rank + self.snapshot_shift) % max(1, self.world_size)

    @property
    def snapshot_source(self) -> int:
        """The rank whose snapshots this rank holds a copy of."""
        return (self.rank - self.snapshot_shift) % max(1, self.world_size)

    @property
    def restart_count(self) -> int:
        """How many times torchrun has restarted this worker group (0 on the first attempt)."""
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    @property
    def attempt(self) -> str:
        """Names this run of the worker group: torchrun's restart count, and the round of in-process
        restarts within it when there was one (``"2"``, ``"2.1"``)."""
        number = inprocess.round_number()
        return f"{self.restart_count}.{number}" if number else str(self.restart_count)

    def all_gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (same length on every rank), indexed by rank."""
        if not self.distributed:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.sync_group)
        return [t.tolist() for t in gathered]

    def broadcast_from_rank0(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a picklable object)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.sync_group)
        return box[0]


def discover() -> Topology:
    """The topology of this process: single-process unless a default process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return Topology()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return Topology(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                    node=int(os.environ.get("GROUP_RANK", "0")),
                    local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or dist.get_world_size(),
                    checkpoint_group=dist.new_group(backend="gloo"),
                    sync_group=dist.new_group(backend="gloo"))


def side_group(topology: Topology, timeout_s: float) -> Any:
    """A new gloo group of every rank (a collective: every rank calls it at the same point), for
    a background thread's own traffic; None for a single process."""
    if not topology.distributed:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
