"""Retention: which checkpoints to keep, which to delete, and why — one job at a time.

The policy (``Job.checkpoint_policy``): ``keep_last`` N (default 3) and ``permanent_every_hours``
K (default 12; 0 turns permanent checkpoints off). ``apply_retention`` decides for every live
checkpoint of the job:

1. Permanent ones: a checkpoint already permanent (pinned by an operator or promoted earlier)
   stays. Walking the restorable checkpoints oldest first, one is promoted to permanent when it
   was committed at least K hours after the previous permanent one (the first restorable one
   starts the series). Promotion is sticky, so the outcome does not depend on how often the
   sweep runs, as long as it runs at least once while the candidate is among the last N.
2. Protected ones are kept whatever the policy says: the latest verified checkpoint of the active
   branch (the next restore point) and every checkpoint a live generation resumed from.
3. The last N restorable checkpoints (by commit time: after a rollback the new branch's
   checkpoints are the recent ones even though their steps are lower) are kept.
4. Committed-but-unverified ones are kept: their verdict is not in yet.
5. Corrupt ones are kept while they are newer than the oldest of the last N (a re-verification
   may show a transient storage fault), and deleted once older.
6. Everything else (restorable, older than the last N, not permanent) is deleted.

Ancestors are *not* protected: each DCP checkpoint is a complete, self-contained state (there
are no incremental or delta checkpoints here), so no checkpoint needs its parent's files. The
lineage survives deletion anyway: a deleted checkpoint's row stays, with its step, loss, config
hash, manifest and parent, in state ``deleted``.

Deleting removes the directory (and the replica's), marks the row deleted and records an event
(``registry.delete_checkpoint``). A dry run returns the same plan and changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from django.db.models import Count, Min, Q, Sum
from django.utils import timezone

from checkpoints.choices import CheckpointState, ReplicaState
from checkpoints.models import Checkpoint
from checkpoints.policies import CheckpointPolicy
from checkpoints.services.registry import (
    CheckpointError,
    active_resumptions,
    checkpoint_event,
    delete_checkpoint,
    latest_verified_checkpoint,
    protection_reasons,
    remove_files,
)
from core.events import EventKind

log = logging.getLogger(__name__)

RETENTION_ACTOR = "system:retention"


@dataclass(frozen=True)
class RetentionDecision:
    checkpoint: int
    step: int
    generation: int | None
    state: str
    created_at: datetime
    size_bytes: int
    keep: bool
    reason: str
    make_permanent: bool = False


@dataclass(frozen=True)
class StorageUsage:
    """Bytes on disk for a job's live checkpoints (from the manifests' file sizes)."""

    checkpoints: int
    primary_bytes: int
    replica_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.primary_bytes + self.replica_bytes


@dataclass(frozen=True)
class RetentionPlan:
    job: int
    now: datetime
    dry_run: bool
    keep_last: int
    permanent_every_hours: int
    storage: StorageUsage
    decisions: list[RetentionDecision] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def keep(self) -> list[RetentionDecision]:
        return [d for d in self.decisions if d.keep]

    @property
    def delete(self) -> list[RetentionDecision]:
        return [d for d in self.decisions if not d.keep]

    @property
    def freed_bytes(self) -> int:
        """Primary bytes the deletions free (replicas double it where they exist)."""
        return sum(d.size_bytes for d in self.delete)


def storage_used(job) -> StorageUsage:
    on_disk = ~Q(replica_state__in=[ReplicaState.NONE, ReplicaState.DELETED])
    totals = Checkpoint.objects.filter(job=job).live().aggregate(
        n=Count("pk"), primary=Sum("size_bytes"), replica=Sum("size_bytes", filter=on_disk))
    return StorageUsage(checkpoints=totals["n"], primary_bytes=totals["primary"] or 0,
                        replica_bytes=totals["replica"] or 0)


def apply_retention(job, *, now: datetime | None = None, dry_run: bool = False,
                    actor: str = RETENTION_ACTOR) -> RetentionPlan:
    """Decide (and unless ``dry_run``, carry out) retention for one job; see the module doc."""
    now = now or timezone.now()
    policy = CheckpointPolicy.of(job)
    # At least one: the window below starts at the N-th last restorable checkpoint.
    keep_last, every_hours = max(1, policy.keep_last), policy.permanent_every_hours
    rows = list(Checkpoint.objects.filter(job=job).live().select_related("generation").order_by("created_at", "pk"))
    restorable = [c for c in rows if c.restorable]
    promote = _promotions(restorable, every_hours)
    recent = {c.pk for c in restorable[-keep_last:]}
    window_start = restorable[-keep_last].created_at if len(restorable) >= keep_last else None
    latest = latest_verified_checkpoint(job)
    resumed_by = active_resumptions(job)

    decisions = []
    for c in rows:
        permanent = c.permanent or c.pk in promote
        protections = [r for r in protection_reasons(c, latest=latest, resumed_by=resumed_by)
                       if not r.startswith("it is permanent")]
        if permanent:
            keep, reason = True, ("promoted to permanent: " + promote[c.pk]) if c.pk in promote else "permanent"
        elif protections:
            keep, reason = True, "protected: " + "; ".join(protections)
        elif c.pk in recent:
            keep, reason = True, f"one of the last {keep_last} verified"
        elif c.state == CheckpointState.COMMITTED:
            keep, reason = True, "not verified yet"
        elif c.state == CheckpointState.CORRUPT and not c.restorable:
            if window_start is None or c.created_at > window_start:
                keep, reason = True, f"corrupt ({c.state_reason}) but recent: a re-verification may still pass it"
            else:
                keep, reason = False, f"corrupt ({c.state_reason}) and older than the last {keep_last} verified"
        else:
            keep, reason = False, f"verified, older than the last {keep_last} verified, not permanent"
        decisions.append(RetentionDecision(
            checkpoint=c.pk, step=c.step, generation=c.generation.number if c.generation else None, state=c.state,
            created_at=c.created_at, size_bytes=c.size_bytes, keep=keep, reason=reason,
            make_permanent=c.pk in promote,
        ))
    plan = RetentionPlan(job=job.pk, now=now, dry_run=dry_run, keep_last=keep_last,
                         permanent_every_hours=every_hours, storage=storage_used(job), decisions=decisions)
    if not dry_run:
        _carry_out(plan, {c.pk: c for c in rows}, actor=actor)
    return plan


def _promotions(restorable: list[Checkpoint], every_hours: int) -> dict[int, str]:
    """checkpoint id -> why it becomes permanent (step 1 of the module doc)."""
    if every_hours <= 0:
        return {}
    spacing = timedelta(hours=every_hours)
    promote: dict[int, str] = {}
    previous: Checkpoint | None = None
    for c in restorable:
        if c.permanent:
            previous = c
        elif previous is None:
            promote[c.pk] = "the first verified checkpoint of the job starts the permanent series"
            previous = c
        elif c.created_at - previous.created_at >= spacing:
            promote[c.pk] = (f"the first verified checkpoint {every_hours} h or more after the previous permanent "
                             f"one (step {previous.step})")
            previous = c
    return promote


def _carry_out(plan: RetentionPlan, rows: dict[int, Checkpoint], *, actor: str) -> None:
    for decision in plan.decisions:
        checkpoint = rows[decision.checkpoint]
        try:
            if decision.make_permanent:
                if Checkpoint.objects.filter(pk=checkpoint.pk, permanent=False).update(permanent=True):
                    checkpoint_event(EventKind.CHECKPOINT_PIN, checkpoint, actor=actor, reason=decision.reason)
            elif not decision.keep:
                # protections=[]: the plan has just checked them; the compare-and-set in
                # delete_checkpoint still refuses one that was pinned meanwhile.
                delete_checkpoint(checkpoint, actor=actor, reason=f"retention: {decision.reason}", protections=[])
        except CheckpointError as error:
            plan.errors.append(str(error))


def purge_deleted_files(job, *, actor: str = RETENTION_ACTOR) -> int:
    """Remove what is still on disk of deleted checkpoints (a removal that failed earlier); returns how many."""
    purged = 0
    for checkpoint in Checkpoint.objects.filter(job=job, state=CheckpointState.DELETED):
        leftovers = [loc for loc in (checkpoint.location, checkpoint.replica_location) if loc and Path(loc).exists()]
        if leftovers and remove_files(checkpoint, actor=actor):
            purged += 1
    return purged


def jobs_with_live_checkpoints() -> list:
    """The jobs that have a live checkpoint, by id: reached through one checkpoint of each (the
    foreign key), in one query."""
    one_per_job = Checkpoint.objects.live().order_by().values("job_id").annotate(first=Min("pk")).values("first")
    return [c.job for c in Checkpoint.objects.filter(pk__in=one_per_job).select_related("job").order_by("job_id")]


def retention_sweep(*, now: datetime | None = None) -> int:
    """Beat: apply retention to every job with live checkpoints; returns how many were deleted.

    One job's failure is logged and the sweep goes on: a poison row must not stop the others.
    """
    deleted = 0
    for job in jobs_with_live_checkpoints():
        try:
            deleted += len(apply_retention(job, now=now).delete)
            purge_deleted_files(job)
        except Exception:
            log.exception("retention failed for job %s", job.pk)
    return deleted
