"""Which checkpoint a starting process resumes from, and putting it back.

The choice, made on rank 0 and broadcast so every rank loads the same one:

1. the newest verified checkpoint written by *this* generation: it exists only when torchrun
   restarted the workers inside the generation, and it is newer than anything the control plane
   could have named when the generation began;
2. else the checkpoint the control plane named (NIGHTWATCH_RESUME_FROM). If it fails
   verification the process refuses to start (EXIT_RESUME_REFUSED) rather than quietly
   restoring something else: the control plane chose it, possibly as a rollback target;
3. else the newest verified checkpoint in the directory, from any generation;
4. else a fresh start.

Every checkpoint passed over on the way is returned with the reason, to be logged and reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from agents.hooks import state
from agents.hooks.checkpointer import load_checkpoint
from agents.hooks.manifest import latest_verified, verify
from agents.hooks.settings import Environment
from agents.hooks.topology import Topology

log = logging.getLogger("nightwatch.hooks")


@dataclass(frozen=True)
class ResumeChoice:
    path: str | None = None
    step: int | None = None
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    refused: str | None = None  # why the named checkpoint cannot be used
    world_size: int | None = None  # the world size that wrote it (its manifest)


def choose_checkpoint(env: Environment, ckpt_dir: str | None, config_hash: str) -> ResumeChoice:
    """Rank 0's decision (it hashes files, so the other ranks do not repeat it)."""
    rejected = []
    if ckpt_dir:
        own, turned_down = latest_verified(ckpt_dir, config_hash=config_hash, generation=env.generation)
        rejected += turned_down
        if own:
            return ResumeChoice(own.path, own.step, _reasons(rejected), world_size=_world_size(own))
    if env.resume_from:
        named = verify(env.resume_from, config_hash=config_hash)
        if not named.ok:
            log.error("refusing to start: the checkpoint to resume from, %s, failed verification: %s",
                      named.path, named.reason)
            return ResumeChoice(rejected=_reasons([*rejected, named]), refused=named.reason)
        return ResumeChoice(named.path, named.step, _reasons(rejected), world_size=_world_size(named))
    if ckpt_dir:
        newest, turned_down = latest_verified(ckpt_dir, config_hash=config_hash,
                                              exclude={v.path for v in rejected})
        rejected += turned_down
        if newest:
            return ResumeChoice(newest.path, newest.step, _reasons(rejected), world_size=_world_size(newest))
    return ResumeChoice(rejected=_reasons(rejected))


def restore(path: str, topology: Topology, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
            scheduler: Any, scaler: Any, epoch_scheduler: Any = None,
            loop: Callable[[dict[str, Any]], None] | None = None) -> tuple[state.Progress, list[str]]:
    """Load ``path`` into the live objects on every rank; returns the progress and parts restored."""
    saved_keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    target = state.load_target(model, optimizer, saved_keys=saved_keys, rank=topology.rank)
    load_checkpoint(path, target, topology)
    return state.apply_state(target, model, optimizer, scheduler=scheduler, scaler=scaler, rank=topology.rank,
                             epoch_scheduler=epoch_scheduler, loop=loop)


def _world_size(verdict: Any) -> int | None:
    size = (verdict.manifest or {}).get("world_size")
    return size if isinstance(size, int) else None


def _reasons(verdicts: list[Any]) -> list[tuple[str, str]]:
    return [(v.path, v.reason or "") for v in verdicts]
