"""Snapshots in one process: the commit discipline, a tampered or torn shard refused with its
reason, lineage fencing, and retention (at most two committed, the oldest removed last)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import time

import pytest
import torch

from agents.hooks import snapshot, state
from agents.hooks.snapshot import Lineage, Snapshotter, choose_snapshot
from agents.hooks.snapshot_store import MARKER, OWN, SHARD, Refused, SnapshotStore, read_verified
from agents.hooks.staging import stable_tensors
from agents.hooks.topology import Topology

FIELDS = {"job": "j", "config_hash": "c0ffee", "world_size": 1, "data_cursor": 0, "base": ""}


def lineage(**changes):
    return Lineage(**{"job": "j", "config_hash": "c0ffee", "world_size": 1, "generation": 3,
                      "min_generation": 3, "after_step": 0, **changes})


def take(store, model, optimizer, steps, generation=3):
    snapshotter = Snapshotter(store, Topology(), None, generation=generation, run_id="ab12")
    for step in steps:
        model(torch.randn(2, 4)).sum().backward()
        snapshotter.before_update()
        optimizer.step()
        captured = state.collect_state(model, optimizer, scheduler=None, scaler=None,
                                       progress=state.Progress(step=step), rank=0)
        snapshotter.take(step, captured, FIELDS, stable=stable_tensors(model, optimizer))
    snapshotter.close()
    return snapshotter


@pytest.fixture
def trained(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    store = SnapshotStore(tmp_path, "job")
    take(store, model, optimizer, [1, 2, 3])
    return store, model, optimizer


def test_a_committed_snapshot_restores_the_state_taken(trained):
    store, model, optimizer = trained
    choice = choose_snapshot(store, Topology(), None, lineage())
    assert choice.key.step == 3 and not choice.rejected
    loaded = snapshot.load(choice.snapshot)
    assert torch.equal(loaded["model"]["weight"], model.weight)
    assert state.from_blob(loaded["progress"])["step"] == 3


def test_retention_keeps_the_two_newest_committed(trained):
    store, _, _ = trained
    assert [found.key.step for found in store.committed(store.place(0, OWN))] == [3, 2]


def test_a_tampered_shard_is_refused_and_the_one_before_restored(trained):
    store, _, _ = trained
    newest = store.committed(store.place(0, OWN))[0].path
    shard = bytearray((newest / SHARD).read_bytes())
    shard[len(shard) // 2] ^= 0xFF
    (newest / SHARD).write_bytes(bytes(shard))
    with pytest.raises(Refused, match="does not match its sha256"):
        read_verified(newest)
    choice = choose_snapshot(store, Topology(), None, lineage())
    assert choice.key.step == 2
    assert choice.rejected == [(str(newest), f"{SHARD} does not match its sha256 (corrupted)")]


def test_an_uncommitted_or_rewritten_snapshot_is_never_listed(trained):
    store, _, _ = trained
    newest, older = (found.path for found in store.committed(store.place(0, OWN)))
    (newest / MARKER).unlink()
    manifest = json.loads((older / "manifest.json").read_text())
    (older / "manifest.json").write_text(json.dumps({**manifest, "step": 9}))
    assert store.committed(store.place(0, OWN)) == []
    assert choose_snapshot(store, Topology(), None, lineage()).snapshot is None


@pytest.mark.parametrize(("changes", "reason"), [
    ({"min_generation": 4, "generation": 5}, "outside this lineage branch (4-5): fenced off"),
    ({"config_hash": "other"}, "this run is j with other"),
    ({"world_size": 2}, "taken by 1 ranks, this run has 2"),
])
def test_a_snapshot_outside_the_lineage_is_not_restored(trained, changes, reason):
    store, _, _ = trained
    choice = choose_snapshot(store, Topology(), None, lineage(**changes))
    assert choice.snapshot is None
    assert choice.rejected and all(reason in why for _, why in choice.rejected)


def test_only_a_snapshot_newer_than_the_disk_checkpoint_is_taken(trained):
    store, _, _ = trained
    assert choose_snapshot(store, Topology(), None, lineage(after_step=2)).key.step == 3
    choice = choose_snapshot(store, Topology(), None, lineage(after_step=3))
    assert choice.snapshot is None and choice.rejected == []


def _finish_repeatedly(root, rank, deadline):
    """One rank of a node finishing again and again: its directories made, then the empty ones removed."""
    store = SnapshotStore(root, "job")
    errors = []
    while time.monotonic() < deadline:
        for kind in ("own", "copy"):
            with contextlib.suppress(OSError):  # a parent (or itself) another rank removed just now
                store.place(rank, kind).mkdir(parents=True, exist_ok=True)
        try:
            store.remove_empty()
        except OSError as error:
            errors.append(repr(error))
    return errors


def test_ranks_finishing_together_remove_each_others_empty_directories_without_error(tmp_path):
    # Every rank of a node calls remove_empty as it finishes, and each sees (and may remove) the
    # others' directories: a directory gone between being listed and being read is not an error
    # (CI of 4628af3: rank 1's glob raised FileNotFoundError on a directory rank 0 had removed).
    deadline = time.monotonic() + 1.5
    with concurrent.futures.ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_finish_repeatedly, [tmp_path] * 4, range(4), [deadline] * 4))
    assert [error for errors in results for error in errors] == []
    SnapshotStore(tmp_path, "job").remove_empty()
    assert list(tmp_path.iterdir()) == []
