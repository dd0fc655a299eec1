"""What the training hooks report (``POST /jobs/{id}/reports``) and what they are told (``/control``).

    batch ─▶ fence the generation ─▶ store new steps, node windows, events ─▶ progress (jobs.progress)
                                                                        └▶ flags (NaN, spike run, disagreement)
                                                                           ─▶ jobs.tasks.handle_flags ─▶ orchestrator

Rows grow with steps and nodes, not ranks: a step row is rank 0's, or another rank's flagged step
(the hooks send no others, and a report that is neither is counted and not stored), and timings
arrive one row per node and window (docs/architecture.md, "Step data").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

from django.db import transaction
from django.utils import timezone

from agents.protocol import hooks as hooks_protocol
from checkpoints.policies import CheckpointPolicy
from core.events import EventKind, record_event
from jobs import detection, inprocess, plausibility, progress, state
from jobs import windows as node_windows
from jobs.choices import JobState
from jobs.models import Generation, Job, NodeWindow, StepMetric, TrainingEvent
from jobs.policies import RecoveryPolicy
from jobs.tasks import check_stragglers, handle_flags, handle_save_failed


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicates: int  # already stored
    ignored: int  # not stored by design: another rank's step it did not flag


def record_reports(job: Job, batch: hooks_protocol.ReportBatch, *, actor: str) -> IngestResult:
    """Store a batch of step reports and hook events; advance the job's progress marks.

    1. Refuse a stale generation (the fencing token), and every generation of a job that ended;
       refuse the whole batch (``ReportsRefused``, 422) when a report is implausible for the job
       (``jobs.plausibility``), counted in a ``job.reports_refused`` event. Whole, not in part:
       nothing of a refused batch is written, and the hooks' reporter answers a refused batch by
       sending its records one at a time, so the plausible ones are stored and only the refused
       ones let go (``agents.hooks.reporter.Reporter._settle``).
    2. Insert what is new; (job, generation, rank, step), (job, generation, node, last_step,
       exchange time) and (job, generation, key) already stored are duplicates of a replay and are
       counted, not stored again. The node windows go in a transaction of their own, once the
       step reports and events are committed.
    3. Move the progress deadline, and mark the generation's first step (a generation that
       reports its first step is running); hand what the hooks flagged to the orchestrator.
    """
    state.check_live(job, batch.generation)
    _refuse_implausible(job, batch, actor=actor)
    now = timezone.now()
    with transaction.atomic():
        kept = [r for r in batch.reports if r.rank == 0 or _flagged(r)]
        reports = {(r.rank, r.step): r for r in kept}
        known = set(
            StepMetric.objects.filter(job=job, generation=batch.generation, step__in={s for _, s in reports})
            .values_list("rank", "step")
        )
        fresh = [r for key, r in reports.items() if key not in known]
        StepMetric.objects.bulk_create(
            [_step_metric(job, r, now) for r in fresh], ignore_conflicts=True, batch_size=500
        )
        events = {e.key: e for e in batch.events}
        known_keys = set(
            TrainingEvent.objects.filter(job=job, generation=batch.generation, key__in=list(events))
            .values_list("key", flat=True)
        )
        fresh_events = [e for key, e in events.items() if key not in known_keys]
        TrainingEvent.objects.bulk_create(
            [TrainingEvent(job=job, generation=e.generation, rank=e.rank, step=e.step, kind=e.kind, key=e.key,
                           message=e.message, detail=e.detail, reported_at=_utc(e.time), received_at=now)
             for e in fresh_events],
            ignore_conflicts=True,
        )
        if any(e.kind in progress.LOOP_STARTING_EVENTS for e in fresh_events):
            progress.end_startup(job, batch.generation, now)
        if fresh:
            newest = max(r.step for r in fresh)
            # The reporter's word on its newest step's age holds for the batch's newest report only, and
            # speaks for the job's progress only from rank 0 (another rank's batch holds flagged steps).
            ours = newest == max(r.step for r in batch.reports) and all(r.rank == 0 for r in batch.reports)
            age = batch.newest_step_age_s if ours else None
            progress.advance_progress(job, batch.generation, min(r.step for r in fresh), newest,
                                      now, actor=actor, stepped_at=_utc(max(r.time for r in fresh)), newest_age_s=age)
        _raise_flags(job, batch.generation, fresh, fresh_events)
        _report_failed_saves(job, batch.generation, fresh_events)
        _record_inprocess_restarts(job, batch.generation, fresh_events)
    if batch.windows:
        # Apart, after the step reports committed: rank 0 sends a window per node of the job (512
        # at 512 nodes) with the step of each exchange, and the step is what the dashboard shows
        # live and what the progress deadline waits for. Storing the windows is idempotent, so a
        # failure here (the request fails, the reporter resends the batch) loses nothing.
        with transaction.atomic():
            _store_windows(job, batch.windows, now)
            transaction.on_commit(lambda: check_stragglers.delay(job.pk, batch.generation))
    return IngestResult(accepted=len(fresh), duplicates=len(kept) - len(fresh),
                        ignored=len(batch.reports) - len(kept))


def _record_inprocess_restarts(job: Job, generation: int, fresh_events: list[hooks_protocol.Event]) -> None:
    """Rank 0's word that its ranks restarted in process (``jobs.inprocess``): an incident, after commit."""
    keys = [e.key for e in fresh_events if e.rank == 0 and e.kind == "resumed" and "in_process" in (e.detail or {})]
    if not keys:
        return
    stored = TrainingEvent.objects.filter(job=job, generation=generation, key__in=keys).values_list("pk", flat=True)
    for event_id in stored:
        transaction.on_commit(lambda event_id=event_id: inprocess.record_restart(event_id))


def _raise_flags(job: Job, generation: int, fresh: list[hooks_protocol.StepReport],
                 fresh_events: list[hooks_protocol.Event]) -> None:
    """Hand NaN, pausing spikes, divergence and cross-rank disagreements to the orchestrator (after
    commit). The hooks judged each step as it happened; ``jobs.detection`` reads their verdicts, so
    the batching cannot change the outcome."""
    flags = detection.judge_batch(fresh, fresh_events, spike_limit=RecoveryPolicy.of(job).loss_spike_limit)
    if flags.any:
        detail = None
        if flags.inconsistent:
            event = TrainingEvent.objects.filter(job=job, generation=generation, kind="inconsistency").last()
            detail = {"step": event.step, **event.detail} if event else {"note": "flagged by a step report"}
        spikes = int(flags.spike.get("consecutive") or 1) if flags.spike else 0
        transaction.on_commit(
            lambda: handle_flags.delay(job.pk, generation, nan=flags.nan, spikes=spikes, inconsistent=detail,
                                       spike=flags.spike, divergence=flags.divergence))


def _report_failed_saves(job: Job, generation: int, fresh_events: list[hooks_protocol.Event]) -> None:
    """A failed checkpoint save (the hooks trained on) becomes a ``checkpoint`` incident, after commit."""
    for e in fresh_events:
        if e.kind == "checkpoint_failed":
            failure = {**{k: v for k, v in e.detail.items() if k in ("path", "reason", "errno", "error", "peer_lost")},
                       "step": e.step, "rank": e.rank, "time": e.time}
            transaction.on_commit(lambda f=failure: handle_save_failed.delay(job.pk, generation, f))


# --- refusals (issue 24) ------------------------------------------------------------------------

class ReportsRefused(Exception):
    """A batch holding implausible reports; ``refusals`` says which and why. Nothing was stored."""

    def __init__(self, refusals: list[plausibility.Refusal]):
        self.refusals = refusals
        first = refusals[0]
        more = f" (and {len(refusals) - 1} more)" if len(refusals) > 1 else ""
        super().__init__(f"implausible step report refused: {first.detail}{more}")


def _refuse_implausible(job: Job, batch: hooks_protocol.ReportBatch, *, actor: str) -> None:
    """Raise ``ReportsRefused`` (after recording it) when a report of the batch is implausible."""
    if not batch.reports:
        return
    rp = RecoveryPolicy.of(job)
    first_step = min(r.step for r in batch.reports)
    earlier = (StepMetric.objects.filter(job=job, generation=batch.generation, rank=0, step__lt=first_step)
               .order_by("-step").values_list("step", "data_cursor").first())
    world_size = (Generation.objects.filter(job=job, number=batch.generation)
                  .values_list("world_size", flat=True).first())
    known = plausibility.Known(last_step=job.last_step, earlier=earlier, world_size=world_size,
                               max_steps=rp.max_steps, max_step_jump=rp.max_step_jump)
    refusals = plausibility.judge(batch.reports, known)
    if not refusals:
        return
    error = ReportsRefused(refusals)
    reasons: dict[str, int] = {}
    for refusal in refusals:
        reasons[refusal.reason] = reasons.get(refusal.reason, 0) + 1
    record_event(EventKind.JOB_REPORTS_REFUSED, actor=actor, job=job, generation=batch.generation,
                 reason=str(error), evidence={
                     "records": len(refusals), "reason": refusals[0].reason, "reasons": reasons,
                     "examples": [{"rank": r.rank, "step": r.step, "reason": r.reason, "detail": r.detail}
                                  for r in refusals[:5]]})
    raise error


def _flagged(report: hooks_protocol.StepReport) -> bool:
    return report.nan or report.spike or report.skipped or report.inconsistent or not math.isfinite(report.loss)


def _store_windows(job: Job, windows: list[hooks_protocol.NodeWindow], now: datetime) -> None:
    """Insert the node windows not stored yet (a replay's are skipped by the key), except those
    already past their retention (``jobs.windows``)."""
    oldest = node_windows.cutoff(now).timestamp()
    windows = [w for w in windows if w.time >= oldest]
    if windows:
        NodeWindow.objects.bulk_create(
            [NodeWindow(job=job, generation=w.generation, node=w.node, first_step=w.first_step,
                        last_step=w.last_step, ranks=w.ranks, step_median_s=w.step_median_s,
                        step_max_s=w.step_max_s, slowest_rank=w.slowest_rank, slowest_s=w.slowest_s,
                        slowest_phases=w.slowest_phases, phases=w.phases, reported_at=_utc(w.time),
                        received_at=now) for w in windows],
            ignore_conflicts=True, batch_size=500)


def _step_metric(job: Job, r: hooks_protocol.StepReport, now: datetime) -> StepMetric:
    finite = math.isfinite(r.loss)
    return StepMetric(
        job=job, generation=r.generation, rank=r.rank, step=r.step,
        loss=r.loss if finite else None,
        grad_norm=r.grad_norm if r.grad_norm is not None and math.isfinite(r.grad_norm) else None,
        world_size=r.world_size, data_cursor=r.data_cursor, samples=r.samples, tokens=r.tokens,
        phases=r.phases, skipped=r.skipped, spike=r.spike, nan=r.nan or not finite,
        inconsistent=r.inconsistent, reported_at=_utc(r.time), received_at=now,
    )


def _utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


def control_for(job: Job, generation: int) -> hooks_protocol.Control:
    """What a running generation should do next (polled by the hooks). Stale: an older generation,
    or any generation of a job that has ended (the hooks stop on it)."""
    policy = CheckpointPolicy.of(job)
    # auto: the Young/Daly recommendation once there is one; fixed: the policy's interval_steps when
    # the launch set it (None leaves the script's own checkpoint_every).
    interval = job.recommended_interval_steps if policy.interval == "auto" else policy.interval_steps
    return hooks_protocol.Control(
        generation=job.generation,
        stale=generation != job.generation or job.state in JobState.TERMINAL,
        checkpoint_now=job.checkpoint_requested_at is not None,
        pause=job.pause_requested_at is not None,
        checkpoint_interval_steps=interval,
    )
