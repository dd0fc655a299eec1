"""Celery tasks of the jobs app: thin wrappers that take primary keys and call the orchestrator,
the progress sweep or a verb. They sit above what they run, which enqueues them through a deferred
import (a module-level one would be a cycle).

Each is safe to run twice and returns quietly when its row is gone.
"""

from __future__ import annotations

import logging

from celery import shared_task

from jobs import checkpoint_interval, logs, orchestrator, progress, reconcile, services, stragglers, windows
from jobs.choices import JobState
from jobs.models import Generation, Job

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def advance_job(job_id: int) -> None:
    while orchestrator.advance_recovery(job_id):
        pass


@shared_task(ignore_result=True)
def sweep() -> None:
    """Beat, every few seconds: hung generations, recoveries to finish or re-drive, pending jobs
    that waited for nodes, and exits that no task handled (``jobs.reconcile``)."""
    for _ in range(50):  # bounded: a poison row must not keep a worker busy forever
        if not progress.expire_one_progress_deadline():
            break
    for _ in range(50):
        if not orchestrator.advance_one_recovery():
            break
    for _ in range(50):
        if not orchestrator.start_one_pending():
            break
    for _ in range(20):  # exits stored that no task handled (a lost message, a dead worker)
        if not reconcile.reexamine_one_exit():
            break


@shared_task(ignore_result=True)
def expire_progress() -> None:
    """Beat, every ``PROGRESS_SWEEP_INTERVAL_S``: hung generations, sooner than the full sweep."""
    for _ in range(50):  # bounded, as in sweep()
        if not progress.expire_one_progress_deadline():
            break


@shared_task(ignore_result=True)
def handle_exit(job_id: int, generation: int, hostname: str, detail: dict) -> None:
    orchestrator.handle_exit(job_id, generation, hostname, detail)


@shared_task(ignore_result=True)
def handle_node_health(hostname: str, new_health: str, reasons: list, fault_at: float | None = None) -> None:
    orchestrator.handle_node_health(hostname, new_health, reasons, fault_at=fault_at)


@shared_task(ignore_result=True)
def handle_nodes_health(new_health: str, reasons: dict) -> None:
    """A batch of nodes changed health together (``reasons``: hostname -> reasons): each is handled
    as by ``handle_node_health``, after one query for those that run a live generation at all."""
    busy = set(Generation.objects.filter(nodes__hostname__in=list(reasons), ended_at__isnull=True,
                                         job__state__in=orchestrator.HEALTH_WATCHED)
               .values_list("nodes__hostname", flat=True))
    for hostname in sorted(busy):
        orchestrator.handle_node_health(hostname, new_health, reasons[hostname])


@shared_task(ignore_result=True)
def handle_flags(job_id: int, generation: int, *, nan: bool, spikes: int, inconsistent: dict | None,
                 spike: dict | None = None, divergence: dict | None = None) -> None:
    job = Job.objects.filter(pk=job_id).first()
    if job is not None:
        orchestrator.handle_hook_flags(job, generation, nan=nan, spikes=spikes, inconsistent=inconsistent,
                                       spike=spike, divergence=divergence)


@shared_task(ignore_result=True)
def handle_save_failed(job_id: int, generation: int, failure: dict) -> None:
    orchestrator.handle_save_failed(job_id, generation, failure)


@shared_task(ignore_result=True)
def start_job_task(job_id: int, actor: str) -> None:
    job = Job.objects.filter(pk=job_id, state=JobState.PENDING).first()
    if job is not None:
        services.start_job(job, actor=actor)


@shared_task(ignore_result=True)
def confirm_stopped(job_id: int, generation: int, hostname: str) -> None:
    orchestrator.confirm_stopped(job_id, generation, hostname)


@shared_task(ignore_result=True)
def handle_launch_refused(job_id: int, generation: int, hostname: str, reason: str, *,
                          job_problem: bool = False) -> None:
    orchestrator.handle_launch_refused(job_id, generation, hostname, reason, job_problem=job_problem)


@shared_task(ignore_result=True)
def maintain_node_windows() -> None:
    """Beat, hourly: node-window partitions made ahead, and those past the retention dropped."""
    done = windows.maintain()
    log.info("node windows: %d partitions created, %d dropped, %d rows deleted", done.created, done.dropped,
             done.deleted)


@shared_task(ignore_result=True)
def push_checkpoint_intervals() -> int:
    """Beat: recompute the Young/Daly interval and push it to running jobs whose policy is "auto"."""
    return checkpoint_interval.push_intervals()


@shared_task(ignore_result=True)
def check_stragglers(job_id: int, generation: int) -> None:
    """New node windows arrived: is one rank holding the job back (``jobs.stragglers``)?"""
    job = Job.objects.filter(pk=job_id, generation=generation, state__in=orchestrator.WATCHED).first()
    if job is not None:
        stragglers.check_stragglers(job, generation)


@shared_task(ignore_result=True)
def prune_training_logs() -> int:
    """Beat: delete shipped training output past its retention (``jobs.logs.prune``)."""
    return logs.prune()
