"""Reconciliation: facts the database holds that no task acted on.

An agent's exit report (or its acknowledged stop) is stored by the web process that received it,
and then handed to the orchestrator through a Celery message (``jobs.receivers``). If that message
is lost — the broker was down and the outbox could not be written either, the worker that took it
died before acknowledging it (a late ack is redelivered only after Redis's visibility timeout, an
hour) — the job would sit "running" with dead ranks until its progress timeout, or "quiescing"
until its quiesce deadline. This sweep (part of ``jobs.tasks.sweep``) finds the stored exits of the
current generation of an active job whose node the generation has not counted as stopped, older than
``GRACE_S`` (the normal path takes well under a second), and handles them as the task would have:
``orchestrator.handle_exit`` confirms the stop and opens the incident. Running it twice, or beside
the late task, is harmless: a confirmed node is skipped, and a second fault report for a quiescing
job is recorded as further evidence only.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db.models import F
from django.utils import timezone

from jobs import orchestrator
from jobs.choices import JobState
from jobs.models import Generation, Job
from nodes.choices import CommandKind, CommandState
from nodes.models import AgentEventRecord, NodeCommand

log = logging.getLogger(__name__)

#: An exit stored this long ago that no task has handled is handled by the sweep.
GRACE_S = 10.0
#: Rows looked at per call (indexed on job and generation; only active jobs' current generation).
SCAN = 500


def reexamine_one_exit(*, now=None) -> bool:
    """Handle one stored exit (or acknowledged stop) of an active job's current generation that the
    generation has not counted; returns whether it found one."""
    cutoff = (now or timezone.now()) - timedelta(seconds=GRACE_S)
    active = active_jobs()
    if not active:
        return False
    exits = list(exits_of_active_jobs(cutoff, active).values_list("pk", "job_id", "generation", "node__hostname",
                                                                  "kind", "detail")[:SCAN])
    stops = list(stops_of_active_jobs(cutoff, active).values_list("job_id", "generation", "node__hostname")[:SCAN])
    counted = _stopped_nodes({(job, gen) for _, job, gen, *_ in exits} | {(job, gen) for job, gen, _ in stops})
    for pk, job_id, generation, hostname, kind, detail in exits:
        if (job_id, generation) not in counted or hostname in counted[job_id, generation]:
            continue
        log.warning("job %s generation %s: the exit report %s from %s was never handled; handling it now",
                    job_id, generation, pk, hostname)
        orchestrator.handle_exit(job_id, generation, hostname, {
            **detail, "requested_stop": kind == "stopped" or bool(detail.get("requested_stop", False))})
        return True
    for job_id, generation, hostname in stops:
        if (job_id, generation) not in counted or hostname in counted[job_id, generation]:
            continue
        log.warning("job %s generation %s: the stop acknowledged by %s was never counted; counting it now",
                    job_id, generation, hostname)
        orchestrator.confirm_stopped(job_id, generation, hostname)
        return True
    return False


def exits_of_active_jobs(cutoff, active: list[int]):
    """Exit reports of the current generation of the ``active`` jobs, received before ``cutoff``:
    driven from the few active jobs through the (job, generation) index, never from every exit
    ever stored."""
    return AgentEventRecord.objects.filter(
        job_id__in=active, generation=F("job__generation"), kind__in=("exited", "stopped"),
        received_at__lte=cutoff).order_by("received_at", "pk")


def stops_of_active_jobs(cutoff, active: list[int]):
    """Stop commands of the current generation of the ``active`` jobs, acknowledged as done before
    ``cutoff`` (through the commands' job index)."""
    return NodeCommand.objects.filter(
        job_id__in=active, generation=F("job__generation"), kind=CommandKind.STOP, state=CommandState.ACKED,
        acked_at__lte=cutoff).order_by("acked_at", "pk")


def active_jobs() -> list[int]:
    return list(Job.objects.filter(state__in=JobState.ACTIVE).values_list("pk", flat=True))


def _stopped_nodes(keys: set[tuple[int, int]]) -> dict[tuple[int, int], set[str]]:
    if not keys:
        return {}
    rows = Generation.objects.filter(job_id__in={job for job, _ in keys}).filter(
        number__in={gen for _, gen in keys}).values_list("job_id", "number", "stopped_nodes")
    return {(job, number): set(stopped) for job, number, stopped in rows if (job, number) in keys}
