"""agents.hooks.staging: background staging copies a consistent state, or refuses to let it commit."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from agents.hooks.checkpointer import Checkpointer
from agents.hooks.staging import TORN_PREFIX, OverlappedStager, stable_tensors
from agents.hooks.topology import Topology

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def sample_state():
    weight, running_mean = torch.arange(6.0), torch.zeros(3)
    return weight, running_mean, {"model": {"weight": weight, "running_mean": running_mean}, "blob": b"progress"}


def hold(stager: OverlappedStager) -> threading.Event:
    """Keep the stager's copy thread busy until the returned event is set."""
    release = threading.Event()
    stager._copier.submit(release.wait, 10)
    return release


def test_stable_tensors_are_copied_in_the_background_and_the_rest_at_once(tmp_path):
    weight, running_mean, state = sample_state()
    stager = OverlappedStager()
    stager.prepare(tmp_path, frozenset({weight.data_ptr()}))
    release = hold(stager)
    staged = stager.stage(state)
    assert isinstance(staged, Future) and not staged.done()
    running_mean.add_(1.0)  # what a forward pass does to BatchNorm statistics: already staged, unaffected
    release.set()
    stager.ready()
    copy = staged.result()
    assert torch.equal(copy["model"]["weight"], torch.arange(6.0))
    assert torch.equal(copy["model"]["running_mean"], torch.zeros(3))
    assert copy["blob"] == b"progress"
    weight.mul_(2)  # the optimizer step, after ready(): the staged copy keeps the saved values
    assert torch.equal(copy["model"]["weight"], torch.arange(6.0))
    assert not list(tmp_path.glob(f"{TORN_PREFIX}*"))


def test_buffers_are_reused_from_one_save_to_the_next(tmp_path):
    weight, _, state = sample_state()
    stager = OverlappedStager()
    stager.prepare(tmp_path, frozenset({weight.data_ptr()}))
    first = stager.stage(state).result()
    weight.add_(1.0)
    second = stager.stage(state).result()
    assert second["model"]["weight"] is first["model"]["weight"]
    assert torch.equal(second["model"]["weight"], torch.arange(6.0) + 1)


def test_an_in_place_change_during_the_copy_marks_the_checkpoint_torn_and_stops_overlapping(tmp_path):
    weight, _, state = sample_state()
    stager = OverlappedStager(rank=3)
    stager.prepare(tmp_path, frozenset({weight.data_ptr()}))
    release = hold(stager)
    staged = stager.stage(state)
    weight.add_(100.0)  # a training script editing a parameter outside nw.step()
    release.set()
    staged.result()  # returns normally: other ranks must not be left waiting in DCP's collectives
    assert (tmp_path / f"{TORN_PREFIX}3").exists()
    assert not stager.overlap
    assert not isinstance(stager.stage(state), Future)  # from now on everything is copied up front


def test_a_torn_checkpoint_is_never_committed_and_its_files_are_removed(tmp_path):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    failures = []
    checkpointer = Checkpointer(tmp_path, Topology(), generation=0, run_id="aa",
                                on_failure=lambda path, step, error: failures.append(str(error)))
    release = hold(checkpointer._stager)
    state = {"model": {name: p.detach() for name, p in model.named_parameters()}}
    checkpointer.save(1, state, {"config_hash": "x", "world_size": 1, "data_cursor": 0, "parts": ["model"]},
                      stable=stable_tensors(model, optimizer))
    with torch.no_grad():
        model.weight.zero_()
    release.set()
    assert checkpointer.wait() is None
    checkpointer.close()
    assert failures and "changed while it was being staged" in failures[0]
    assert not list(tmp_path.glob("step-*"))  # rank 0 removed the failed save (issue 24: disk space)
