"""Verification on real checkpoints: each kind of damage is caught with its own reason, restores skip
what fails, and the node-side load test catches what hashes cannot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from checkpoints import services
from checkpoints.choices import CheckpointState
from jobs.models import Event
from tests.checkpoints.conftest import build_checkpoint, flip_byte, register


def _replace_with(directory: Path, source: Path) -> None:
    shutil.rmtree(directory)
    shutil.copytree(source, directory)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "flipped byte": (lambda ck, runs: flip_byte(ck / "__0_0.distcp"),
                     "__0_0.distcp does not match its sha256 (corrupted)"),
    "missing shard": (lambda ck, runs: (ck / "__0_0.distcp").unlink(), "missing file __0_0.distcp"),
    "truncated manifest": (lambda ck, runs: _truncate(ck / "manifest.json"),
                           "manifest.json does not match its commit marker (truncated or rewritten)"),
    "no commit marker": (lambda ck, runs: (ck / "COMMITTED").unlink(), "no commit marker: the save never finished"),
    "foreign config": (lambda ck, runs: _replace_with(ck, runs.path("F", 2)), "(incompatible configuration)"),
    "another step's checkpoint": (lambda ck, runs: _replace_with(ck, runs.path("A", 4)),
                                  "the manifest on disk is for step 4, the registry recorded step 6"),
    "missing required part": (lambda ck, runs: _rewrite_without_scheduler(ck),
                              "missing required state parts: scheduler (LR scheduler)"),
}


def _rewrite_without_scheduler(directory: Path) -> None:
    """The same step, config and data cursor, committed by a script that forgot its LR scheduler."""
    config_hash = json.loads((directory / "manifest.json").read_text())["config_hash"]
    shutil.rmtree(directory)
    build_checkpoint(directory, step=6, data_cursor=24, scheduler=False, config_hash=config_hash)


@pytest.mark.django_db
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_each_kind_of_damage_is_detected_with_its_reason_and_never_restored(ckjob, runs, damage):
    a4 = register(ckjob, runs.path("A", 4))
    a6 = register(ckjob, runs.path("A", 6))
    assert a6.state == CheckpointState.VERIFIED and a6.data_cursor == 24
    harm, reason = DAMAGE[damage]
    harm(runs.path("A", 6), runs)

    assert services.restore_point(ckjob) == a4  # re-verified before restoring: the damaged one is skipped
    a6.refresh_from_db()
    assert a6.state == CheckpointState.CORRUPT
    assert reason in a6.state_reason
    event = Event.objects.filter(job=ckjob, kind="checkpoint.verify", new_state="corrupt").get()
    assert (event.old_state, event.actor, event.evidence["checkpoint"]) == ("verified", "system:restore", a6.pk)


@pytest.mark.django_db
@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"scheduler": False}, "missing required state parts: scheduler (LR scheduler)"),
    ({"amp": True}, "missing required state parts: scaler (AMP grad scaler)"),
    ({"world_size": 2}, "RNG state of ranks [1] is missing (world size 2)"),
    ({"parts": ["model", "optim", "progress", "rng", "scheduler", "scaler"]},
     "the manifest lists parts ['scaler'] that DCP's metadata does not contain"),
])
def test_every_required_state_part_must_be_present(ckjob, tmp_path, kwargs, reason):
    from checkpoints.models import Checkpoint

    path = build_checkpoint(tmp_path / "step-00000010-g1-abc", step=10, data_cursor=40, config_hash="c0ffee", **kwargs)
    checkpoint = Checkpoint.objects.create(job=ckjob, step=10, data_cursor=40, config_hash="c0ffee", location=str(path))
    verified = services.verify(checkpoint)
    assert verified.state == CheckpointState.CORRUPT and reason in verified.state_reason


@pytest.mark.django_db
def test_a_complete_checkpoint_built_the_same_way_verifies(ckjob, tmp_path):
    from checkpoints.models import Checkpoint

    path = build_checkpoint(tmp_path / "step-00000010-g1-abc", step=10, data_cursor=40, config_hash="c0ffee")
    checkpoint = Checkpoint.objects.create(job=ckjob, step=10, data_cursor=40, config_hash="c0ffee", location=str(path))
    verified = services.verify(checkpoint)
    assert (verified.state, verified.state_reason) == (CheckpointState.VERIFIED, "")


def test_the_node_side_load_test_loads_a_real_checkpoint_on_cpu(runs):
    from agents.hooks.loadtest import load

    verdict = load(str(runs.path("A", 6)), step=6, data_cursor=24)
    assert verdict["ok"] and verdict["tensors"] > 0


@pytest.mark.django_db
def test_the_node_side_load_test_catches_what_hashing_cannot(ckjob, tmp_path):
    """The control plane's verdict rests on hashes; only the load test, run on a node, unpickles."""
    from agents.hooks.loadtest import load
    from checkpoints.models import Checkpoint

    # Committed whole, every hash right, every part listed: but the progress blob is not a pickle.
    path = build_checkpoint(tmp_path / "step-00000010-g1-abc", step=10, data_cursor=40, config_hash="c0ffee",
                            progress_blob=b"this is not a torch.save blob")
    checkpoint = Checkpoint.objects.create(job=ckjob, step=10, data_cursor=40, config_hash="c0ffee", location=str(path))
    assert services.verify(checkpoint).state == CheckpointState.VERIFIED
    assert load(str(path))["reason"].startswith("load test: the progress part does not unpickle")


@pytest.mark.django_db
def test_a_corrupt_checkpoint_that_reads_fine_again_is_verified_again(ckjob, runs):
    checkpoint = register(ckjob, runs.path("A", 6))
    marker = runs.path("A", 6) / "COMMITTED"
    saved = marker.read_bytes()
    marker.unlink()  # e.g. a storage mount that was briefly gone
    assert services.verify(checkpoint).state == CheckpointState.CORRUPT
    marker.write_bytes(saved)
    assert services.verify(checkpoint).state == CheckpointState.VERIFIED
    transitions = list(Event.objects.filter(job=ckjob, kind="checkpoint.verify").values_list("old_state", "new_state"))
    assert transitions == [("committed", "verified"), ("verified", "corrupt"), ("corrupt", "verified")]
