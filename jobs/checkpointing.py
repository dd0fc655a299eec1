"""The hooks' checkpoint commit as a job verb: fenced by the job's generation, then registered.

The checkpoints app records a commit (the path confined to the job's directory, the lineage, the
save cost, the verification queued). What only the job knows is decided here: whether the
generation that sent it is still the job's (``jobs.state`` fences it: a stale one is refused), which
generation row wrote it, and that a new commit answers a pending "checkpoint now"
(the ``request_checkpoint`` verb sets ``Job.checkpoint_requested_at``; the control endpoint answers
``checkpoint_now`` until a commit newer than the request clears it).
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from agents.protocol import hooks as hooks_protocol
from checkpoints import services as checkpoint_services
from checkpoints.models import Checkpoint
from jobs import state
from jobs.models import Generation, Job


@transaction.atomic
def commit_checkpoint(job: Job, commit: hooks_protocol.CheckpointCommit, *, actor: str) -> tuple[Checkpoint, bool]:
    """Register a committed checkpoint; returns ``(checkpoint, created)``.

    Raises ``StaleGeneration`` (a ``TransitionError``: the API answers 409) unless the commit's
    generation is the job's; ``paths.OutsideRoot`` and ``CheckpointError`` as
    ``checkpoints.services.record_commit`` does. Idempotent on (job, path).
    """
    state.check_generation(job, commit.generation)
    generation = Generation.objects.filter(job=job, number=commit.generation).first()
    checkpoint, created = checkpoint_services.record_commit(job, commit, generation=generation, actor=actor)
    if created:
        Job.objects.filter(pk=job.pk, checkpoint_requested_at__lte=timezone.now()).update(checkpoint_requested_at=None)
    return checkpoint, created
