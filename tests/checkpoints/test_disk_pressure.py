"""Retention frees a full disk (issue 24, item 3): torn save directories are removed, and under disk
pressure the oldest unprotected checkpoints go first, then the permanent ones retention promoted
itself (never one an operator pinned), each said in an event."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from agents.hooks.manifest import MARKER, checkpoint_dirname
from checkpoints import disk, services
from checkpoints.models import Checkpoint
from checkpoints.services.retention import RETENTION_ACTOR
from checkpoints.services.torn import TORN_IDLE_S, find_torn_saves
from core.events import EventKind
from jobs.models import Event, Job

MB = 2**20


def save_dir(root: Path, step: int, generation: int, *, committed: bool, files=("__0_0.distcp",)) -> Path:
    path = root / checkpoint_dirname(step, generation, "ab12cd")
    path.mkdir()
    for name in files:
        (path / name).write_bytes(b"x" * 1000)
    if committed:
        (path / "manifest.json").write_text("{}")
        (path / MARKER).write_text("sha")
    return path


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    for item in [path, *path.iterdir()]:
        os.utime(item, (then, then))


@pytest.mark.django_db
def test_torn_saves_are_removed_and_nothing_else(ckjob, tmp_path):
    Job.objects.filter(pk=ckjob.pk).update(generation=2)
    ckjob.refresh_from_db()
    old_generation = save_dir(tmp_path, 30, 1, committed=False, files=("__0_0.distcp", "TORN-rank1"))
    in_flight = save_dir(tmp_path, 40, 2, committed=False)
    abandoned = save_dir(tmp_path, 50, 2, committed=False)
    age(abandoned, TORN_IDLE_S + 60)
    unreported = save_dir(tmp_path, 20, 1, committed=True)  # its commit report may still be in a spool
    registered = save_dir(tmp_path, 10, 1, committed=True)
    Checkpoint.objects.create(job=ckjob, step=10, location=str(registered), state="verified", size_bytes=1000)
    leftover = tmp_path / f"{checkpoint_dirname(5, 1, 'ab12cd')}.0123abcd{disk.TRASH_SUFFIX}"
    leftover.mkdir()
    (tmp_path / "step-00000060-g1-ff").symlink_to(abandoned)  # never followed

    assert {Path(t.location).name for t in find_torn_saves(ckjob)} == {old_generation.name, abandoned.name,
                                                                       leftover.name}
    plan = services.apply_retention(ckjob)
    assert {Path(t.location).name for t in plan.torn} == {old_generation.name, abandoned.name, leftover.name}
    assert not old_generation.exists() and not abandoned.exists() and not leftover.exists()
    assert in_flight.exists() and unreported.exists() and registered.exists()
    events = Event.objects.filter(job=ckjob, kind=EventKind.STORAGE_TORN_REMOVED)
    assert events.count() == 3
    assert any("written by generation 1, which ended" in e.reason and e.evidence["size_bytes"] == 2000
               for e in events)


def test_removal_refuses_a_committed_directory_or_a_stranger(tmp_path):
    committed = save_dir(tmp_path, 10, 1, committed=True)
    with pytest.raises(disk.UnsafePath, match="COMMITTED"):
        disk.remove_torn_dir(str(committed), [str(tmp_path)])
    stranger = tmp_path / "data"
    stranger.mkdir()
    with pytest.raises(disk.UnsafePath, match="not named as a checkpoint save"):
        disk.remove_torn_dir(str(stranger), [str(tmp_path)])
    with pytest.raises(disk.UnsafePath):
        disk.remove_torn_dir("/etc/step-00000001-g1-aa", [str(tmp_path)])
    assert committed.exists() and stranger.exists()


def checkpoints(job, root: Path, count: int, *, size=2 * MB) -> list[Checkpoint]:
    """``count`` verified checkpoints, an hour apart (the first one permanent by retention's own
    promotion, as a sweep would have made it)."""
    rows = []
    start = timezone.now() - timedelta(hours=count)
    for n in range(1, count + 1):
        path = save_dir(root, 10 * n, 1, committed=True)
        rows.append(Checkpoint.objects.create(job=job, step=10 * n, location=str(path), state="verified",
                                              size_bytes=size, created_at=start + timedelta(hours=n)))
    services.apply_retention(job)  # promotes the first (and deletes nothing: free space is plenty here)
    for row in rows:
        row.refresh_from_db()
    assert rows[0].permanent
    return rows


def live_steps(job) -> list[int]:
    return sorted(Checkpoint.objects.filter(job=job).live().values_list("step", flat=True))


@pytest.mark.django_db
def test_under_pressure_the_oldest_unprotected_go_first_until_the_target_is_reached(ckjob, tmp_path, monkeypatch):
    checkpoints(ckjob, tmp_path, 6)  # steps 10 (permanent) … 60; keep_last 3 keeps 40, 50, 60
    assert live_steps(ckjob) == [10, 40, 50, 60]
    # 3 MiB free of 100: below the 5 % target (5 MiB); one more deletion (2 MiB) reaches it.
    monkeypatch.setattr(disk, "free_space", lambda directory: (3 * MB, 100 * MB))
    plan = services.apply_retention(ckjob)
    assert plan.pressure.under and plan.pressure.target_bytes == 5 * MB
    assert live_steps(ckjob) == [10, 50, 60]  # 40 went: the oldest ordinary one; the permanent one stays
    event = Event.objects.get(job=ckjob, kind=EventKind.STORAGE_PRESSURE)
    assert event.evidence["deleted"] == [d.checkpoint for d in plan.delete]
    assert "oldest unprotected first (step 40)" in event.reason and not event.evidence["still_short"]


@pytest.mark.django_db
def test_a_failed_save_for_want_of_space_releases_retentions_own_permanent_ones_but_never_a_pin(
        ckjob, tmp_path, monkeypatch):
    rows = checkpoints(ckjob, tmp_path, 5)  # 10 (permanent by retention), 30, 40, 50 live
    services.pin(rows[2], actor="user:otto", reason="best eval")  # an operator's promise: never released
    monkeypatch.setattr(disk, "free_space", lambda directory: (50 * MB, 100 * MB))  # looks fine: a quota is full
    plan = services.apply_retention(ckjob, out_of_space=True)
    # Needed: 5 MiB. 40 (ordinary), then 10 (retention's own permanent); 30 pinned, 50 the newest.
    assert live_steps(ckjob) == [30, 50]
    event = Event.objects.get(job=ckjob, kind=EventKind.STORAGE_PRESSURE)
    assert event.evidence["released_permanent"] == [rows[0].pk] and event.evidence["out_of_space"]
    assert Event.objects.filter(job=ckjob, kind=EventKind.CHECKPOINT_UNPIN, actor=RETENTION_ACTOR).count() == 1
    assert any("permanent by retention's own promotion" in d.reason for d in plan.delete)


@pytest.mark.django_db
def test_the_policy_may_keep_permanent_ones_whatever_the_pressure(ckjob, tmp_path, monkeypatch):
    Job.objects.filter(pk=ckjob.pk).update(checkpoint_policy={**ckjob.checkpoint_policy,
                                                              "release_permanent_under_pressure": False})
    ckjob.refresh_from_db()
    checkpoints(ckjob, tmp_path, 4)
    monkeypatch.setattr(disk, "free_space", lambda directory: (0, 100 * MB))
    services.apply_retention(ckjob)
    assert live_steps(ckjob) == [10, 40]  # the newest and the permanent one
    assert Event.objects.get(job=ckjob, kind=EventKind.STORAGE_PRESSURE).evidence["still_short"] is True


@pytest.mark.django_db
def test_a_dry_run_shows_the_pressure_and_changes_nothing(ckjob, tmp_path, monkeypatch):
    checkpoints(ckjob, tmp_path, 4)
    torn = save_dir(tmp_path, 45, 0, committed=False)
    monkeypatch.setattr(disk, "free_space", lambda directory: (0, 100 * MB))
    plan = services.apply_retention(ckjob, dry_run=True)
    assert plan.pressure.under and plan.delete and [Path(t.location) for t in plan.torn] == [torn]
    assert torn.exists() and live_steps(ckjob) == [10, 20, 30, 40]
    assert not Event.objects.filter(job=ckjob, kind=EventKind.STORAGE_PRESSURE).exists()
