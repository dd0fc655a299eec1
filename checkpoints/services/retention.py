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

Two things the registry alone cannot see (issue 24: a full disk that retention freed nothing of):

7. Torn saves: save directories never committed (a save killed before its marker) are removed
   first (``checkpoints.services.torn``; each a ``storage.torn_removed`` event).
8. Disk pressure: when the file system holding the job's checkpoints has less free space than
   the target — ``min_free_percent`` of it, and at least room for two more saves of the newest
   size — or a save failed with "no space left on device" since the last commit
   (``out_of_space``, from the control plane's checkpoint incident), the oldest checkpoints that
   are not protected are deleted first, beyond ``keep_last``, until the target is reached: first
   the ordinary ones, then the permanent ones that retention itself promoted (the first checkpoint
   of the job, then one every K hours) when ``release_permanent_under_pressure`` (the default).
   Never the newest restorable checkpoint, the latest verified one, one a live generation resumed
   from, or one an operator made permanent. A ``storage.pressure`` event says what was found and
   what was deleted.

   Why auto-promoted permanent ones may go: they are retention's own long-term samples, not a
   promise an operator made; while the disk is full the job cannot save, so each further fault
   loses more work and, at worst, recovery restarts from the very checkpoint kept "permanent" at
   step 10. An operator who wants them kept whatever happens sets
   ``release_permanent_under_pressure: false``, or pins them by hand (a pin is never released).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path

from django.db.models import Count, Min, Q, Sum
from django.utils import timezone

from agents.hooks.manifest import UnsafePath
from checkpoints import disk, paths
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
    unpin,
)
from checkpoints.services.torn import TornSave, find_torn_saves, remove_torn_saves
from core.events import EventKind, record_event
from core.models import Event

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
class DiskPressure:
    """Free space of the file system holding a job's checkpoints, against retention's target."""

    directory: str
    free_bytes: int
    total_bytes: int
    target_bytes: int
    out_of_space: bool  # a save failed with ENOSPC since the last commit

    @property
    def under(self) -> bool:
        return self.out_of_space or self.free_bytes < self.target_bytes


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
    pressure: DiskPressure | None = None
    torn: list[TornSave] = field(default_factory=list)

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
                    actor: str = RETENTION_ACTOR, out_of_space: bool = False) -> RetentionPlan:
    """Decide (and unless ``dry_run``, carry out) retention for one job; see the module doc.

    ``out_of_space``: a save of the job failed for want of space since its last commit."""
    now = now or timezone.now()
    torn = find_torn_saves(job, now=now.timestamp()) if dry_run else remove_torn_saves(job, actor=actor,
                                                                                       now=now.timestamp())
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
    pressure = disk_pressure(job, policy, restorable, out_of_space=out_of_space)
    released: list[int] = []
    if pressure is not None and pressure.under:
        decisions, released = _relieve(decisions, pressure, policy, restorable, _auto_permanent(job, rows, promote))
    plan = RetentionPlan(job=job.pk, now=now, dry_run=dry_run, keep_last=keep_last,
                         permanent_every_hours=every_hours, storage=storage_used(job), decisions=decisions,
                         pressure=pressure, torn=torn)
    if not dry_run:
        _carry_out(plan, {c.pk: c for c in rows}, actor=actor, released=set(released))
        if pressure is not None and pressure.under:
            _record_pressure(job, plan, pressure, released, actor=actor)
    return plan


def disk_pressure(job, policy: CheckpointPolicy, restorable: list[Checkpoint], *,
                  out_of_space: bool = False) -> DiskPressure | None:
    """The free space of the job's checkpoint file system against the target (module doc, 8);
    None when the directory cannot be examined (not there yet, outside the root)."""
    newest = restorable[-1].size_bytes if restorable else 0
    try:
        directory = paths.job_checkpoint_root(job)
        free, total = disk.free_space(directory)
    except (OSError, UnsafePath):
        return None
    target = max(int(total * policy.min_free_percent / 100), 2 * newest)
    return DiskPressure(directory=directory, free_bytes=free, total_bytes=total, target_bytes=target,
                        out_of_space=out_of_space)


def _auto_permanent(job, rows: list[Checkpoint], promote: dict[int, str]) -> set[int]:
    """The permanent checkpoints retention promoted itself (its last pin event is retention's);
    one an operator pinned, or pinned again, is not among them."""
    permanent = {c.pk for c in rows if c.permanent}
    last_pinned_by: dict[int, str] = {}
    if permanent:
        pins = (Event.objects.filter(job=job, kind=EventKind.CHECKPOINT_PIN, evidence__checkpoint__in=list(permanent))
                .order_by("created_at", "pk").values_list("evidence__checkpoint", "actor"))
        last_pinned_by = dict(pins)
    return {pk for pk in permanent if last_pinned_by.get(pk) == RETENTION_ACTOR} | set(promote)


def _relieve(decisions: list[RetentionDecision], pressure: DiskPressure, policy: CheckpointPolicy,
             restorable: list[Checkpoint], auto_permanent: set[int]) -> tuple[list[RetentionDecision], list[int]]:
    """Turn keeps into deletions, oldest first, until the projected free space reaches the target
    (module doc, 8); returns the new decisions and the permanent checkpoints released."""
    newest = restorable[-1].pk if restorable else None
    free = 0 if pressure.out_of_space else pressure.free_bytes
    projected = free + sum(d.size_bytes for d in decisions if not d.keep)
    words = ("a save failed: no space left on device" if pressure.out_of_space else
             f"{pressure.free_bytes} of {pressure.total_bytes} bytes free, below the target of "
             f"{pressure.target_bytes}")
    ordinary = [d for d in decisions if d.keep and d.checkpoint != newest
                and (d.reason.startswith("one of the last") or d.reason.startswith("corrupt"))]
    permanent = ([d for d in decisions if d.keep and d.checkpoint != newest and d.checkpoint in auto_permanent]
                 if policy.release_permanent_under_pressure else [])
    chosen: dict[int, RetentionDecision] = {}
    released = []
    for d in [*ordinary, *permanent]:
        if projected >= pressure.target_bytes:
            break
        extra = "; it was permanent by retention's own promotion" if d.checkpoint in auto_permanent else ""
        chosen[d.checkpoint] = replace(d, keep=False, make_permanent=False,
                                       reason=f"disk pressure ({words}): the oldest unprotected checkpoints go "
                                              f"first{extra}")
        if d.checkpoint in auto_permanent:
            released.append(d.checkpoint)
        projected += d.size_bytes
    return [chosen.get(d.checkpoint, d) for d in decisions], released


def _record_pressure(job, plan: RetentionPlan, pressure: DiskPressure, released: list[int], *, actor: str) -> None:
    deleted = [d for d in plan.delete if d.reason.startswith("disk pressure")]
    freed = sum(d.size_bytes for d in plan.delete) + sum(t.size_bytes for t in plan.torn)
    still_short = not pressure.out_of_space and pressure.free_bytes + freed < pressure.target_bytes
    cause = ("a save failed with no space left on device" if pressure.out_of_space else
             f"{pressure.free_bytes / 2**20:.1f} MiB of {pressure.total_bytes / 2**20:.1f} MiB free, below "
             f"{pressure.target_bytes / 2**20:.1f} MiB")
    reason = (f"disk pressure on {pressure.directory}: {cause}; deleted {len(deleted)} checkpoint(s), oldest "
              f"unprotected first ({', '.join(f'step {d.step}' for d in deleted) or 'none left to delete'}"
              f"{f'; {len(released)} permanent by retention released' if released else ''}), "
              f"{len(plan.torn)} torn save(s) removed, {freed / 2**20:.1f} MiB freed"
              f"{'; still short of the target: nothing else may be deleted' if still_short else ''}")
    record_event(EventKind.STORAGE_PRESSURE, actor=actor, job=job, reason=reason, evidence={
        "directory": pressure.directory, "free_bytes": pressure.free_bytes, "total_bytes": pressure.total_bytes,
        "target_bytes": pressure.target_bytes, "out_of_space": pressure.out_of_space,
        "deleted": [d.checkpoint for d in deleted], "released_permanent": released, "freed_bytes": freed,
        "still_short": still_short})


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


def _carry_out(plan: RetentionPlan, rows: dict[int, Checkpoint], *, actor: str,
               released: frozenset[int] | set[int] = frozenset()) -> None:
    for decision in plan.decisions:
        checkpoint = rows[decision.checkpoint]
        try:
            if decision.checkpoint in released and checkpoint.permanent:
                checkpoint = unpin(checkpoint, actor=actor, reason=decision.reason)
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
