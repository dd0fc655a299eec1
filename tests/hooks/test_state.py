"""agents.hooks.state: what a checkpoint holds, and that putting it back restores every part."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from agents.hooks import state
from agents.hooks.checkpointer import Checkpointer, load_checkpoint
from agents.hooks.topology import Topology

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def training_objects(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps):
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def draws():
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_rank_local_state_gets_a_rank_specific_key():
    model, optimizer, scheduler = training_objects()
    snapshot = state.collect_state(model, optimizer, scheduler=scheduler, scaler=None,
                                   progress=state.Progress(step=3), rank=5)
    assert "rng.rank5" in snapshot and "rng" not in snapshot
    assert state.saved_parts(set(snapshot)) == ["model", "optim", "progress", "rng", "scheduler"]


def test_a_restored_checkpoint_continues_exactly_like_the_uninterrupted_run(tmp_path):
    model, optimizer, scheduler = training_objects()
    train(model, optimizer, scheduler, 3)
    scheduler_at_save = scheduler.state_dict()
    random.seed(1)
    np.random.seed(2)
    progress = state.Progress(step=3, data_cursor=12, world_size=1)
    checkpointer = Checkpointer(tmp_path, Topology(), generation=0, run_id="aa", use_async=False)
    checkpointer.save(3, state.collect_state(model, optimizer, scheduler=scheduler, scaler=None,
                                             progress=progress, rank=0),
                      {"config_hash": "x", "world_size": 1, "data_cursor": 12, "parts": []})
    path = checkpointer.wait().path
    checkpointer.close()
    train(model, optimizer, scheduler, 2)
    expected_draws, expected_weights = draws(), [p.clone() for p in model.parameters()]

    fresh, fresh_optimizer, fresh_scheduler = training_objects(seed=99)  # different weights, no Adam state
    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    target = state.load_target(fresh, fresh_optimizer, saved_keys=keys, rank=0)
    load_checkpoint(path, target, Topology())
    restored_progress, parts = state.apply_state(target, fresh, fresh_optimizer, scheduler=fresh_scheduler,
                                                 scaler=None, rank=0)
    assert restored_progress == progress
    assert parts == ["model", "optim", "scheduler", "rng"]
    assert fresh_scheduler.state_dict() == scheduler_at_save
    train(fresh, fresh_optimizer, fresh_scheduler, 2)
    assert draws() == expected_draws  # python, numpy and torch RNG all continued where they were
    assert all(torch.equal(a, b) for a, b in zip(expected_weights, fresh.parameters(), strict=True))


def test_a_rank_that_did_not_exist_when_saving_asks_for_no_rng():
    model, optimizer, _ = training_objects()
    target = state.load_target(model, optimizer, saved_keys={"progress", "rng.rank0", "rng.rank1"}, rank=2)
    assert "rng.rank2" not in target and "progress" in target and "scheduler" not in target
