"""The data position as a *global sample cursor*, so a resumed job repeats and skips nothing.

The dataset is read as one endless stream of positions 0, 1, 2, …: position ``p`` is epoch
``p // N`` and sample ``perm(epoch)[p % N]``, where ``perm`` is a seeded shuffle of the N sample
indices (the identity when not shuffling). Each optimizer step consumes the next
``world_size × batch_size`` positions; rank ``r`` takes the ``r``-th block of ``batch_size``.
Read in (step, rank) order, the ranks therefore train exactly on the global stream, whatever the
world size, and a checkpoint only has to store one integer: how many positions were consumed.
Resuming on fewer or more ranks continues the same stream with no repeat and no gap.

Nothing here draws from the global RNG, and the loader is rebuilt from the cursor on resume, so
prefetching and worker processes never move the recorded position ahead of what was trained.

A script may keep its own pipeline instead (``Hooks(loader=...)``): then the position is whatever
the loader, its sampler or its dataset return from ``state_dict()`` (``pipeline_parts``), and
``set_epoch`` is called on the parts that have it (``epoch_aware``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler


def epoch_permutation(dataset_size: int, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
    """The order in which the samples of ``epoch`` are visited."""
    if not shuffle:
        return list(range(dataset_size))
    # Mix seed and epoch so that (seed, epoch+1) never equals (seed+1, epoch).
    generator = torch.Generator().manual_seed((seed * 0x9E3779B1 + epoch) % (2**63))
    return torch.randperm(dataset_size, generator=generator).tolist()


def skip_forward(cursor: int, step_size: int, skip: Sequence[tuple[int, int]]) -> int:
    """The cursor of the next step to train: ``cursor``, moved past every skipped range ``[a, b)``
    that the step would touch. A rollback may skip the data around a loss spike this way."""
    moved = True
    while moved:
        moved = False
        for start, end in skip:
            if cursor < end and start < cursor + step_size:
                cursor, moved = end, True
    return cursor


def rank_positions(cursor: int, rank: int, world_size: int, batch_size: int) -> range:
    """The global positions rank ``rank`` trains on in the step that starts at ``cursor``."""
    start = cursor + rank * batch_size
    return range(start, start + batch_size)


class GlobalCursorSampler(Sampler[list[int]]):
    """A batch sampler yielding this rank's sample indices, one step at a time, from a cursor.

    Endless: the training loop decides when to stop (``max_steps``). ``start_cursor`` is the
    number of global positions already consumed, as stored in a checkpoint.
    """

    def __init__(self, dataset_size: int, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, start_cursor: int = 0,
                 skip: Sequence[tuple[int, int]] = ()):
        if dataset_size < 1 or batch_size < 1:
            raise ValueError("dataset_size and batch_size must be at least 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.start_cursor = start_cursor
        self.skip = tuple(skip)
        self._epoch = -1
        self._order: list[int] = []

    @property
    def step_size(self) -> int:
        """Global positions consumed by one optimizer step across all ranks."""
        return self.world_size * self.batch_size

    def sample_index(self, position: int) -> int:
        """The dataset index at global ``position``."""
        epoch, offset = divmod(position, self.dataset_size)
        if epoch != self._epoch:
            self._order = epoch_permutation(self.dataset_size, epoch, self.seed, self.shuffle)
            self._epoch = epoch
        return self._order[offset]

    def indices_at(self, cursor: int) -> list[int]:
        """This rank's dataset indices for the step that starts at global ``cursor``."""
        positions = rank_positions(cursor, self.rank, self.world_size, self.batch_size)
        return [self.sample_index(p) for p in positions]

    def next_cursor(self, cursor: int) -> int:
        """Where the step after ``cursor`` really starts, skipped ranges left out."""
        return skip_forward(cursor, self.step_size, self.skip)

    def __iter__(self) -> Iterator[list[int]]:
        cursor = self.start_cursor
        while True:
            cursor = self.next_cursor(cursor)
            yield self.indices_at(cursor)
            cursor += self.step_size


# -- the user's own data pipeline ---------------------------------------------------------------


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` follows the ``state_dict()`` / ``load_state_dict(state)`` protocol
    (torchdata's ``StatefulDataLoader``, a resumable sampler or dataset)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _unique(objects: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, obj in objects:
        if obj is not None and all(obj is not seen for seen in found.values()):
            found[name] = obj
    return found


def pipeline_parts(loader: Any) -> dict[str, Any]:
    """The objects whose ``state_dict()`` holds the data position of ``loader``.

    A stateful loader (``StatefulDataLoader``) speaks for its sampler and dataset itself; a plain
    ``DataLoader`` is read through its batch sampler, sampler and dataset, whichever are stateful.
    """
    if is_stateful(loader):
        return {"loader": loader}
    candidates = [(name, getattr(loader, name, None)) for name in ("batch_sampler", "sampler", "dataset")]
    return {name: obj for name, obj in _unique(candidates).items() if is_stateful(obj)}


def epoch_aware(loader: Any) -> list[Any]:
    """The parts of ``loader`` (or a dataset) with ``set_epoch(epoch)``: sampler, batch sampler,
    the sampler inside a batch sampler, dataset."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = [("loader", loader), ("batch_sampler", batch_sampler), ("sampler", getattr(loader, "sampler", None)),
                  ("inner", getattr(batch_sampler, "sampler", None)), ("dataset", getattr(loader, "dataset", None))]
    return [obj for obj in _unique(candidates).values() if callable(getattr(obj, "set_epoch", None))]
