"""Stragglers, judged by the control plane over the node windows it already stores.

Each report batch that brings node windows (``NodeWindow``: per node and exchange window, its ranks'
median step and its slowest rank's phases) re-reads the newest windows of the generation and asks
``agents.detectors.find_straggler``: is one rank slow in the same phase (compute, communication,
input) for ``straggler_hold`` windows in a row, whole-job stalls (checkpoints) left out? If so, and
no straggler incident names that rank in this generation yet, ``jobs.orchestrator.report_fault``
raises one with the node, rank, phase, ratio and the throughput lost; ``jobs.policy`` decides
between an alert and a restart on a spare.
"""

from __future__ import annotations

from itertools import groupby

from django.conf import settings

from agents.detectors import STRAGGLER_PHASES, DetectionPolicy, Straggler, WindowFigures, find_straggler
from core.models import Event
from jobs import orchestrator, policy
from jobs.choices import IncidentKind, JobState
from jobs.models import Generation, Incident, Job, NodeWindow

#: Windows read back per judgement: the hold plus room for stalls inside it.
LOOKBACK_WINDOWS = 3


def check_stragglers(job: Job, generation: int, detection: DetectionPolicy | None = None) -> Incident | None:
    """Judge the newest windows of ``generation``; raise the straggler incident once per rank."""
    if detection is None:
        ratio = settings.NIGHTWATCH.get("STRAGGLER_RATIO") or 0.0
        detection = DetectionPolicy(straggler_ratio=ratio) if ratio > 0 else DetectionPolicy()
    exchanges = list(NodeWindow.objects.filter(job=job, generation=generation)
                     .order_by("-last_step").values_list("last_step", flat=True).distinct()
                     [:LOOKBACK_WINDOWS * detection.straggler_windows])
    if len(exchanges) < detection.straggler_hold:
        return None
    rows = (NodeWindow.objects.filter(job=job, generation=generation, last_step__in=exchanges)
            .order_by("last_step", "node"))
    windows = [[_figures(w) for w in group] for _, group in groupby(rows, key=lambda w: w.last_step)]
    found = find_straggler(windows, detection)
    if found is None:
        return None
    if Incident.objects.filter(job=job, kind=IncidentKind.STRAGGLER, evidence__detail__generation=generation,
                               evidence__detail__rank=found.rank).exists():
        return None
    hostname = _hostname(job, generation, found.node)
    return orchestrator.report_fault(
        job.pk, policy.STRAGGLER, generation=generation, nodes=(hostname,) if hostname else (),
        detail=_detail(found, hostname, generation, exchanges[0]), lost_fraction=found.lost_fraction,
        restart_cost_s=detection.straggler_restart_cost_s)


def _figures(w: NodeWindow) -> WindowFigures:
    return WindowFigures(node=w.node, ranks=w.ranks, step_median_s=w.step_median_s, slowest_rank=w.slowest_rank,
                         slowest_s=w.slowest_s, slowest_phases=w.slowest_phases or {}, phases=w.phases or {})


def _detail(found: Straggler, hostname: str | None, generation: int, last_step: int) -> dict:
    return {"rank": found.rank, "node": found.node, "hostname": hostname, "generation": generation,
            "phase": STRAGGLER_PHASES[found.phase],
            "ratio": round(found.ratio, 4), "lost_throughput": round(found.lost_fraction, 4),
            "windows": found.windows, "last_step": last_step}


def _hostname(job: Job, generation: int, node_rank: int) -> str | None:
    """The host that ran torchrun node rank ``node_rank`` of the generation: the launch lists the
    nodes in node-rank order."""
    launch = (Event.objects.filter(job=job, new_state=JobState.INITIALIZING, evidence__has_key="nodes")
              .order_by("-created_at").first())
    names = list(launch.evidence.get("nodes") or []) if launch else []
    if 0 <= node_rank < len(names):
        return names[node_rank]
    hosts = list(Generation.objects.filter(job=job, number=generation).values_list("nodes__hostname", flat=True))
    return hosts[0] if len(hosts) == 1 and hosts[0] else None
