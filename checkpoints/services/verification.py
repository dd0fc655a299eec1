"""Verification (after each commit, on demand, before every restore) and the choice of restore point."""

from __future__ import annotations

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from checkpoints import paths
from checkpoints.choices import CheckpointState, ReplicaState
from checkpoints.inspection import Finding, inspect_directory
from checkpoints.models import Checkpoint
from checkpoints.services import replicas
from checkpoints.services.registry import active_branch, checkpoint_event
from core.events import EventKind


def inspect_copy(checkpoint: Checkpoint, location: str, *, replica: bool = False):
    """Check one copy (primary or replica) of ``checkpoint`` against what the registry recorded.

    The copy must lie inside its root (the job's checkpoint directory, or a replica root): a
    location outside is refused with the reason, and nothing there is opened.
    """
    try:
        root = _root_of(checkpoint, location, replica=replica)
    except paths.OutsideRoot as error:
        return Finding(False, str(error))
    return inspect_directory(location, root=root, budget=paths.verification_budget(),
                             config_hash=checkpoint.config_hash or None, step=checkpoint.step,
                             data_cursor=checkpoint.data_cursor)


def _root_of(checkpoint: Checkpoint, location: str, *, replica: bool) -> str:
    """The configured root ``location`` lies in (raises ``OutsideRoot``)."""
    if replica:
        return paths.confine(location, paths.replica_roots(), what=f"the replica of checkpoint {checkpoint.pk}")
    return paths.confine(location, [paths.job_checkpoint_root(checkpoint.job)], what=f"checkpoint {checkpoint.pk}")


def verify(checkpoint: Checkpoint, *, actor: str = "system:verifier", record_unchanged: bool = False) -> Checkpoint:
    """Re-check the primary copy on disk and record ``verified`` or ``corrupt`` (with the reason).

    Runs after every commit (``checkpoints.tasks.verify_checkpoint``), on demand (API), and
    before any restore: files can rot between the two. The checks are those of
    ``checkpoints.inspection`` (manifest and hashes; no tensor is loaded). A change of state is
    an event; so is an unchanged verdict when ``record_unchanged`` (an operator asked). A newly
    verified checkpoint is queued for replication (after commit) when a replica location is
    configured.
    """
    if checkpoint.state == CheckpointState.DELETED:
        return checkpoint
    finding = inspect_copy(checkpoint, checkpoint.location)
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
            checkpoint_event(EventKind.CHECKPOINT_VERIFY, current, actor=actor, old_state=old_state,
                             new_state=new_state, reason=finding.reason or f"step {current.step} verified",
                             location=current.location)
        # Only on the way in: a re-verification must not queue a second copy while one runs (the
        # replica sweep retries failed and lost copies).
        if changed and new_state == CheckpointState.VERIFIED and current.replica_state != ReplicaState.VERIFIED:
            replicas.enqueue_replication(current)
    return current


def restore_point(job) -> Checkpoint | None:
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
    # The primary first, even if it was corrupt before: a storage fault may have cleared.
    checkpoint = verify(checkpoint, actor=actor)
    if checkpoint.state == CheckpointState.VERIFIED:
        return checkpoint
    return replicas.restore_from_replica(checkpoint, actor=actor)
