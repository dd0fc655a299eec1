"""Verbs on checkpoints: record a commit reported by the hooks, and walk the lineage."""

from __future__ import annotations

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from agents.protocol import hooks as hooks_protocol
from checkpoints.choices import CheckpointState
from checkpoints.models import Checkpoint
from jobs import state
from jobs.models import Event, Generation, Job


@transaction.atomic
def record_commit(job: Job, commit: hooks_protocol.CheckpointCommit, *, actor: str) -> tuple[Checkpoint, bool]:
    """Register a committed checkpoint; returns ``(checkpoint, created)``.

    Idempotent on (job, location): a replay after an outage returns the existing row. The parent
    is the newest earlier checkpoint of the same generation, or for a generation's first
    checkpoint the one it resumed from — so a rollback naturally starts a new branch.
    """
    state.check_generation(job, commit.generation)
    existing = Checkpoint.objects.filter(job=job, location=commit.path).first()
    if existing is not None:
        return existing, False
    generation = Generation.objects.filter(job=job, number=commit.generation).first()
    parent = (
        Checkpoint.objects.filter(job=job, generation=generation, step__lt=commit.step).order_by("-step").first()
        if generation is not None else None
    )
    if parent is None and generation is not None:
        parent = generation.resumed_from
    checkpoint = Checkpoint.objects.create(
        job=job, generation=generation, step=commit.step, location=commit.path, manifest=commit.manifest,
        parent=parent, config_hash=commit.config_hash, data_cursor=commit.data_cursor,
        loss=commit.loss if commit.loss == commit.loss and abs(commit.loss) != float("inf") else None,
        size_bytes=commit.size_bytes, world_size=commit.world_size,
    )
    Job.objects.filter(pk=job.pk, checkpoint_requested_at__lte=timezone.now()).update(checkpoint_requested_at=None)
    Event.objects.create(kind="checkpoint.commit", actor=actor, job=job, generation=commit.generation,
                         reason=f"step {commit.step} committed at {commit.path}",
                         evidence={"checkpoint": checkpoint.pk, "blocking_s": commit.blocking_s,
                                   "total_s": commit.total_s, "size_bytes": commit.size_bytes})
    transaction.on_commit(lambda: _enqueue_verification(checkpoint.pk))
    return checkpoint, True


def _enqueue_verification(pk: int) -> None:
    from checkpoints.tasks import verify_checkpoint

    verify_checkpoint.delay(pk)


def lineage(checkpoint: Checkpoint) -> list[Checkpoint]:
    """The path from ``checkpoint`` up to the root of its tree, newest first."""
    path, seen = [], set()
    node: Checkpoint | None = checkpoint
    while node is not None and node.pk not in seen:
        seen.add(node.pk)
        path.append(node)
        node = node.parent
    return path


def verify(checkpoint: Checkpoint, *, actor: str = "system:verifier") -> Checkpoint:
    """Re-hash the checkpoint against its manifest and record ``verified`` or ``corrupt`` (with why).

    Runs after every commit (``checkpoints.tasks.verify_checkpoint``) and again before any
    restore: files can rot between the two.
    """
    from agents.hooks.manifest import verify as verify_on_disk

    verdict = verify_on_disk(checkpoint.location, config_hash=checkpoint.config_hash or None)
    new_state = CheckpointState.VERIFIED if verdict.ok else CheckpointState.CORRUPT
    reason = verdict.reason or ""
    changed = Checkpoint.objects.filter(pk=checkpoint.pk).exclude(state=CheckpointState.DELETED).exclude(
        state=new_state, state_reason=reason
    ).update(state=new_state, state_reason=reason, verified_at=timezone.now())
    if changed:
        Event.objects.create(kind="checkpoint.verify", actor=actor, job_id=checkpoint.job_id,
                             old_state=checkpoint.state, new_state=new_state,
                             reason=reason or f"step {checkpoint.step} verified",
                             evidence={"checkpoint": checkpoint.pk, "location": checkpoint.location})
    checkpoint.refresh_from_db()
    return checkpoint


def active_branch(job: Job):
    """Checkpoints of the job's active lineage branch (all of them until a rollback starts one)."""
    checkpoints = Checkpoint.objects.filter(job=job)
    if job.branch_root_id is None:
        return checkpoints
    return checkpoints.filter(Q(pk=job.branch_root_id) | Q(generation__number__gte=job.branch_since_generation))


def restore_point(job: Job) -> Checkpoint | None:
    """The newest checkpoint of the active branch that verifies *now*; corrupt ones are marked.

    Candidates are the verified and the not-yet-verified committed ones, newest step first; each
    is re-verified on disk before it is chosen, so a checkpoint corrupted after its first
    verification is caught here and the one before it is used.
    """
    candidates = active_branch(job).filter(
        state__in=[CheckpointState.VERIFIED, CheckpointState.COMMITTED]
    ).order_by("-step", "-pk")
    for checkpoint in candidates:
        if verify(checkpoint, actor="system:restore").state == CheckpointState.VERIFIED:
            return checkpoint
    return None
