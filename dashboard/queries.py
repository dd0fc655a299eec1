"""Read-only queries behind the dashboard's pages. Nothing here writes.

Each function returns the context of one page section; ``dashboard.sections`` renders them. The
query counts are bounded: one query per table per section, never one per row (the overview's
goodput too: ``jobs.goodput.goodputs_of``).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from datetime import datetime

from django.db.models import Count, Max, Q
from django.utils import timezone
from django.utils.safestring import mark_safe

from agents.protocol.hooks import PHASES
from checkpoints.models import Checkpoint
from core.events import EventKind
from core.models import Event
from dashboard.events import points_from_rows
from dashboard.templatetags import nightwatch as filters
from jobs import efficiency
from jobs.choices import IncidentState, JobState
from jobs.goodput import goodput_of, goodputs_of
from jobs.models import Generation, Incident, Job, NodeWindow, StepMetric, TrainingEvent
from nodes.choices import Health, Schedulability
from nodes.models import GPU, Node

#: The chart shows at most this many step reports (newest); older history is in the API.
CHART_ROWS = 6000
#: The skew view covers the newest timing windows of the active generation (a window is the steps
#: between two of the hooks' exchanges, 10 by default) and shows at most this many nodes, slowest first.
SKEW_WINDOWS = 12
SKEW_NODES = 32
NODE_WINDOWS = 60
#: A node whose slowest rank took this many times the window's median step is a straggler's node.
STRAGGLER_RATIO = 1.25
OVERVIEW_JOBS = 50
FEED_INCIDENTS = 20
TIMELINE_EVENTS = 60
#: How many of a job's newest events the timeline reads to fill its entries.
TIMELINE_SCAN = 400
#: Checkpoint activity that happens on its own, every interval: folded on the timeline. An operator's
#: checkpoint actions (pin, unpin, delete, restore from a replica) stay entries of their own.
ROUTINE = frozenset({EventKind.CHECKPOINT_COMMIT, EventKind.CHECKPOINT_VERIFY, EventKind.CHECKPOINT_INTERVAL,
                     EventKind.CHECKPOINT_REPLICA})


# --- overview -------------------------------------------------------------------------------------

def overview_jobs(*, now: datetime | None = None) -> list[dict]:
    now = now or timezone.now()
    jobs = list(Job.objects.annotate(last_checkpoint_at=Max("checkpoints__created_at"),
                                     open_incidents=Count("incidents", filter=Q(incidents__state=IncidentState.OPEN),
                                                          distinct=True))
                .order_by("-created_at")[:OVERVIEW_JOBS])
    goodputs = goodputs_of(jobs, now=now)
    rows = []
    for job in jobs:
        goodput = goodputs[job.pk]
        rows.append({"job": job, "ettr": goodput.ettr if goodput.wall_s > 0 else None,
                     "checkpoint_age": now - job.last_checkpoint_at if job.last_checkpoint_at else None})
    return rows


def cluster_health() -> dict:
    """Nodes by health and schedulability, GPUs by health: counted by the database."""
    nodes = _counts(Node.objects, "health")
    schedulability = _counts(Node.objects, "schedulability")
    gpus = _counts(GPU.objects, "health")
    return {
        "nodes_total": sum(nodes.values()),
        "nodes_by_health": [(h.value, nodes.get(h.value, 0)) for h in Health],
        "nodes_by_schedulability": [(s.value, schedulability.get(s.value, 0)) for s in Schedulability],
        "gpus_total": sum(gpus.values()),
        "gpus_by_health": [(h.value, gpus.get(h.value, 0)) for h in Health],
    }


def _counts(rows, field: str) -> Counter:
    return Counter(dict(rows.order_by().values_list(field).annotate(n=Count("pk"))))


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


#: The hooks' detector events the chart explains, at most this many (the newest).
DETECTION_KINDS = ("spike", "level_shift", "divergence")
DETECTION_ROWS = 200
DETECTION_FIELDS = ("action", "score", "baseline", "threshold", "rise", "since_step", "reason")


def chart(job: Job) -> dict:
    """Every point of the loss / gradient-norm chart and its markers (spikes and skipped steps are
    flags of the points; checkpoints and restarts are steps)."""
    rows = list(StepMetric.objects.filter(job=job).order_by("-pk")
                .only("generation", "rank", "step", "loss", "grad_norm", "spike", "skipped", "nan")[:CHART_ROWS])
    checkpoints = list(Checkpoint.objects.filter(job=job).order_by("step").values("pk", "step", "state"))
    restarts = list(Generation.objects.filter(job=job, number__gt=1, first_step__isnull=False)
                    .order_by("number").values("number", "first_step"))
    detections = list(TrainingEvent.objects.filter(job=job, kind__in=DETECTION_KINDS).order_by("-pk")
                      .values("step", "rank", "kind", "detail")[:DETECTION_ROWS])
    return {
        "job": job.pk,
        "points": [p.as_dict() for p in points_from_rows(rows)],
        "checkpoints": [{"step": c["step"], "state": c["state"], "id": c["pk"]} for c in checkpoints],
        "restarts": [{"step": g["first_step"], "generation": g["number"]} for g in restarts],
        # What each detector saw, so a marker explains itself (docs/detection.md).
        "detections": [{"step": d["step"], "rank": d["rank"], "kind": d["kind"],
                        **{k: d["detail"].get(k) for k in DETECTION_FIELDS}} for d in reversed(detections)],
    }


def rank_skew(job: Job) -> dict:
    """The active generation's nodes × its newest timing windows (``NodeWindow``): each cell the
    node's slowest rank's mean step over the window's median step (the median of the nodes'
    medians), the slowest ``SKEW_NODES`` nodes only; the phase breakdown of each shown node's
    slowest rank over the same windows, and of the whole job (every node) in the newest window.

    Reads ``SKEW_WINDOWS`` × nodes rows of numbers, however many ranks the job has; the phases
    (JSON) only of the shown nodes and of the newest window. Four queries.
    """
    # Unordered: the model's ordering starts with the job, a join to sort by its creation.
    windows = NodeWindow.objects.filter(job=job, generation=job.generation).order_by()
    newest = list(windows.order_by("-last_step").values_list("last_step", flat=True).distinct()[:SKEW_WINDOWS])
    if not newest:
        return {"steps": [], "nodes": [], "phases": [], "stragglers": [], "node_count": 0}
    rows = list(windows.filter(last_step__in=newest)
                .values_list("node", "last_step", "step_median_s", "slowest_rank", "slowest_s"))
    by_step: dict[int, list[float]] = defaultdict(list)
    by_node: dict[int, dict[int, tuple]] = defaultdict(dict)
    for row in rows:
        by_step[row[1]].append(row[2])
        by_node[row[0]][row[1]] = row
    medians = {step: statistics.median(values) for step, values in by_step.items()}
    steps = sorted(newest)

    def worst(node: int) -> float:
        return max(r[4] / medians[r[1]] if medians[r[1]] > 0 else 0.0 for r in by_node[node].values())

    shown = sorted(by_node, key=worst, reverse=True)[:SKEW_NODES]
    grid, stragglers = [], []
    for node in sorted(shown):
        cells = []
        for step in steps:
            row = by_node[node].get(step)
            ratio = row[4] / medians[step] if row is not None and medians[step] > 0 else None
            slow = ratio is not None and ratio >= STRAGGLER_RATIO
            cells.append({"step": step, "seconds": row[4] if row else None, "rank": row[3] if row else None,
                          "ratio": ratio, "slow": slow, "shade": _shade(ratio)})
        if any(cell["slow"] for cell in cells):
            stragglers.append(node)
        grid.append({"node": node, "cells": cells, "straggler": node in stragglers,
                     "rank": by_node[node][max(by_node[node])][3],
                     "html": mark_safe("".join(_skew_cell(cell) for cell in cells))})  # noqa: S308 - numbers only
    job_phases: Counter = Counter()
    newest_phases = list(windows.filter(last_step=newest[0]).values_list("phases", flat=True))
    for node_phases in newest_phases:
        job_phases.update(node_phases)
    slowest: dict[int, Counter] = defaultdict(Counter)
    for node, node_phases in windows.filter(last_step__in=newest, node__in=shown).values_list("node", "slowest_phases"):
        slowest[node].update(node_phases)
    names = [n for n in PHASES if n in job_phases or any(n in c for c in slowest.values())]
    phases = [_phase_row(f"job (mean rank, steps to {newest[0]})", job_phases, len(newest_phases), names)]
    for entry in grid:
        phases.append(_phase_row(f"node {entry['node']}: rank {entry['rank']}", slowest[entry["node"]],
                                 len(by_node[entry["node"]]), names))
    return {"steps": steps, "nodes": grid, "phases": phases, "phase_names": names, "stragglers": stragglers,
            "node_count": len(by_node)}


def node_windows(job: Job, node: int) -> list[dict]:
    """One node's newest windows in the job's active generation: its slowest rank in each, with
    that rank's phases in ``PHASES`` order (the skew view's cell, opened)."""
    rows = NodeWindow.objects.filter(job=job, generation=job.generation, node=node).order_by("-last_step")
    return [{"window": w, "phases": [w.slowest_phases.get(name) for name in PHASES]} for w in rows[:NODE_WINDOWS]]


def _phase_row(label: str, sums: Counter, windows: int, names: list[str]) -> dict:
    total = sum(sums[n] for n in names) or 1.0
    return {"label": label, "parts": [{"name": n, "share": sums[n] / total, "seconds": sums[n] / max(windows, 1)}
                                      for n in names]}


def _skew_cell(cell: dict) -> str:
    """A cell of the skew view as HTML built here, not by the template engine: a 512-node job's 384
    cells took it ~25 of the section's ~65 ms (``bench.pages``' fleet), and every step of a watched
    job renders the section again. Numbers only: nothing to escape."""
    if cell["ratio"] is None:
        return (f'<td class="heat heat-0" title="window ending at step {cell["step"]}: '
                f'no timings from this node"></td>')
    seconds, ratio = filters.short_duration(cell["seconds"]), filters.ratio(cell["ratio"])
    return (f'<td class="heat heat-{cell["shade"]}{" slow" if cell["slow"] else ""}" '
            f'title="window ending at step {cell["step"]}: rank {cell["rank"]} {seconds} per step ({ratio})">'
            f'{cell["ratio"]:.2f}</td>')


def _shade(ratio: float | None) -> int:
    """0 (at or under the median) to 4 (a straggler): the heat-map colour class of a cell."""
    if ratio is None or ratio <= 1.05:
        return 0
    return 4 if ratio >= STRAGGLER_RATIO else 1 + int((ratio - 1.05) / 0.07)


def timeline(job: Job, before: int | None = None) -> dict:
    """The job's newest events (older than event ``before`` for a later page), newest first, each
    run of routine checkpoint activity (commits, verifications, interval changes, replicas: two or
    more rows per checkpoint) folded into one entry; the folded rows come along for the page's
    "show checkpoint activity" toggle. ``older``: the ``before`` of the next page, if there is one."""
    events = Event.objects.filter(job=job)
    if before is not None:
        cursor = Event.objects.filter(job=job, pk=before).values_list("created_at", flat=True).first()
        if cursor is not None:
            events = events.filter(Q(created_at__lt=cursor) | Q(created_at=cursor, pk__lt=before))
    events = list(events.order_by("-created_at", "-pk")[:TIMELINE_SCAN])
    entries: list[dict] = []
    for event in events:
        if event.kind not in ROUTINE:
            entries.append({"event": event, "folded": []})
        elif entries and entries[-1]["event"] is None:
            entries[-1]["folded"].append(event)
        else:
            entries.append({"event": None, "folded": [event]})
    shown, rest = entries[:TIMELINE_EVENTS], entries[TIMELINE_EVENTS:]
    for entry in shown:
        steps = [e.evidence.get("step") for e in entry["folded"] if isinstance(e.evidence.get("step"), int)]
        entry["steps"] = (min(steps), max(steps)) if steps else None
    last = (shown[-1]["event"] or shown[-1]["folded"][-1]) if shown else None
    more = bool(rest) or len(events) == TIMELINE_SCAN
    return {"entries": shown, "older": last.pk if last is not None and more else None}

