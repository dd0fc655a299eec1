"""The script's own data pipeline and gradient accumulation, in one process (no torchrun): a stateful
sampler, torchdata's StatefulDataLoader, a sampler without state, per-epoch schedulers and
ReduceLROnPlateau, each resumed from a checkpoint and compared with a run that never stopped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from agents.hooks import Environment, Hooks, StopTraining, resume
from agents.protocol.hooks import EXIT_RESUME_REFUSED
from examples.byo.plain_ddp import ShardedShuffleSampler
from tests.hooks.test_exact_resume import assert_identical

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:'set_vital' is deprecated")

SIZE = 24  # samples; batch 2 → 12 batches an epoch


class Numbers(Dataset):
    """Sample i is (x_i, y_i) drawn from i; it also records which epochs it was told."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int):
        x = torch.randn(4, generator=torch.Generator().manual_seed(index))
        return index, x, x.sum(dim=0, keepdim=True)

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class CountingSampler(ShardedShuffleSampler):
    """The example's sharded sampler (one rank), noting every set_epoch call."""

    def __init__(self) -> None:
        super().__init__(SIZE, 0, 1, seed=3)
        self.told: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.told.append(epoch)
        super().set_epoch(epoch)


def stateful_loader(dataset: Dataset, sampler: Sampler | None = None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    if sampler is None:
        # No generator=: torchdata 0.11 draws the iterator's base seed from a given generator too,
        # and its state then misses that draw (the epoch after a mid-epoch resume is shuffled
        # differently, hooks or not). Without one, it seeds its own from the global RNG, and saves it.
        return StatefulDataLoader(dataset, batch_size=2, shuffle=True)
    return StatefulDataLoader(dataset, batch_size=2, sampler=sampler)


PIPELINES = {
    "own sampler in a DataLoader": lambda d: DataLoader(d, batch_size=2, sampler=CountingSampler()),
    "StatefulDataLoader, shuffling": stateful_loader,
    "StatefulDataLoader around the own sampler": lambda d: stateful_loader(d, CountingSampler()),
    # no state_dict anywhere: the hooks re-read the epoch's batches up to the position
    "DistributedSampler (stateless)": lambda d: DataLoader(
        d, batch_size=2, sampler=DistributedSampler(d, num_replicas=1, rank=0, seed=7)),
}


def build(tmp_path, pipeline: str, *, accumulation_steps: int = 3, **options) -> tuple[Hooks, list]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)
    seen: list = []
    nw = Hooks(model, optimizer, scheduler=scheduler, loader=PIPELINES[pipeline](Numbers()),
               accumulation_steps=accumulation_steps, ckpt_dir=str(tmp_path / "ckpt"), checkpoint_every=2,
               async_save=False, env=Environment(), **options)
    return nw, seen


def run(nw: Hooks, seen: list, steps: int, crash_at_call: int | None = None) -> None:
    """Train to ``steps``; with ``crash_at_call``, stop dead at that micro-batch (as a SIGKILL would:
    no close, nothing after it)."""
    for calls, (ids, x, y) in enumerate(nw.batches(max_steps=steps), start=1):
        seen.append(ids.tolist())
        loss = (nw.model(x) - y).pow(2).mean() / nw.accumulation_steps
        loss.backward()
        if calls == crash_at_call:
            return
        nw.step(loss)
    nw.close()


def final_state(nw: Hooks) -> dict:
    return {"model": nw.model.state_dict(), "optim": nw.optimizer.state_dict(),
            "scheduler": nw.scheduler.state_dict(), "step": nw.step_count, "epoch": nw.epoch}


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_a_resume_inside_an_accumulation_window_replays_it_exactly(tmp_path, pipeline):
    # 3 micro-batches a step, 12 batches an epoch: 10 steps cross two epoch ends (after steps 4 and 8).
    reference, reference_seen = build(tmp_path / "reference", pipeline)
    run(reference, reference_seen, 10)

    first, first_seen = build(tmp_path / "faulted", pipeline)
    run(first, first_seen, 10, crash_at_call=3 * 6 + 2)  # step 7's second micro-batch; newest checkpoint: 6
    first.checkpointer.close()
    resumed, resumed_seen = build(tmp_path / "faulted", pipeline)
    assert resumed.step_count == 6 and resumed.epoch == 1
    run(resumed, resumed_seen, 10)

    assert_identical(final_state(resumed), final_state(reference))
    # The batches trained: everything up to the checkpoint, then the replayed window onwards.
    assert first_seen[:18] + resumed_seen == reference_seen
    assert len(reference_seen) == 30 and sorted(sum(reference_seen[:12], [])) == list(range(SIZE))
    assert reference.epoch == 2


def test_the_epoch_is_told_to_the_sampler_and_the_dataset(tmp_path):
    nw, seen = build(tmp_path, "own sampler in a DataLoader", accumulation_steps=2)
    run(nw, seen, 13)  # 26 batches: epochs 0, 1 and the first two batches of epoch 2
    assert nw.loader.sampler.told == [0, 1, 2]
    assert nw.loader.dataset.epochs == [0, 1, 2]
    assert [sorted(sum(seen[i:i + 12], [])) for i in (0, 12)] == [list(range(SIZE))] * 2
    assert seen[:12] != seen[12:24]  # a new shuffle each epoch


def test_accumulation_counts_steps_in_updates_and_checkpoints_on_window_boundaries(tmp_path):
    nw, _ = build(tmp_path, "own sampler in a DataLoader", accumulation_steps=4)
    outcomes = []
    for _, x, y in nw.batches(max_steps=3):
        loss = (nw.model(x) - y).pow(2).mean()
        loss.backward()
        outcomes.append(nw.step(loss))
    nw.close()
    assert [o.accumulating for o in outcomes] == [True, True, True, False] * 3
    assert [o.step for o in outcomes] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert all(o.grad_norm != o.grad_norm for o in outcomes if o.accumulating)  # NaN: not measured
    assert nw.data_cursor == 3 * 4 * 2  # samples: 3 steps × 4 micro-batches × 2
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("step-*"))
    assert steps == [2, 3]


def test_the_window_loss_is_the_sum_of_the_micro_batch_losses(tmp_path):
    nw, _ = build(tmp_path, "own sampler in a DataLoader", accumulation_steps=3)
    values, outcome = [], None
    for _, x, y in nw.batches(max_steps=1):
        loss = (nw.model(x) - y).pow(2).mean()
        loss.backward()
        values.append(float(loss.detach()))
        outcome = nw.step(loss)
    nw.close()
    assert outcome is not None and not outcome.accumulating
    assert outcome.loss == pytest.approx(sum(values))


@pytest.mark.parametrize("plateau", [False, True])
def test_per_epoch_schedulers_are_stepped_at_epoch_ends_and_resumed(tmp_path, plateau):
    def make(directory):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        epoch_scheduler = (torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0,
                                                                      threshold=10.0)
                           if plateau else torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
        return Hooks(model, optimizer, epoch_scheduler=epoch_scheduler,
                     loader=DataLoader(Numbers(), batch_size=2, sampler=CountingSampler()), accumulation_steps=2,
                     ckpt_dir=str(directory), checkpoint_every=5, async_save=False, env=Environment()), []

    reference, seen = make(tmp_path / "reference")
    run(reference, seen, 16)  # 6 steps an epoch: epochs end after steps 6 and 12
    # threshold=10 (relative): no epoch counts as an improvement, so the plateau halves each time.
    assert reference.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 / 4)
    first, first_seen = make(tmp_path / "faulted")
    run(first, first_seen, 16, crash_at_call=2 * 13 + 1)  # step 14's first micro-batch; checkpoint: 10
    first.checkpointer.close()
    resumed, resumed_seen = make(tmp_path / "faulted")
    assert resumed.step_count == 10
    run(resumed, resumed_seen, 16)
    assert_identical(resumed.model.state_dict(), reference.model.state_dict())
    assert resumed.epoch_scheduler.state_dict() == reference.epoch_scheduler.state_dict()
    assert resumed.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]


def test_reduce_lr_on_plateau_as_the_per_step_scheduler_gets_the_step_loss(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, threshold=10.0)
    nw = Hooks(model, optimizer, scheduler=plateau, dataset=Numbers(), batch_size=2, env=Environment())
    run(nw, [], 3)
    assert plateau.last_epoch == 3 and optimizer.param_groups[0]["lr"] < 0.05


def test_the_default_sampler_tells_an_epoch_aware_dataset_its_epoch(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    dataset = Numbers()
    nw = Hooks(model, torch.optim.SGD(model.parameters(), lr=0.01), dataset=dataset, batch_size=4,
               accumulation_steps=2, env=Environment())
    run(nw, [], 8)  # 64 samples of 24: epochs 0, 1, 2
    assert dataset.epochs == [0, 1, 2] and nw.epoch == 2
    assert nw.data_cursor == 64


def test_a_prefetching_dataloader_around_a_stateful_sampler_is_refused(tmp_path):
    model = nn.Linear(4, 1)
    loader = DataLoader(Numbers(), batch_size=2, sampler=CountingSampler(), num_workers=2)
    with pytest.raises(ValueError, match="StatefulDataLoader"):
        Hooks(model, torch.optim.SGD(model.parameters(), lr=0.01), loader=loader, env=Environment())


def test_batch_indices_needs_the_default_sampler(tmp_path):
    nw, _ = build(tmp_path, "own sampler in a DataLoader")
    with pytest.raises(RuntimeError, match="default sampler|own sampler"):
        nw.batch_indices()
    nw.close()


def test_loader_and_dataset_together_are_a_usage_error():
    model = nn.Linear(4, 1)
    with pytest.raises(ValueError, match="either loader"):
        Hooks(model, torch.optim.SGD(model.parameters(), lr=0.01), loader=[1], dataset=Numbers(), env=Environment())


def test_an_own_loader_job_resumes_only_on_the_world_size_that_wrote_it(tmp_path, monkeypatch):
    nw, seen = build(tmp_path, "own sampler in a DataLoader")
    run(nw, seen, 2)
    # The checkpoint as if 2 ranks had written it: its per-rank sampler states are not this rank's.
    real = resume.choose_checkpoint
    monkeypatch.setattr(resume, "choose_checkpoint",
                        lambda *args, **kwargs: dataclasses.replace(real(*args, **kwargs), world_size=2))
    with pytest.raises(StopTraining) as stopped:
        build(tmp_path, "own sampler in a DataLoader")
    assert stopped.value.code == EXIT_RESUME_REFUSED
    assert "written by 2 ranks" in stopped.value.reason
