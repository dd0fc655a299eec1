"""Staging for async checkpoints: copy the state to CPU buffers while training goes on.

DCP's own staging copies the whole state before ``async_save`` returns, and on a CPU (or with a
fast local disk) that copy is a good part of what a synchronous save costs. Most of the state —
parameters and optimizer moments — only changes inside the optimizer step, so it can be copied
*while the next batch is loaded and its forward and backward passes run*:

1. ``stage`` copies, right away, every tensor that may change before the next optimizer step
   (buffers such as BatchNorm statistics, which the forward pass updates in place), then starts a
   background copy of the rest (the *stable* tensors the caller names);
2. the hooks call ``ready()`` right before the next optimizer step, which waits for that copy;
3. the background copy checks afterwards that no stable tensor was modified in place while it
   was being read (PyTorch bumps a tensor's ``_version`` on every in-place op). If one was (a
   training script editing parameters outside ``nw.step``), the copy may be torn: it writes a
   ``TORN-rank<r>`` file into the checkpoint directory, which stops rank 0 from committing it,
   and the stager falls back to copying everything up front from then on.

Buffers are allocated once and reused (at most one save is in flight), so after the first save
staging is a plain memcpy. On CUDA the copy runs on the thread's default stream, so it is ordered
after the kernels that produced the values and before the optimizer kernels queued after ``ready``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

log = logging.getLogger("nightwatch.hooks")

TORN_PREFIX = "TORN-rank"

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class OverlappedStager(AsyncStager):
    _synchronize_after_execute = False

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.overlap = True
        self._buffers: Any = None
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nightwatch-stage")
        self._copying: Future[Any] | None = None
        self._stable: frozenset[int] = frozenset()
        self._directory: Path | None = None

    def prepare(self, directory: Path, stable: frozenset[int]) -> None:
        """Before ``async_save``: where the checkpoint goes and which tensors (by data_ptr) are stable."""
        self._directory, self._stable = directory, stable

    def stage(self, state_dict: dict[str, Any]) -> Any:
        if not _plain_tensors_only(state_dict):
            # DTensor / ShardedTensor (FSDP, tensor parallel): DCP's own staging keeps their sharding.
            return DefaultStager(StagingOptions(False, False, False, False)).stage(state_dict)
        now: Pairs = []
        later: Pairs = []
        self._buffers, staged = mirror(state_dict, self._buffers, self._stable if self.overlap else frozenset(),
                                        now, later)
        copy_pairs(now)
        if not later:
            return staged
        versions = [src._version for src, _ in later]
        self._copying = self._copier.submit(self._copy_in_background, staged, later, versions, self._directory)
        return self._copying

    def ready(self) -> None:
        """Wait until the background copy is done: the stable tensors may change after this."""
        copying, self._copying = self._copying, None
        if copying is not None:
            wait([copying])  # a failed copy is DCP's to report (the save fails); training goes on

    def synchronize_staging(self) -> None:
        self.ready()

    def close(self) -> None:
        self.ready()
        self._copier.shutdown(wait=True)
        self._buffers = None

    def _copy_in_background(self, staged: Any, pairs: Pairs, versions: list[int], directory: Path | None) -> Any:
        copy_pairs(pairs)
        if any(src._version != version for (src, _), version in zip(pairs, versions, strict=True)):
            # Returning normally matters: a rank that failed here would leave the other ranks
            # waiting forever in DCP's collectives. The checkpoint is written, but never committed.
            log.error("a parameter or optimizer tensor was modified in place while it was being "
                      "checkpointed (outside nw.step?): this checkpoint will not be committed, and "
                      "later ones will be staged synchronously")
            self.overlap = False
            if directory is not None:
                (directory / f"{TORN_PREFIX}{self.rank}").touch()
        return staged


def mirror(src: Any, buffers: Any, stable: frozenset[int], now: Pairs, later: Pairs) -> tuple[Any, Any]:
    """(buffers, staged): ``src``'s structure with every tensor replaced by its reused CPU buffer.

    Buffers are reused where shape and dtype still match and allocated otherwise. Each tensor is
    queued for copying now, or later when its data_ptr is in ``stable``.
    """
    if isinstance(src, torch.Tensor):
        if not (isinstance(buffers, torch.Tensor) and buffers.shape == src.shape and buffers.dtype == src.dtype):
            buffers = torch.empty(src.shape, dtype=src.dtype, pin_memory=torch.cuda.is_available())
        (later if src.data_ptr() in stable else now).append((src, buffers))
        return buffers, buffers
    if isinstance(src, dict):
        old_by_key = buffers if isinstance(buffers, dict) else {}
        by_key = {key: mirror(value, old_by_key.get(key), stable, now, later) for key, value in src.items()}
        return {k: b for k, (b, _) in by_key.items()}, {k: s for k, (_, s) in by_key.items()}
    if isinstance(src, (list, tuple)):
        old: Sequence[Any] = (buffers if isinstance(buffers, (list, tuple)) and len(buffers) == len(src)
                              else [None] * len(src))
        pairs = [mirror(value, b, stable, now, later) for value, b in zip(src, old, strict=True)]
        return type(src)(b for b, _ in pairs), type(src)(s for _, s in pairs)
    return None, src  # ints, floats, strings, bytes blobs: immutable, staged as they are


def _plain_tensors_only(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return type(value) in (torch.Tensor, torch.nn.Parameter)
    if isinstance(value, dict):
        return all(_plain_tensors_only(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_plain_tensors_only(v) for v in value)
    return True


def copy_pairs(pairs: Pairs) -> None:
    with torch.no_grad():
        for src, dst in pairs:
            dst.copy_(src)


def stable_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> frozenset[int]:
    """data_ptrs of what only the optimizer step changes: parameters and optimizer state."""
    ptrs = {p.data_ptr() for p in model.parameters()}
    for per_param in optimizer.state.values():
        ptrs.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
    return frozenset(ptrs)
