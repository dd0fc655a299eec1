"""Retention over a simulated week of real checkpoints, with frozen time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import time_machine

from agents.hooks.manifest import checkpoint_dirname
from checkpoints import services
from checkpoints.choices import CheckpointState
from checkpoints.models import Checkpoint
from jobs.checkpointing import commit_checkpoint
from jobs.models import Event, Generation, Job
from tests.checkpoints.conftest import commit_for, crash_and_restart, recommit, register

START = datetime(2026, 3, 2, tzinfo=UTC)
COMMITS = 7 * 48  # every 30 minutes for a week
CRASH_AFTER = 150  # gpu-01 dies after the 150th commit; generation 2 resumes from it
PIN_AFTER = 240  # an operator pins the 239th commit (made permanent by hand)


def _expected_kept() -> set[int]:
    """Commit numbers the policy keeps at the end (keep_last 3, permanent every 12 h).

    Permanent: the first commit (00:30), then every 24 commits (12 h) — 1, 25, …, 217 — until the
    operator's pin of 239 restarts the 12 h count: 263, 287, 311, 335. The last three: 334-336.
    Protected: 150, which live generation 2 resumed from (336, the latest verified, is also recent).
    """
    auto = {1 + 24 * k for k in range(10)} | {239 + 24 * k for k in range(1, 5)}
    return auto | {239} | {334, 335, 336} | {CRASH_AFTER}


def _simulate_week(job, source: Path, directory: Path, *, sweep_every: int):
    """Commit, verify and (every ``sweep_every`` commits) apply retention, one commit per 30 minutes.

    After each sweep, checks that no plan ever chose to delete a protected checkpoint.
    """
    by_number: dict[int, Checkpoint] = {}
    with time_machine.travel(START, tick=False) as clock:
        services.apply_retention(job)  # nothing yet: a no-op
        for number in range(1, COMMITS + 1):
            clock.shift(timedelta(minutes=30))
            path = recommit(source, directory / checkpoint_dirname(100 * number, job.generation, "week"),
                            step=100 * number, generation=job.generation)
            by_number[number] = register(job, path)
            if number == CRASH_AFTER:
                crash_and_restart(job)
                assert Generation.objects.get(job=job, number=2).resumed_from == by_number[CRASH_AFTER]
            if number == PIN_AFTER:
                services.pin(by_number[239], actor="user:otto", reason="good eval score")
            if number % sweep_every == 0:
                plan = services.apply_retention(job)
                protected = {by_number[number].pk}  # the latest verified one
                protected |= set(Checkpoint.objects.filter(job=job, permanent=True).values_list("pk", flat=True))
                if number >= CRASH_AFTER:
                    protected.add(by_number[CRASH_AFTER].pk)
                assert not protected & {d.checkpoint for d in plan.delete}
    return by_number


@pytest.mark.django_db
@pytest.mark.parametrize("sweep_every", [1, COMMITS], ids=["sweep-after-every-commit", "one-sweep-at-the-end"])
def test_a_week_of_half_hourly_commits_keeps_exactly_what_the_policy_says(ckjob, runs, tmp_path, sweep_every):
    by_number = _simulate_week(ckjob, runs.path("A", 2), tmp_path / "week", sweep_every=sweep_every)

    kept = {n for n, c in by_number.items() if Checkpoint.objects.get(pk=c.pk).state != CheckpointState.DELETED}
    assert kept == _expected_kept()
    for number, checkpoint in by_number.items():  # deleting removes the directory; keeping leaves it whole
        assert Path(checkpoint.location).is_dir() == (number in kept), number
    assert Event.objects.filter(job=ckjob, kind="checkpoint.delete").count() == COMMITS - len(kept)
    auto = {1 + 24 * k for k in range(10)} | {263, 287, 311, 335}
    promoted = set(Event.objects.filter(job=ckjob, kind="checkpoint.pin", actor="system:retention")
                   .values_list("evidence__checkpoint", flat=True))
    assert promoted == {by_number[n].pk for n in auto}

    # The plan explains each survivor; a second run right away changes nothing.
    plan = services.apply_retention(ckjob, dry_run=True)
    reasons = {d.checkpoint: d.reason for d in plan.keep}
    assert "active generation 2 resumed from it" in reasons[by_number[CRASH_AFTER].pk]
    assert reasons[by_number[336].pk] == "protected: it is the latest verified checkpoint of the active branch " \
                                         "(the next restore point)"
    assert reasons[by_number[334].pk] == "one of the last 3 verified"
    assert reasons[by_number[239].pk] == "permanent"
    assert plan.delete == []
    assert plan.storage.checkpoints == len(kept)
    assert plan.storage.primary_bytes == sum(by_number[n].size_bytes for n in kept)


@pytest.mark.django_db
def test_a_dry_run_lists_what_would_go_and_why_and_changes_nothing(ckjob, runs):
    Job.objects.filter(pk=ckjob.pk).update(checkpoint_policy={**ckjob.checkpoint_policy, "keep_last": 1,
                                                               "permanent_every_hours": 0})
    ckjob.refresh_from_db()
    checkpoints = [register(ckjob, runs.path("A", step)) for step in (2, 4, 6)]
    plan = services.apply_retention(ckjob, dry_run=True)
    assert [(d.step, d.keep) for d in plan.decisions] == [(2, False), (4, False), (6, True)]
    assert plan.delete[0].reason == "verified, older than the last 1 verified, not permanent"
    assert plan.freed_bytes == checkpoints[0].size_bytes + checkpoints[1].size_bytes
    assert all(Path(c.location).is_dir() for c in checkpoints)
    assert not Checkpoint.objects.filter(job=ckjob, state=CheckpointState.DELETED).exists()
    assert not Event.objects.filter(job=ckjob, kind="checkpoint.delete").exists()


@pytest.mark.django_db
def test_corrupt_and_unverified_checkpoints(ckjob, runs):
    """A corrupt one is kept while recent (a re-check may pass it), deleted once older than the window;
    one whose verdict is not in yet is never deleted."""
    Job.objects.filter(pk=ckjob.pk).update(checkpoint_policy={**ckjob.checkpoint_policy, "keep_last": 1,
                                                               "permanent_every_hours": 0})
    ckjob.refresh_from_db()
    a2, a4 = register(ckjob, runs.path("A", 2)), register(ckjob, runs.path("A", 4))
    Checkpoint.objects.filter(pk=a4.pk).update(state=CheckpointState.CORRUPT, state_reason="flipped byte")
    pending, _ = commit_checkpoint(ckjob, commit_for(ckjob, runs.path("A", 6), generation=1), actor="t")
    decisions = {d.step: d for d in services.apply_retention(ckjob, dry_run=True).decisions}
    assert decisions[4].keep and decisions[4].reason.startswith("corrupt (flipped byte) but recent")
    assert decisions[6].keep and decisions[6].reason == "not verified yet"
    assert decisions[2].keep and "latest verified" in decisions[2].reason

    services.verify(pending)  # now A/6 is the only one of the last 1 verified: the others fall out
    plan = services.apply_retention(ckjob)
    assert {d.step: d.keep for d in plan.decisions} == {2: False, 4: False, 6: True}
    assert {d.step: d.reason for d in plan.delete}[4] == "corrupt (flipped byte) and older than the last 1 verified"
    assert not Path(a2.location).exists() and not Path(a4.location).exists()


@pytest.mark.django_db
def test_the_sweep_covers_every_job_and_finishes_failed_removals(ckjob, runs, monkeypatch):
    from checkpoints import disk

    Job.objects.filter(pk=ckjob.pk).update(checkpoint_policy={**ckjob.checkpoint_policy, "keep_last": 1,
                                                               "permanent_every_hours": 0})
    ckjob.refresh_from_db()
    a2 = register(ckjob, runs.path("A", 2))
    register(ckjob, runs.path("A", 4))
    real_remove = disk.remove_checkpoint_dir

    def failing(location, roots):
        raise OSError("device busy")

    monkeypatch.setattr(disk, "remove_checkpoint_dir", failing)
    assert services.retention_sweep() == 1
    a2.refresh_from_db()
    assert a2.state == CheckpointState.DELETED and Path(a2.location).is_dir()  # registry right, files left
    assert Event.objects.filter(job=ckjob, kind="checkpoint.delete_failed").exists()
    monkeypatch.setattr(disk, "remove_checkpoint_dir", real_remove)
    assert services.retention_sweep() == 0  # nothing more to delete, but the leftovers go
    assert not Path(a2.location).exists()


@pytest.mark.django_db
def test_the_management_command_shows_the_plan_then_applies_it(ckjob, runs):
    from io import StringIO

    from django.core.management import call_command

    Job.objects.filter(pk=ckjob.pk).update(checkpoint_policy={**ckjob.checkpoint_policy, "keep_last": 1,
                                                               "permanent_every_hours": 0})
    a2, a4 = register(ckjob, runs.path("A", 2)), register(ckjob, runs.path("A", 4))
    out = StringIO()
    call_command("checkpoint_retention", "--job", str(ckjob.pk), "--dry-run", stdout=out)
    assert f"would delete 1 ({a2.size_bytes} bytes)" in out.getvalue()
    assert f"delete step 2 (#{a2.pk}): verified, older than the last 1 verified, not permanent" in out.getvalue()
    assert Path(a2.location).is_dir()
    call_command("checkpoint_retention", stdout=out)
    assert "retention sweep: 1 checkpoint(s) deleted" in out.getvalue()
    assert not Path(a2.location).exists() and Path(a4.location).is_dir()
