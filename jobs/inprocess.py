"""In-process restarts, as the control plane records them.

A rank that crashed on a healthy node and was replaced inside its generation
(``agents.hooks.inprocess``) needs no decision here: the node did the restart before any verdict
could come, and the generation, the fencing token, is unchanged. What the control plane owes it is
the record: an incident, resolved at once, with the times and the lost steps goodput is computed
from (``jobs.goodput``), and the node blamed like any crash's: by the crash-lemon rule
(``jobs.orchestrator.blame_crashes``: crashes of several different jobs on one node), not as
hardware (``Incident.nodes``), which an exit report's crash does not name either. Its evidence comes from two
witnesses: the agent's ``rank_gone`` notice (the node, and when the agent saw the rank die) and the
hooks' ``resumed`` event of the next round (the step restored, the round, when the survivors saw
their collective break).

A rank the agent found stopped (state T) and killed so that it would be replaced
(``agents.supervisor.STOPPED_WORKER_KILL_S``; its notice carries ``stopped_s``) was hung, not
crashed: a hang incident, dated from when the agent first saw it stopped and detected when it
killed it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from core.events import EventKind, record_event
from core.text import clean_json, clip
from jobs import policy
from jobs.choices import Decision, IncidentKind, IncidentState, JobState
from jobs.models import Generation, Incident, Job, StepMetric, TrainingEvent
from jobs.orchestrator import blame_crashes
from nodes.models import AgentEventRecord

#: Where an in-process restart may still be recorded: the generation is live.
RECORDED_IN = JobState.ACTIVE
#: How much later than the round's break (rank 0's clock) a notice of the death that broke it may
#: be dated: the agent's watcher sees a death at most a watch tick after it
#: (``agents.supervisor._core.WATCH_TICK_S``, 0.25 s), doubled for the two nodes' clocks. A notice
#: dated later is of a later death (the replaced rank died again), not of this one.
NOTICE_LAG = timedelta(seconds=0.5)


def in_process_detail(event: TrainingEvent) -> dict | None:
    """The ``in_process`` detail of a ``resumed`` event (a dict), or None for an ordinary resume."""
    detail = (event.detail or {}).get("in_process") if event.kind == "resumed" else None
    return detail if isinstance(detail, dict) else None


def record_restart(event_id: int) -> Incident | None:
    """The incident of the in-process restart ``event_id`` (rank 0's ``resumed`` event) announced;
    None when it announced none, the generation is no longer the job's, or it was recorded before."""
    with transaction.atomic():
        event = TrainingEvent.objects.select_related("job").filter(pk=event_id).first()
        detail = in_process_detail(event) if event is not None else None
        if event is None or detail is None:
            return None
        job = Job.objects.select_for_update().get(pk=event.job_id)
        if job.generation != event.generation or job.state not in RECORDED_IN:
            return None
        if Incident.objects.filter(job=job, evidence__resumed_event=event.pk).exists():
            return None
        return _open_and_resolve(job, event, detail)


def _open_and_resolve(job: Job, event: TrainingEvent, detail: dict) -> Incident:
    now = timezone.now()
    failed_at = _epoch(detail.get("failed_at"))
    notice = _notice(job, event, failed_at or event.reported_at)
    fault_at = _died_at(notice) if notice else None
    fault_at = fault_at or failed_at or event.reported_at
    host = notice.node.hostname if notice else None
    restored = event.step
    reached = max(_reached(job, event) or 0, restored)
    round_number = int(detail.get("round") or 0)
    stopped_s = _stopped_s(notice)
    where = f"on {host} " if host else ""
    what = (f"was stopped (hung) for {stopped_s:.1f} s, killed by its agent," if stopped_s is not None
            else "crashed and")
    reason = (f"a rank {where}{what} was replaced in process: round {round_number} of the process group "
              f"resumed from step {restored}")
    detected_at = min(failed_at or event.reported_at, event.reported_at)
    if stopped_s is not None and fault_at is not None:  # found when the agent gave up on it
        detected_at = min(fault_at + timedelta(seconds=stopped_s), event.reported_at)
    incident = Incident.objects.create(
        job=job, generation=Generation.objects.filter(job=job, number=event.generation).first(),
        kind=IncidentKind.HANG if stopped_s is not None else IncidentKind.CRASH, classification=clip(reason, 200),
        decision=Decision.RESTART_IN_PROCESS,
        state=IncidentState.RESOLVED,
        evidence=clean_json({"signal": policy.IN_PROCESS_RESTART, "nodes": [host] if host else [],
                             "resumed_event": event.pk, "in_process": detail,
                             "rank_gone": notice.detail if notice else None,
                             "rank_gone_notice": notice.pk if notice else None, "reason": reason}),
        fault_at=fault_at, detected_at=detected_at,
        quiesced_at=failed_at, relaunched_at=event.reported_at, first_step_at=event.reported_at,
        resolved_at=now, lost_steps=max(0, reached - restored))
    evidence = {"incident": incident.pk, "decision": incident.decision}
    record_event(EventKind.INCIDENT_OPEN, actor=f"node:{host}" if host else "system", job=job,
                 generation=event.generation, reason=reason, evidence=evidence)
    record_event(EventKind.INCIDENT_RESOLVED, actor="system", job=job, generation=event.generation,
                 reason=f"round {round_number} resumed in process",
                 evidence={**evidence, "lost_steps": incident.lost_steps, "restored_step": restored})
    if host and incident.kind == IncidentKind.CRASH:  # a stopped rank's hang is no crash of the node's
        blame_crashes(incident, [host], actor=f"node:{host}")
    return incident


def _notice(job: Job, event: TrainingEvent, broke_at: datetime) -> AgentEventRecord | None:
    """The agent's ``rank_gone`` notice of the death this restart answered (the node, and when the
    agent saw the rank die), or None when it has not come in.

    1. Candidates: the generation's notices received before the resume, less those an earlier
       in-process restart of the generation was dated from. A notice that comes after its round's
       resume (the agent's batch held up) must not leave the previous death's notice to date
       the next restart: the time between the two would count as detection.
    2. Of those, the newest dated no later than the round broke (``broke_at``, + ``NOTICE_LAG``):
       when one flush carries the resumes of two rounds, the later death's notice is in already
       when the first round's is recorded. When none is (the nodes' clocks apart), the newest.
    """
    told = [pk for pk in Incident.objects.filter(job=job, generation__number=event.generation,
                                                 decision=Decision.RESTART_IN_PROCESS)
            .values_list("evidence__rank_gone_notice", flat=True) if isinstance(pk, int)]
    candidates = list(AgentEventRecord.objects.filter(job=job, generation=event.generation, kind="rank_gone",
                                                      received_at__lte=event.received_at)
                      .exclude(pk__in=told).select_related("node").order_by("received_at", "pk"))
    before = [n for n in candidates if _died_at(n) <= broke_at + NOTICE_LAG]
    if before:
        return max(before, key=lambda n: (_died_at(n), n.received_at, n.pk))
    return candidates[-1] if candidates else None


def _died_at(notice: AgentEventRecord) -> datetime:
    """When the agent saw the rank die (its clock); when it sent the notice, lacking that."""
    return _epoch((notice.detail or {}).get("at")) or notice.time


def _stopped_s(notice: AgentEventRecord | None) -> float | None:
    """How long the rank had been stopped when its agent killed it (``RankGone.stopped_s``); None: it died."""
    value = (notice.detail or {}).get("stopped_s") if notice is not None else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _reached(job: Job, event: TrainingEvent) -> int | None:
    """The newest step rank 0 trained before the restart: its reports stepped before the resume
    (the hooks' clock, the same as the event's). Not the job's last step: the reporter sends the
    ``resumed`` event with the next round's first steps, and those were not lost."""
    return (StepMetric.objects.filter(job=job, generation=event.generation, rank=0,
                                      reported_at__lt=event.reported_at)
            .aggregate(m=Max("step"))["m"])


def _epoch(value: object) -> datetime | None:
    if isinstance(value, int | float) and value > 0:
        return datetime.fromtimestamp(value, tz=UTC)
    return None
