"""Exit detection: a periodic one-shot reads Slurm's job states and reports the ends.

A generation's batch job that ended is reported exactly as an agent reports a torchrun that
ended (``nodes.transports.slurm.ended``), so ``jobs.receivers`` hands it to the orchestrator and
the same recovery policy decides. The one-shot also re-drives an ``sbatch`` or ``scancel`` that
did not happen (``nodes.transports.slurm.launch``).
"""

from __future__ import annotations

import logging

from django.utils import timezone

from core.text import clip
from nodes.choices import SlurmAllocationState
from nodes.models import SlurmAllocation
from nodes.transports.slurm import controller
from nodes.transports.slurm.cli import Slurm, SlurmError, SlurmJob, SlurmUnavailable
from nodes.transports.slurm.ended import report_ended
from nodes.transports.slurm.launch import cancel, submit

log = logging.getLogger(__name__)
#: Re-drive an sbatch (or scancel) that did not happen after this long (a lost task, Slurm was down).
REDRIVE_AFTER_S = 5.0


def poll_jobs(slurm: Slurm | None = None) -> int:
    """One pass over the open allocations; returns how many changed. Never raises for Slurm:
    a controller that does not answer is recorded (``controller.record_failure``) and backed off."""
    open_rows = list(SlurmAllocation.objects.filter(state__in=SlurmAllocationState.OPEN).select_related("job"))
    if not open_rows or not controller.may_call():
        return 0
    slurm = slurm or Slurm.from_settings()
    changed = 0
    now = timezone.now()
    stale = now - timezone.timedelta(seconds=REDRIVE_AFTER_S)
    for row in open_rows:
        try:
            if row.state == SlurmAllocationState.SUBMITTING and row.created_at < stale:
                changed += submit(row.pk, slurm)
            elif row.cancel_requested_at and not row.cancel_sent_at and row.cancel_requested_at < stale:
                changed += cancel(row.pk, slurm)
        except Exception:  # a poison row must not stop the others, nor crash every tick's task
            log.exception("job %s generation %s: re-driving the Slurm allocation failed", row.job_id, row.generation)
    queued = [r for r in open_rows if r.slurm_job_id]
    if not queued or not controller.may_call():
        return changed
    try:
        jobs = slurm.jobs()
    except SlurmError as exc:
        if isinstance(exc, SlurmUnavailable):
            controller.record_failure(exc)
        else:
            log.error("reading Slurm's jobs failed: %s", exc)
        return changed
    controller.record_ok()
    for row in queued:
        changed += _follow(row, jobs.get(row.slurm_job_id))
    return changed


def _follow(row: SlurmAllocation, job: SlurmJob | None) -> int:
    if job is None:
        # Past MinJobAge, or a controller that lost its state: the job is gone, how is unknown.
        return report_ended(row, state="VANISHED", exit_status=None, exit_signal=None,
                            requested_stop=bool(row.cancel_requested_at),
                            note=f"Slurm no longer knows job {row.slurm_job_id}")
    if not job.ended:
        if job.state == "RUNNING" and row.started_at is None:
            SlurmAllocation.objects.filter(pk=row.pk, started_at__isnull=True).update(
                started_at=timezone.now(), slurm_state=job.state[:32], slurm_reason=clip(job.reason, 200))
            return 1
        if job.state != row.slurm_state:
            SlurmAllocation.objects.filter(pk=row.pk).update(slurm_state=job.state[:32],
                                                             slurm_reason=clip(job.reason, 200))
        return 0
    return report_ended(row, state=job.state, exit_status=job.exit_status, exit_signal=job.exit_signal,
                        requested_stop=bool(row.cancel_requested_at), note=job.reason)
