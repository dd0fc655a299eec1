"""Celery tasks of the checkpoint registry. They take primary keys, return quietly when the row is
gone, and are safe to run twice (each service checks the state first)."""

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


@shared_task(ignore_result=True)
def replicate_checkpoint(checkpoint_id: int) -> None:
    checkpoint = Checkpoint.objects.select_related("job").filter(pk=checkpoint_id).first()
    if checkpoint is None:
        return
    services.replicate(checkpoint)


@shared_task(ignore_result=True)
def retention_sweep() -> int:
    """Beat: keep/delete per each job's policy, and finish removals that failed earlier."""
    return services.retention_sweep()


@shared_task(ignore_result=True)
def relieve_disk_pressure(job_id: int) -> None:
    """A save of the job failed for want of space: retention for it now, as under disk pressure,
    rather than at the next sweep (the job trains on without new checkpoints meanwhile)."""
    job_model = Checkpoint._meta.get_field("job").related_model  # the checkpoints app does not import jobs
    job = job_model.objects.filter(pk=job_id).first()
    if job is not None:
        services.apply_retention(job, out_of_space=True)


@shared_task(ignore_result=True)
def replica_sweep() -> int:
    """Beat: re-queue copies that were lost, failed or abandoned."""
    return services.replica_sweep()
