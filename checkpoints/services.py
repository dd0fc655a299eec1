"""Verbs on checkpoints: record a commit reported by the hooks, and walk the lineage."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from agents.protocol import hooks as hooks_protocol
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
    return checkpoint, True


def lineage(checkpoint: Checkpoint) -> list[Checkpoint]:
    """The path from ``checkpoint`` up to the root of its tree, newest first."""
    path, seen = [], set()
    node: Checkpoint | None = checkpoint
    while node is not None and node.pk not in seen:
        seen.add(node.pk)
        path.append(node)
        node = node.parent
    return path
