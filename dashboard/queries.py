"""Read-only queries behind the dashboard's pages. Nothing here writes.

Each function returns the context of one page section; ``dashboard.sections`` renders them. The
query counts are bounded (one query per table per section, never one per row, except goodput,
which ``jobs.goodput.goodput_of`` computes per job for the jobs shown).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from datetime import timedelta

from django.db.models import Count, Max, Q
from django.utils import timezone

from checkpoints.models import Checkpoint
from checkpoints.services import lineage_tree
from core.models import Event
from dashboard.events import points_from_rows
from jobs import efficiency
from jobs.choices import IncidentState, JobState
from jobs.goodput import goodput_of
from jobs.models import Generation, Incident, Job, StepMetric
from nodes.choices import Health, Schedulability
from nodes.models import GPU, Node

#: The chart shows at most this many step reports (newest); older history is in the API.
CHART_ROWS = 6000
#: The rank-skew view covers the newest steps of the active generation.
SKEW_STEPS = 30
#: A rank whose step took this many times the median of its step is a straggler.
STRAGGLER_RATIO = 1.25
OVERVIEW_JOBS = 50
FEED_INCIDENTS = 20
TIMELINE_EVENTS = 60


# --- overview -------------------------------------------------------------------------------------

def overview_jobs() -> list[dict]:
    now = timezone.now()
    jobs = (Job.objects.annotate(last_checkpoint_at=Max("checkpoints__created_at"),
                                 open_incidents=Count("incidents", filter=Q(incidents__state=IncidentState.OPEN),
                                                      distinct=True))
            .order_by("-created_at")[:OVERVIEW_JOBS])
    rows = []
    for job in jobs:
        goodput = goodput_of(job, now=now)
        rows.append({"job": job, "ettr": goodput.ettr if goodput.wall_s > 0 else None,
                     "checkpoint_age": now - job.last_checkpoint_at if job.last_checkpoint_at else None})
    return rows


def cluster_health() -> dict:
    nodes = Counter(Node.objects.values_list("health", flat=True))
    schedulability = Counter(Node.objects.values_list("schedulability", flat=True))
    gpus = Counter(GPU.objects.values_list("health", flat=True))
    return {
        "nodes_total": sum(nodes.values()),
        "nodes_by_health": [(h.value, nodes.get(h.value, 0)) for h in Health],
        "nodes_by_schedulability": [(s.value, schedulability.get(s.value, 0)) for s in Schedulability],
        "gpus_total": sum(gpus.values()),
        "gpus_by_health": [(h.value, gpus.get(h.value, 0)) for h in Health],
    }


def incident_feed(job: Job | None = None) -> list[Incident]:
    incidents = Incident.objects.select_related("job").prefetch_related("nodes")
    if job is not None:
        incidents = incidents.filter(job=job)
    return [_with_timings(i) for i in incidents[:FEED_INCIDENTS]]


def _with_timings(incident: Incident) -> Incident:
    """Attach the recovery's phases as durations, for the incident cards."""
    marks = [("detect", incident.fault_at, incident.detected_at),
             ("quiesce", incident.detected_at, incident.quiesced_at),
             ("relaunch", incident.quiesced_at, incident.relaunched_at),
             ("first step", incident.relaunched_at, incident.first_step_at)]
    incident.timings = [(name, (end - start).total_seconds()) for name, start, end in marks if start and end]
    if incident.first_step_at:
        incident.timings.append(("total", (incident.first_step_at - (incident.fault_at or incident.detected_at))
                                 .total_seconds()))
    return incident


# --- one job --------------------------------------------------------------------------------------

def job_summary(job: Job) -> dict:
    goodput = goodput_of(job)
    last_checkpoint = Checkpoint.objects.filter(job=job).order_by("-created_at").first()
    return {"job": job, "goodput": goodput, "ettr": goodput.ettr if goodput.wall_s > 0 else None,
            "efficiency": efficiency.snapshot(job, goodput),
            "badput": sorted(((k, v) for k, v in goodput.badput_s.items() if v > 0), key=lambda kv: -kv[1]),
            "last_checkpoint": last_checkpoint,
            "checkpoint_age": timezone.now() - last_checkpoint.created_at if last_checkpoint else None}


def breaker(job: Job) -> dict | None:
    """The open breaker of a paused job: the reason, the incident that opened it and its evidence."""
    if job.state != JobState.PAUSED:
        return None
    incident = Incident.objects.filter(job=job, state=IncidentState.OPEN).order_by("-detected_at").first()
    return {"reason": job.pause_reason or (incident.classification if incident else "paused"),
            "incident": incident, "evidence": incident.evidence if incident else {}}


def chart(job: Job) -> dict:
    """Every point of the loss / gradient-norm chart and its markers (spikes and skipped steps are
    flags of the points; checkpoints and restarts are steps)."""
    rows = list(StepMetric.objects.filter(job=job).order_by("-pk")
                .only("generation", "rank", "step", "loss", "grad_norm", "spike", "skipped", "nan")[:CHART_ROWS])
    checkpoints = list(Checkpoint.objects.filter(job=job).order_by("step").values("pk", "step", "state"))
    restarts = list(Generation.objects.filter(job=job, number__gt=1, first_step__isnull=False)
                    .order_by("number").values("number", "first_step"))
    return {
        "job": job.pk,
        "points": [p.as_dict() for p in points_from_rows(rows)],
        "checkpoints": [{"step": c["step"], "state": c["state"], "id": c["pk"]} for c in checkpoints],
        "restarts": [{"step": g["first_step"], "generation": g["number"]} for g in restarts],
    }


def rank_skew(job: Job) -> dict:
    """Ranks × the newest steps of the active generation, each cell the rank's step time over the
    median of that step; and the phase breakdown per rank over the same steps."""
    newest = (StepMetric.objects.filter(job=job, generation=job.generation).order_by("-step")
              .values_list("step", flat=True).first())
    if newest is None:
        return {"steps": [], "ranks": [], "phases": [], "stragglers": []}
    rows = StepMetric.objects.filter(job=job, generation=job.generation, step__gt=newest - SKEW_STEPS) \
        .values_list("rank", "step", "phases")
    by_step: dict[int, dict[int, float]] = defaultdict(dict)
    phase_sums: dict[int, Counter] = defaultdict(Counter)
    for rank, step, phases in rows:
        if phases:
            by_step[step][rank] = sum(phases.values())
            phase_sums[rank].update(phases)
    steps = sorted(by_step)
    ranks = sorted({rank for per_rank in by_step.values() for rank in per_rank})
    medians = {step: statistics.median(per_rank.values()) for step, per_rank in by_step.items()}
    grid, stragglers = [], set()
    for rank in ranks:
        cells = []
        for step in steps:
            seconds = by_step[step].get(rank)
            ratio = seconds / medians[step] if seconds is not None and medians[step] > 0 else None
            slow = ratio is not None and ratio >= STRAGGLER_RATIO
            if slow:
                stragglers.add(rank)
            cells.append({"step": step, "seconds": seconds, "ratio": ratio, "slow": slow,
                          "shade": _shade(ratio)})
        grid.append({"rank": rank, "cells": cells, "straggler": rank in stragglers})
    names = sorted({name for sums in phase_sums.values() for name in sums})
    phases = []
    for rank in ranks:
        total = sum(phase_sums[rank].values()) or 1.0
        phases.append({"rank": rank, "parts": [{"name": n, "share": phase_sums[rank][n] / total,
                                                "seconds": phase_sums[rank][n] / max(len(steps), 1)}
                                               for n in names]})
    return {"steps": steps, "ranks": grid, "phases": phases, "phase_names": names, "stragglers": sorted(stragglers)}


def _shade(ratio: float | None) -> int:
    """0 (at or under the median) to 4 (a straggler): the heat-map colour class of a cell."""
    if ratio is None or ratio <= 1.05:
        return 0
    return 4 if ratio >= STRAGGLER_RATIO else 1 + int((ratio - 1.05) / 0.07)


def timeline(job: Job) -> list[Event]:
    events = list(Event.objects.filter(job=job).order_by("-created_at", "-pk")[:TIMELINE_EVENTS])
    return events


def lineage(job: Job):
    return lineage_tree(job)


# --- nodes ----------------------------------------------------------------------------------------

def nodes_grid() -> list[dict]:
    now = timezone.now()
    stale_after = timedelta(seconds=60)
    rows = []
    for node in Node.objects.prefetch_related("gpus").order_by("hostname"):
        gpus = []
        for gpu in node.gpus.all():
            sample = gpu.last_sample or {}
            gpus.append({"gpu": gpu, "temperature": sample.get("temperature_c"),
                         "xid_recent": sample.get("xid_recent") or 0, "xid_codes": sample.get("recent_xid_codes") or [],
                         "ecc_recent": sample.get("ecc_uncorrected_recent") or 0,
                         "stale": gpu.last_sample_at is None or now - gpu.last_sample_at > stale_after})
        rows.append({"node": node, "gpus": gpus,
                     "heartbeat_age": now - node.last_heartbeat_at if node.last_heartbeat_at else None})
    return rows
