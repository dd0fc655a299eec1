"""Replicas: verified checkpoints are copied and verified again; a bad primary restores from its replica."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import services
from checkpoints.choices import CheckpointState, ReplicaState
from checkpoints.models import Checkpoint
from jobs.checkpointing import commit_checkpoint
from jobs.models import Event, Generation, Job
from nodes.models import NodeCommand
from tests.checkpoints.conftest import REPO, commit_for, crash_and_restart, flip_byte, register


@pytest.fixture
def replicated(ckjob, tmp_path):
    """ckjob with a replica directory in its policy."""
    Job.objects.filter(pk=ckjob.pk).update(
        checkpoint_policy={**ckjob.checkpoint_policy, "replica_dir": str(tmp_path / "replica")})
    ckjob.refresh_from_db()
    return ckjob


def _replicate_all(job, runs, steps=(2, 4, 6)):
    checkpoints = []
    for step in steps:
        checkpoint = services.replicate(register(job, runs.path("A", step)))
        assert checkpoint.replica_state == ReplicaState.VERIFIED, checkpoint.replica_reason
        checkpoints.append(checkpoint)
    return checkpoints


@pytest.mark.django_db
def test_a_verified_checkpoint_is_copied_atomically_and_the_copy_verified(replicated, runs, tmp_path,
                                                                           django_capture_on_commit_callbacks):
    from checkpoints.services.verification import verify

    checkpoint, _ = commit_checkpoint(replicated, commit_for(replicated, runs.path("A", 6), generation=1),
                                           actor="t")
    with django_capture_on_commit_callbacks() as callbacks:
        checkpoint = verify(checkpoint)
    # Replication queued once verified (other apps may add callbacks of their own to the commit).
    assert [c.__qualname__ for c in callbacks].count("enqueue_replication.<locals>.enqueue") == 1
    checkpoint = services.replicate(checkpoint)
    replica = tmp_path / "replica" / runs.path("A", 6).name
    assert (checkpoint.replica_state, checkpoint.replica_location) == (ReplicaState.VERIFIED, str(replica))
    assert sorted(p.name for p in replica.iterdir()) == sorted(p.name for p in runs.path("A", 6).iterdir())
    assert not list(replica.parent.glob("*.copying"))  # the temporary copy was renamed into place
    event = Event.objects.get(job=replicated, kind="checkpoint.replica")
    assert (event.old_state, event.new_state) == ("replica:copying", "replica:verified")
    assert services.replicate(checkpoint).replica_state == ReplicaState.VERIFIED  # twice is harmless
    assert Event.objects.filter(job=replicated, kind="checkpoint.replica").count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("harm", ["flipped byte", "primary storage gone"])
def test_a_corrupt_or_missing_primary_restores_from_the_replica(replicated, runs, harm):
    a2, a4, a6 = _replicate_all(replicated, runs)
    primary = runs.path("A", 6)
    if harm == "flipped byte":
        flip_byte(primary / "__0_0.distcp")
    else:
        shutil.rmtree(primary)

    crash_and_restart(replicated)

    generation = Generation.objects.get(job=replicated, number=2)
    assert generation.resumed_from == a6  # the same checkpoint, not the older A/4
    (launch,) = NodeCommand.objects.filter(kind="launch", generation=2)
    assert launch.payload["resume_from"] == a6.replica_location
    a6.refresh_from_db()
    assert a6.state == CheckpointState.CORRUPT
    assert a6.location == str(primary)  # the registry still names the primary
    event = Event.objects.get(job=replicated, kind="checkpoint.restore_from_replica")
    assert f"primary copy at {a6.location} is corrupt" in event.reason
    assert f"restoring from the replica at {a6.replica_location}" in event.reason
    assert ("sha256" if harm == "flipped byte" else "the checkpoint directory does not exist") in event.reason


@pytest.mark.django_db
def test_the_hooks_resume_from_the_replica_they_are_given(replicated, runs, tmp_path):
    *_, a6 = _replicate_all(replicated, runs)
    flip_byte(runs.path("A", 6) / "__0_0.distcp")
    served = services.restore_point(replicated)
    assert served.pk == a6.pk and served.location == a6.replica_location
    with pytest.raises(ValueError, match="re-fetch it to save"):
        served.save()
    # What the launched generation does with it: the example job, told to resume from that path.
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTWATCH_")}
    environment.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NIGHTWATCH_GENERATION": "2",
                        "NIGHTWATCH_RESUME_FROM": served.location, "NIGHTWATCH_SPOOL_DIR": str(tmp_path / "spool")})
    done = subprocess.run([sys.executable, "-m", "examples.train", "--steps", "8", "--ckpt-every", "2",
                           "--dataset-size", "256", "--ckpt-dir", str(tmp_path / "gen2")],
                          cwd=REPO, env=environment, capture_output=True, text=True, timeout=120, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert f"resumed from step 6 (checkpoint {served.location})" in output


@pytest.mark.django_db
def test_when_the_replica_is_bad_too_the_previous_checkpoint_is_used(replicated, runs):
    a2, a4, a6 = _replicate_all(replicated, runs)
    flip_byte(runs.path("A", 6) / "__0_0.distcp")
    (Path(a6.replica_location) / "COMMITTED").unlink()
    assert services.restore_point(replicated) == a4
    a6.refresh_from_db()
    assert (a6.state, a6.replica_state) == (CheckpointState.CORRUPT, ReplicaState.CORRUPT)
    assert "no commit marker" in a6.replica_reason


@pytest.mark.django_db
def test_a_copy_that_fails_verification_is_corrupt_and_the_source_rechecked(replicated, runs, monkeypatch):
    from checkpoints import disk

    a6 = register(replicated, runs.path("A", 6))
    real_copy = disk.copy_checkpoint

    def copy_then_rot(source, *roots_and_target):  # the source rotted: what arrives does not match the manifest
        flip_byte(Path(source) / "__0_0.distcp")
        real_copy(source, *roots_and_target)

    monkeypatch.setattr(disk, "copy_checkpoint", copy_then_rot)
    a6 = services.replicate(a6)
    assert (a6.replica_state, a6.state) == (ReplicaState.CORRUPT, CheckpointState.CORRUPT)
    assert "sha256" in a6.replica_reason and "sha256" in a6.state_reason


@pytest.mark.django_db
def test_the_setting_gives_every_job_a_replica_and_the_sweep_catches_up(ckjob, runs, tmp_path, settings,
                                                                         eager_celery):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "CHECKPOINT_REPLICA_ROOT": str(tmp_path / "mirror")}
    checkpoints = [register(ckjob, runs.path("A", step)) for step in (2, 4)]  # on-commit copies never ran
    assert services.replica_sweep() == 2
    for checkpoint in checkpoints:
        checkpoint.refresh_from_db()
        assert checkpoint.replica_state == ReplicaState.VERIFIED
        expected = tmp_path / "mirror" / f"job-{ckjob.pk}" / Path(checkpoint.location).name
        assert checkpoint.replica_location == str(expected)
    assert services.replica_sweep() == 0


@pytest.mark.django_db
def test_deleting_a_checkpoint_removes_its_replica_too(replicated, runs):
    a2, a4, a6 = _replicate_all(replicated, runs)
    services.delete_checkpoint(a2, actor="user:otto", reason="space")
    a2.refresh_from_db()
    assert (a2.state, a2.replica_state) == (CheckpointState.DELETED, ReplicaState.DELETED)
    assert not Path(a2.location).exists() and not Path(a2.replica_location).exists()
    assert Checkpoint.objects.get(pk=a4.pk).replica_state == ReplicaState.VERIFIED


@pytest.mark.django_db
def test_a_checkpoint_deleted_while_its_copy_runs_leaves_no_orphan_replica(replicated, runs, monkeypatch):
    from checkpoints import disk

    a2 = register(replicated, runs.path("A", 2))
    register(replicated, runs.path("A", 4))  # so that A/2 is not the latest verified (protected)
    real_copy = disk.copy_checkpoint

    def delete_meanwhile(source, *roots_and_target):
        services.delete_checkpoint(Checkpoint.objects.get(pk=a2.pk), actor="user:otto", reason="space")
        Path(source).mkdir(parents=True)  # the deletion took the source; copy an empty stand-in
        (Path(source) / "COMMITTED").write_text("{}")
        (Path(source) / "manifest.json").write_text('{"files": []}')
        real_copy(source, *roots_and_target)

    monkeypatch.setattr(disk, "copy_checkpoint", delete_meanwhile)
    replica = Path(services.replica_location_for(a2))
    result = services.replicate(a2)
    assert result.state == CheckpointState.DELETED
    assert not replica.exists()
