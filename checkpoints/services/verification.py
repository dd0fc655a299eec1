"""Verification (after each commit, on demand, before every restore) and the choice of restore point."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from checkpoints.choices import CheckpointState, ReplicaState
from checkpoints.inspection import inspect_directory
from checkpoints.models import Checkpoint
from checkpoints.services import replicas
from checkpoints.services.registry import active_branch, record_event
from jobs.models import Job

DEFAULT_LOAD_TEST_TIMEOUT_S = 600


def load_test_enabled() -> bool:
    """``NIGHTWATCH["CHECKPOINT_LOAD_TEST"]``: also load each new checkpoint on CPU (off by default:
    it reads the whole checkpoint once more, in a child process)."""
    return bool(settings.NIGHTWATCH.get("CHECKPOINT_LOAD_TEST", False))


def inspect_copy(checkpoint: Checkpoint, location: str, *, load_test: bool = False):
    """Check one copy (primary or replica) of ``checkpoint`` against what the registry recorded."""
    return inspect_directory(
        location, config_hash=checkpoint.config_hash or None, step=checkpoint.step,
        data_cursor=checkpoint.data_cursor, load_test=load_test,
        load_test_timeout_s=float(settings.NIGHTWATCH.get("CHECKPOINT_LOAD_TEST_TIMEOUT_S",
                                                          DEFAULT_LOAD_TEST_TIMEOUT_S)),
    )


def verify(checkpoint: Checkpoint, *, actor: str = "system:verifier", load_test: bool | None = None,
           record_unchanged: bool = False) -> Checkpoint:
    """Re-check the primary copy on disk and record ``verified`` or ``corrupt`` (with the reason).

    Runs after every commit (``checkpoints.tasks.verify_checkpoint``), on demand (API), and
    before any restore: files can rot between the two. The checks are those of
    ``checkpoints.inspection``; ``load_test`` None follows the setting. A change of state is
    an event; so is an unchanged verdict when ``record_unchanged`` (an operator asked). A newly
    verified checkpoint is queued for replication (after commit) when a replica location is
    configured.
    """
    if checkpoint.state == CheckpointState.DELETED:
        return checkpoint
    use_load_test = load_test_enabled() if load_test is None else load_test
    finding = inspect_copy(checkpoint, checkpoint.location, load_test=use_load_test)
    new_state = CheckpointState.VERIFIED if finding.ok else CheckpointState.CORRUPT
    with transaction.atomic():
        # Hashing took a while without a lock; decide against the row as it is now.
        current = Checkpoint.objects.select_for_update().filter(pk=checkpoint.pk).first()
        if current is None or current.state == CheckpointState.DELETED:
            return current or checkpoint
        old_state = current.state
        changed = (current.state, current.state_reason) != (new_state, finding.reason)
        current.state, current.state_reason, current.verified_at = new_state, finding.reason, timezone.now()
        current.save(update_fields=["state", "state_reason", "verified_at"])
        if changed or record_unchanged:
            record_event("checkpoint.verify", current, actor=actor, old_state=old_state, new_state=new_state,
                         reason=finding.reason or f"step {current.step} verified", location=current.location,
                         load_test=use_load_test)
        # Only on the way in: a re-verification must not queue a second copy while one runs (the
        # replica sweep retries failed and lost copies).
        if changed and new_state == CheckpointState.VERIFIED and current.replica_state != ReplicaState.VERIFIED:
            replicas.enqueue_replication(current)
    return current


def restore_point(job: Job) -> Checkpoint | None:
    """The newest checkpoint of the active branch that verifies *now*; corrupt ones are marked.

    Candidates are the verified and not-yet-verified committed ones, and corrupt ones that have
    a verified replica, newest step first. Each candidate's primary copy is re-verified on disk
    before it is chosen, so a checkpoint corrupted after its first verification is caught here;
    when the primary is corrupt or missing and a verified replica exists, the replica is checked
    and restored from instead (an event says so), and only then is an older checkpoint tried.

    The instance returned for a replica restore carries the replica's path in ``location`` (so
    that the launch hands the hooks the copy that is intact) and refuses ``save()``.
    """
    candidates = active_branch(job).filter(
        Q(state__in=[CheckpointState.VERIFIED, CheckpointState.COMMITTED])
        | Q(state=CheckpointState.CORRUPT, replica_state=ReplicaState.VERIFIED)
    ).order_by("-step", "-pk")
    for checkpoint in candidates:
        served = verified_copy(checkpoint, actor="system:restore")
        if served is not None:
            return served
    return None


def verified_copy(checkpoint: Checkpoint, *, actor: str) -> Checkpoint | None:
    """``checkpoint`` if its primary copy verifies now, else served from its replica if that one
    does, else None. What any restore (recovery, rollback) should hand to the hooks."""
    # The primary first, even if it was corrupt before: a storage fault may have cleared. No load
    # test: recovery is waiting, and the hashes prove these are the bytes checked at commit time.
    checkpoint = verify(checkpoint, actor=actor, load_test=False)
    if checkpoint.state == CheckpointState.VERIFIED:
        return checkpoint
    return replicas.restore_from_replica(checkpoint, actor=actor)
