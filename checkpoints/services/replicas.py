"""Replicas: a second copy of each verified checkpoint, for when the primary storage fails.

Where: the job policy's ``replica_dir``, else ``NIGHTWATCH["CHECKPOINT_REPLICA_ROOT"]/job-<id>``;
neither set means no replicas. A replica keeps the primary directory's name. A ``replica_dir``
must lie inside a configured replica root (``NIGHTWATCH["REPLICA_ROOTS"]`` or
``CHECKPOINT_REPLICA_ROOT``): one outside is refused with the reason on the checkpoint, and
nothing is written there.

How (``replicate``, run by a Celery task after verification and by the reconciliation sweep):

1. only a checkpoint whose primary copy is verified is copied (never spread a bad copy);
2. the manifest's files (regular files only, no symlinks) go to a temporary sibling, renamed into
   place (``disk.copy_checkpoint``), so a replica directory is whole or absent;
3. the copy is verified like the primary (hashes, parts, step) and the outcome recorded in
   ``replica_state`` with an event. A failed copy leaves the state at "no replica" (retried by
   the sweep); a copy that fails verification is "corrupt", and the primary is re-verified,
   because the bytes it was copied from may be the bad ones.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

# Modules, not names: checkpoints.tasks and checkpoints.services.verification import this one in
# turn (a commit's verification queues the copy; a bad copy re-verifies the primary), and their
# names are looked up when called, by which time every module is loaded.
from checkpoints import disk, paths, tasks
from checkpoints.choices import CheckpointState, ReplicaState
from checkpoints.models import Checkpoint
from checkpoints.policies import CheckpointPolicy
from checkpoints.services import verification
from checkpoints.services.registry import checkpoint_event
from core.events import EventKind

log = logging.getLogger(__name__)

#: A copy still "copying" after this long was abandoned (a worker died); the sweep redoes it.
COPY_LEASE = timedelta(hours=1)


def replica_root(job) -> Path | None:
    """Where the job's replicas go; ``paths.OutsideRoot`` when its ``replica_dir`` is outside the
    configured replica roots (``NIGHTWATCH["REPLICA_ROOTS"]``, ``CHECKPOINT_REPLICA_ROOT``)."""
    configured = CheckpointPolicy.of(job).replica_dir
    if configured:
        paths.confine_directory(configured, paths.replica_roots(), what=f"job {job.pk}'s replica_dir")
        return Path(configured)
    root = settings.NIGHTWATCH.get("CHECKPOINT_REPLICA_ROOT")
    return Path(root) / f"job-{job.pk}" if root else None


def replica_location_for(checkpoint: Checkpoint) -> str | None:
    root = replica_root(checkpoint.job)
    return str(root / Path(checkpoint.location).name) if root else None


def enqueue_replication(checkpoint: Checkpoint) -> None:
    """After the current transaction commits, copy ``checkpoint`` if replicas are configured."""
    try:
        if replica_root(checkpoint.job) is None:
            return
    except paths.OutsideRoot as error:
        _set_replica(checkpoint, ReplicaState.NONE, str(error))
        log.warning("not replicating checkpoint %s: %s", checkpoint.pk, error)
        return

    def enqueue():
        tasks.replicate_checkpoint.delay(checkpoint.pk)

    transaction.on_commit(enqueue)


def replicate(checkpoint: Checkpoint, *, actor: str = "system:replicator") -> Checkpoint:
    """Copy a verified checkpoint to its replica location and verify the copy (see the module doc)."""
    try:
        target = replica_location_for(checkpoint)
    except paths.OutsideRoot as error:
        return _record(checkpoint, ReplicaState.NONE, str(error), actor)
    if target is None or checkpoint.state != CheckpointState.VERIFIED:
        return checkpoint
    if checkpoint.replica_state == ReplicaState.VERIFIED and Path(checkpoint.replica_location).is_dir():
        return checkpoint
    _set_replica(checkpoint, ReplicaState.COPYING, "", location=target)
    roots = paths.replica_roots()
    if os.path.lexists(target):
        # Left by an earlier attempt that died after the rename, or a copy that went bad.
        if verification.inspect_copy(checkpoint, target, replica=True).ok:
            return _record(checkpoint, ReplicaState.VERIFIED, "", actor, "replica already in place and intact")
        try:
            disk.remove_checkpoint_dir(target, roots)
        except (OSError, disk.UnsafePath) as error:
            return _record(checkpoint, ReplicaState.NONE, f"cannot clear {target}: {error}", actor)
    try:
        disk.copy_checkpoint(checkpoint.location, paths.job_checkpoint_root(checkpoint.job), target,
                             paths.confine(target, roots, what="replica directory"))
    except (OSError, disk.UnsafePath) as error:
        return _record(checkpoint, ReplicaState.NONE, f"copy to {target} failed: {error}", actor)
    if Checkpoint.objects.filter(pk=checkpoint.pk, state=CheckpointState.DELETED).exists():
        # Deleted while we copied: the deletion could not have known about this copy.
        disk.remove_checkpoint_dir(target, roots)
        return Checkpoint.objects.get(pk=checkpoint.pk)
    finding = verification.inspect_copy(checkpoint, target, replica=True)
    if finding.ok:
        return _record(checkpoint, ReplicaState.VERIFIED, "", actor, f"replica at {target} verified")
    replica = _record(checkpoint, ReplicaState.CORRUPT, finding.reason, actor)
    verification.verify(replica, actor=actor)  # the source may be what went bad
    replica.refresh_from_db()
    return replica


def restore_from_replica(checkpoint: Checkpoint, *, actor: str) -> Checkpoint | None:
    """The checkpoint, served from its replica, if the replica verifies now; else None.

    Called by ``restore_point`` when the primary copy is corrupt or missing. The returned
    instance's ``location`` is the replica's path and it refuses ``save()``.
    """
    if checkpoint.replica_state != ReplicaState.VERIFIED or not checkpoint.replica_location:
        return None
    finding = verification.inspect_copy(checkpoint, checkpoint.replica_location, replica=True)
    if not finding.ok:
        _record(checkpoint, ReplicaState.CORRUPT, finding.reason, actor)
        return None
    Checkpoint.objects.filter(pk=checkpoint.pk).update(replica_checked_at=timezone.now())
    checkpoint_event(EventKind.CHECKPOINT_RESTORE_FROM_REPLICA, checkpoint, actor=actor,
                     reason=f"primary copy at {checkpoint.location} is {checkpoint.state} "
                            f"({checkpoint.state_reason or 'no reason recorded'}); restoring from the replica at "
                            f"{checkpoint.replica_location}",
                     location=checkpoint.location, replica_location=checkpoint.replica_location)
    served = Checkpoint.objects.get(pk=checkpoint.pk)
    served.location = checkpoint.replica_location
    served.served_from_replica = True
    return served


def replicas_due(now=None):
    """Verified checkpoints whose replica is missing, failed, or whose copy was abandoned."""
    now = now or timezone.now()
    return Checkpoint.objects.filter(state=CheckpointState.VERIFIED).filter(
        Q(replica_state__in=[ReplicaState.NONE, ReplicaState.CORRUPT])
        | Q(replica_state=ReplicaState.COPYING, replica_checked_at__lt=now - COPY_LEASE)
    )


def replica_sweep(*, limit: int = 100) -> int:
    """Queue a copy for each checkpoint that should have a replica and lacks a good one; returns how many.

    The reconciliation behind the on-commit enqueue: a lost Celery message or a dead worker
    only delays a replica. Jobs without a replica location are skipped.
    """
    queued = 0
    for checkpoint in replicas_due().select_related("job").order_by("created_at")[: limit * 4]:
        if queued >= limit:
            break
        try:
            if replica_root(checkpoint.job) is None:
                continue
        except paths.OutsideRoot:
            continue  # recorded on the checkpoint when it was verified
        tasks.replicate_checkpoint.delay(checkpoint.pk)
        queued += 1
    return queued


def _set_replica(checkpoint: Checkpoint, state: str, reason: str, *, location: str | None = None) -> None:
    fields = {"replica_state": state, "replica_reason": reason, "replica_checked_at": timezone.now()}
    if location is not None:
        fields["replica_location"] = location
    # Never resurrect the replica of a checkpoint deleted meanwhile.
    Checkpoint.objects.filter(pk=checkpoint.pk).exclude(state=CheckpointState.DELETED).update(**fields)


def _record(checkpoint: Checkpoint, state: str, reason: str, actor: str, note: str = "") -> Checkpoint:
    before = Checkpoint.objects.get(pk=checkpoint.pk)
    _set_replica(checkpoint, state, reason)
    after = Checkpoint.objects.get(pk=checkpoint.pk)
    if after.replica_state != before.replica_state or reason:
        checkpoint_event(EventKind.CHECKPOINT_REPLICA, after, actor=actor,
                         old_state=f"replica:{before.replica_state or 'none'}",
                         new_state=f"replica:{after.replica_state or 'none'}", reason=reason or note,
                         replica_location=after.replica_location)
    if reason:
        log.warning("replica of checkpoint %s: %s", checkpoint.pk, reason)
    return after
