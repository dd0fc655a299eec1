"""Who this process is among the ranks, and the side channels the hooks talk on.

The hooks never use the training's default process group. They create two gloo groups of their
own, in the same order on every rank:

- ``checkpoint_group`` for torch.distributed.checkpoint. ``async_save`` runs its collectives in a
  background thread; sharing the group DDP uses deadlocked the first async save (torch 2.13).
- ``sync_group`` for the hooks' own small exchanges from the training thread (consistency
  check, control agreement, resume choice). A group is an ordered stream of collectives, so it
  must not be shared with the checkpoint thread either.

gloo works on CPU tensors, so these exchanges never synchronise a GPU stream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """This process's place among the ranks; the default is a single process without groups."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node: int = 0  # torchrun's node rank (GROUP_RANK): which of the job's nodes this process runs on
    checkpoint_group: Any = None
    sync_group: Any = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def restart_count(self) -> int:
        """How many times torchrun has restarted this worker group (0 on the first attempt)."""
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

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
                    checkpoint_group=dist.new_group(backend="gloo"),
                    sync_group=dist.new_group(backend="gloo"))
