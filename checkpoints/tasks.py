"""Celery tasks of the checkpoint registry. They take primary keys and are safe to run twice."""

from __future__ import annotations

from celery import shared_task

from checkpoints import services
from checkpoints.models import Checkpoint


@shared_task(ignore_result=True)
def verify_checkpoint(checkpoint_id: int) -> None:
    checkpoint = Checkpoint.objects.filter(pk=checkpoint_id).first()
    if checkpoint is None:
        return
    services.verify(checkpoint)
