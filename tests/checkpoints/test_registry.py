"""The registry on real checkpoints: commits, the lineage tree across restarts and a rollback."""

from __future__ import annotations

import pytest

from checkpoints import services
from checkpoints.choices import CheckpointState
from checkpoints.models import Checkpoint
from jobs import services as job_services
from jobs import state
from jobs.checkpointing import commit_checkpoint
from jobs.choices import JobState
from jobs.models import Event, Generation
from tests.checkpoints.conftest import commit_for, crash_and_restart, flip_byte, register


@pytest.mark.django_db
def test_lineage_across_two_restarts_and_a_rollback(ckjob, runs):
    job = ckjob
    a2, a4, a6 = (register(job, runs.path("A", step)) for step in (2, 4, 6))
    assert {c.state for c in (a2, a4, a6)} == {CheckpointState.VERIFIED}

    crash_and_restart(job)  # restart 1: from the newest verified checkpoint
    assert Generation.objects.get(job=job, number=2).resumed_from == a6
    b8, b10 = (register(job, runs.path("B", step)) for step in (8, 10))

    flip_byte(runs.path("B", 10) / "__0_0.distcp")  # rots after it was verified
    crash_and_restart(job)  # restart 2: B/10 fails re-verification, so B/8
    assert Generation.objects.get(job=job, number=3).resumed_from == b8
    b10.refresh_from_db()
    assert b10.state == CheckpointState.CORRUPT and "sha256" in b10.state_reason
    c10, c12 = (register(job, runs.path("C", step)) for step in (10, 12))

    state.transition(job, JobState.PAUSED, actor="test", reason="loss spike")
    job_services.rollback_to(job, a4, actor="user:otto", reason="loss spike after step 10", force=True)
    job.refresh_from_db()
    assert (job.generation, job.branch_root, Generation.objects.get(job=job, number=4).resumed_from) == (4, a4, a4)
    d6, d8 = (register(job, runs.path("D", step)) for step in (6, 8))

    # Paths to the root follow resumptions, never step order.
    assert services.lineage(c12) == [c12, c10, b8, a6, a4, a2]
    assert services.lineage(d8) == [d8, d6, a4, a2]
    assert services.lineage(b10) == [b10, b8, a6, a4, a2]
    for leaf in (c12, d8, b10):  # each resumed run continued the same global sample sequence
        cursors = [c.data_cursor for c in reversed(services.lineage(leaf))]
        assert cursors == sorted(cursors) and len(set(cursors)) == len(cursors)

    # The rollback started a branch: only it counts for recovery now.
    assert set(services.active_branch(job)) == {a4, d6, d8}
    assert services.latest_verified_checkpoint(job) == d8
    assert services.restore_point(job) == d8

    tree = services.lineage_tree(job)
    assert (tree.latest_verified, tree.active_leaf) == (d8.pk, d8.pk)
    (root,) = tree.roots
    assert root.checkpoint == a2 and [n.checkpoint for n in root.children] == [a4]
    assert sorted(n.checkpoint.pk for n in root.children[0].children) == sorted([a6.pk, d6.pk])
    branches = {b.leaf: b for b in tree.branches}
    assert set(branches) == {b10.pk, c12.pk, d8.pk}
    assert branches[c12.pk].steps == [2, 4, 6, 8, 10, 12] and branches[c12.pk].generations == [1, 2, 3]
    assert branches[b10.pk].steps == [2, 4, 6, 8, 10] and branches[b10.pk].generations == [1, 2]
    assert branches[d8.pk].steps == [2, 4, 6, 8] and branches[d8.pk].generations == [1, 4]
    assert [b.leaf for b in tree.branches if b.active] == [d8.pk]

    def flags(node):
        yield node.checkpoint.pk, node.on_active_branch
        for child in node.children:
            yield from flags(child)

    assert {pk for pk, active in flags(root) if active} == {a2.pk, a4.pk, d6.pk, d8.pk}


@pytest.mark.django_db
def test_a_commit_stores_the_measured_save_cost_and_queues_verification(ckjob, runs,
                                                                         django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        checkpoint, created = commit_checkpoint(
            ckjob, commit_for(ckjob, runs.path("A", 2), generation=1, blocking_s=0.25, total_s=3.5), actor="node:x")
    assert created and (checkpoint.blocking_s, checkpoint.total_s) == (0.25, 3.5)
    assert checkpoint.state == CheckpointState.COMMITTED and checkpoint.parent is None
    assert len(callbacks) == 1  # verify_checkpoint.delay, after the transaction commits
    event = Event.objects.get(job=ckjob, kind="checkpoint.commit")
    assert event.evidence["blocking_s"] == 0.25 and event.evidence["total_s"] == 3.5


@pytest.mark.django_db
def test_the_verification_task_verifies_and_is_harmless_twice(ckjob, runs):
    from checkpoints.tasks import verify_checkpoint

    checkpoint, _ = commit_checkpoint(ckjob, commit_for(ckjob, runs.path("A", 2), generation=1), actor="t")
    verify_checkpoint(checkpoint.pk)
    verify_checkpoint(checkpoint.pk)
    verify_checkpoint(10**9)  # gone: returns quietly
    checkpoint.refresh_from_db()
    assert checkpoint.state == CheckpointState.VERIFIED and checkpoint.verified_at is not None
    assert Event.objects.filter(kind="checkpoint.verify", job=ckjob).count() == 1  # one change, one event


@pytest.mark.django_db
def test_a_replayed_commit_returns_the_same_row(ckjob, runs):
    commit = commit_for(ckjob, runs.path("A", 2), generation=1)
    first, created = commit_checkpoint(ckjob, commit, actor="t")
    again, created_again = commit_checkpoint(ckjob, commit, actor="t")
    assert (created, created_again, again.pk) == (True, False, first.pk)
    assert Checkpoint.objects.filter(job=ckjob).count() == 1
