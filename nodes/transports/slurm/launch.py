"""Launching and stopping a generation as a Slurm batch job.

``SlurmTransport.launch`` runs inside ``start_generation``'s transaction and only records a
``SlurmAllocation`` (state ``submitting``); ``submit`` runs ``sbatch`` after the commit (a Celery
task, re-driven by the watch one-shot while it stays unsubmitted). ``stop`` records the request;
``cancel`` runs ``scancel`` after the commit. Slurm's answer — the job ended — comes back through
``nodes.transports.slurm.watch`` (and ``ended``, which reports it).

Submission is idempotent: the allocation row is locked while ``sbatch`` runs, and a job already
carrying the allocation's name (an ``sbatch`` whose answer was lost) is adopted, not duplicated.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agents.protocol import agent as wire
from core.events import EventKind, record_event
from core.models import ApiToken, Scope
from nodes.choices import Health, Schedulability, SlurmAllocationState, Transport
from nodes.models import Node, SlurmAllocation
from nodes.policies import LemonPolicy
from nodes.transports.base import Launch
from nodes.transports.slurm import controller, script
from nodes.transports.slurm.cli import Slurm, SlurmError, SlurmRefused, SlurmUnavailable
from nodes.transports.slurm.ended import report_ended

log = logging.getLogger(__name__)
ACTOR = "system:slurm"


class SlurmTransport:
    name = "slurm"

    def launch(self, launch: Launch) -> None:
        job = launch.job
        # Validate exactly as an agent would; the script is rendered from the parsed payload.
        command = wire.Command(id="0", kind="launch", idempotency_key="slurm", job=str(job.pk),
                               generation=launch.generation, payload=launch.payloads[0])
        payload = wire.compact(wire.parse_command_payload(command))
        allocation, created = SlurmAllocation.objects.get_or_create(
            job=job, generation=launch.generation,
            defaults={"hostnames": [n.hostname for n in launch.nodes], "payload": payload,
                      "excluded": excluded_nodes(exclude=[n.hostname for n in launch.nodes])})
        if created:
            transaction.on_commit(lambda: _submit_later(allocation.pk))

    def stop(self, job, generation: int, nodes: list, *, grace_s: float, reason: str) -> None:
        now = timezone.now()
        allocation = SlurmAllocation.objects.filter(job=job, generation=generation).first()
        if allocation is None or allocation.state == SlurmAllocationState.ENDED:
            return
        SlurmAllocation.objects.filter(pk=allocation.pk, cancel_requested_at__isnull=True).update(
            cancel_requested_at=now)
        transaction.on_commit(lambda: _cancel_later(allocation.pk))


def excluded_nodes(*, exclude: list[str]) -> list[str]:
    """Slurm nodes Nightwatch keeps out (drained, draining, a lemon, unusable): ``--exclude``, so
    that Slurm never places on them even before the mirror has copied the drain into Slurm."""
    lemon = LemonPolicy.current().incidents
    out = Node.objects.filter(transport=Transport.SLURM).exclude(
        schedulability=Schedulability.ACTIVE, health__in=Health.USABLE, lemon_count__lt=lemon)
    return sorted(set(out.values_list("hostname", flat=True)) - set(exclude))


def _submit_later(allocation_id: int) -> None:
    # Deferred: nodes.tasks imports this module (its tasks run submit and cancel), a cycle at import.
    from nodes.tasks import submit_slurm_job

    submit_slurm_job.delay(allocation_id)


def _cancel_later(allocation_id: int) -> None:
    # Deferred: nodes.tasks imports this module (its tasks run submit and cancel), a cycle at import.
    from nodes.tasks import cancel_slurm_job

    cancel_slurm_job.delay(allocation_id)


def log_dir() -> Path:
    return Path(settings.NIGHTWATCH["SLURM"]["LOG_DIR"])


def submit(allocation_id: int, slurm: Slurm | None = None) -> bool:
    """``sbatch`` the allocation if it still waits for it; returns whether it is in Slurm now.

    A generation the job has left, or one whose stop was requested before it was submitted, is
    not submitted: it ends at once with a requested stop, which confirms it for the orchestrator.
    """
    slurm = slurm or Slurm.from_settings()
    with transaction.atomic():
        allocation = (SlurmAllocation.objects.select_for_update(skip_locked=True).select_related("job")
                      .filter(pk=allocation_id, state=SlurmAllocationState.SUBMITTING).first())
        if allocation is None:
            return False
        if allocation.cancel_requested_at or allocation.job.generation != allocation.generation:
            report_ended(allocation, state="CANCELLED", exit_status=None, exit_signal=None, requested_stop=True,
                         note="stopped before it was submitted to Slurm")
            return False
        try:
            existing = slurm.job_ids_named(allocation.job_name)
            job_id = existing[-1] if existing else _sbatch(allocation, slurm)
        except SlurmRefused as exc:
            # Slurm will say the same next time: the generation ends as a failed launch, and the
            # orchestrator's policy decides (a restart; the same refusal twice pauses the job).
            _record(exc, allocation)
            report_ended(allocation, state="REFUSED", exit_status=None, exit_signal=None, requested_stop=False,
                         note=str(exc), signature="slurm_refused", error_line=str(exc)[:1000])
            return False
        except SlurmError as exc:
            SlurmAllocation.objects.filter(pk=allocation.pk).update(last_error=str(exc)[:2000])
            _record(exc, allocation)
            return False
        now = timezone.now()
        SlurmAllocation.objects.filter(pk=allocation.pk).update(
            state=SlurmAllocationState.QUEUED, slurm_job_id=job_id, submitted_at=now, last_error="")
        record_event(EventKind.SLURM_SUBMIT, actor=ACTOR, job=allocation.job_id,
                     generation=allocation.generation, new_state="queued",
                     reason=f"Slurm job {job_id} ({allocation.job_name}) on {','.join(allocation.hostnames)}",
                     evidence={"slurm_job_id": job_id, "adopted": bool(existing), "excluded": allocation.excluded})
    controller.record_ok()
    log.info("job %s generation %s submitted as Slurm job %s", allocation.job_id, allocation.generation, job_id)
    return True


def _sbatch(allocation: SlurmAllocation, slurm: Slurm) -> int:
    """Render and submit; the hooks' token is issued here and reaches the job only through
    sbatch's environment (``--export``), never the script."""
    conf = settings.NIGHTWATCH["SLURM"]
    payload = wire.parse_command_payload(wire.Command(id="0", kind="launch", idempotency_key="slurm",
                                                      job=str(allocation.job_id), generation=allocation.generation,
                                                      payload=allocation.payload))
    directory = log_dir() / f"job-{allocation.job_id}"
    directory.mkdir(parents=True, exist_ok=True)
    output = directory / f"generation-{allocation.generation}.out"
    batch = script.render(
        job=str(allocation.job_id), generation=allocation.generation, payload=payload,
        hostnames=allocation.hostnames, excluded=allocation.excluded,
        python=conf["PYTHON"] or sys.executable, workdir=conf["WORKDIR"] or str(settings.BASE_DIR),
        output_path=str(output), spool_dir=str(directory / f"generation-{allocation.generation}-spool"),
        partition=conf["PARTITION"], extra_options=list(conf["SBATCH_ARGS"]))
    first = Node.objects.get(hostname=allocation.hostnames[0])
    if allocation.token_id:  # an earlier try that Slurm did not take
        ApiToken.objects.filter(pk=allocation.token_id, revoked_at__isnull=True).update(revoked_at=timezone.now())
    # A job token of this generation only (never the node's agent token): user code holds it, and it
    # is revoked when the generation ends.
    token, raw = ApiToken.issue(name=f"slurm {allocation.job_name}"[:100], scope=Scope.JOB, node=first,
                                job=allocation.job, generation=allocation.generation)
    SlurmAllocation.objects.filter(pk=allocation.pk).update(script=batch.script, output_path=str(output), token=token)
    return slurm.submit(batch.script, batch.options, env={"NIGHTWATCH_TOKEN": raw})


def cancel(allocation_id: int, slurm: Slurm | None = None) -> bool:
    """``scancel`` an allocation whose stop was requested; returns whether Slurm took it.

    Not yet submitted: ``submit`` ends it without Slurm. Slurm's answer (the job ended) is
    picked up by the watch one-shot, which confirms the stop."""
    slurm = slurm or Slurm.from_settings()
    allocation = SlurmAllocation.objects.filter(pk=allocation_id, cancel_requested_at__isnull=False,
                                                state__in=SlurmAllocationState.OPEN).first()
    if allocation is None:
        return False
    if allocation.state == SlurmAllocationState.SUBMITTING:
        return submit(allocation.pk, slurm)
    try:
        slurm.cancel(allocation.slurm_job_id)
    except SlurmError as exc:
        SlurmAllocation.objects.filter(pk=allocation.pk).update(last_error=str(exc)[:2000])
        _record(exc, allocation)
        return False
    SlurmAllocation.objects.filter(pk=allocation.pk, cancel_sent_at__isnull=True).update(cancel_sent_at=timezone.now())
    controller.record_ok()
    return True


def _record(exc: SlurmError, allocation: SlurmAllocation) -> None:
    if isinstance(exc, SlurmUnavailable):
        controller.record_failure(exc)
    else:
        log.error("job %s generation %s: Slurm refused: %s", allocation.job_id, allocation.generation, exc)
        record_event(EventKind.SLURM_REFUSED, actor=ACTOR, job=allocation.job_id,
                     generation=allocation.generation, reason=str(exc)[:2000],
                     evidence={"command": exc.command[:40]})
