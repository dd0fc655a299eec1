"""Stragglers, judged by the control plane over the node windows it already stores.

Each report batch that brings node windows (``NodeWindow``: per node and exchange window, its ranks'
median step and its slowest rank's phases) re-reads the newest windows of the generation and asks
``agents.detectors.find_straggler``: is one rank slow in the same phase (compute, communication,
input) for ``straggler_hold`` windows in a row, whole-job stalls (checkpoints) left out? If so, and
no straggler incident names that rank in this generation yet, ``jobs.orchestrator.report_fault``
raises one with the node, rank, phase, ratio and the throughput lost; ``jobs.policy`` decides
between an alert and a restart on a spare.

That decision weighs the time a restart saves over the rest of the job against its cost, so it needs
the job's remaining time (``remaining_time``): the steps left to the recovery policy's
``max_steps`` (the job's configured end) at the pace the job runs now (the median step of the
windows just judged, the straggler included: that is the pace the rest of the job would run at).
A job with no ``max_steps`` has no known end; then the time is unknown and the policy alerts. The
incident's detail says which it was and why (``remaining``).
"""

from __future__ import annotations

import statistics
from dataclasses import fields
from itertools import groupby

from django.conf import settings

from agents.detectors import STRAGGLER_PHASES, DetectionPolicy, Straggler, WindowFigures, find_straggler
from core.models import Event
from jobs import orchestrator, policy
from jobs.choices import IncidentKind, JobState
from jobs.models import Generation, Incident, Job, NodeWindow
from jobs.policies import RecoveryPolicy

#: Windows read back per judgement: the hold plus room for stalls inside it.
LOOKBACK_WINDOWS = 3
#: The bar for a CPU (gloo) job unless NIGHTWATCH_STRAGGLER_RATIO says otherwise: its ranks share
#: cores with everything else on the machine, and at the GPU default (+2.5 %) their noise alone was
#: named a straggler (CI: a "slow rank" incident in the disk-full e2e test). docs/detection.md.
CPU_STRAGGLER_RATIO = 1.25
#: ``WindowFigures``' fields, in its order: ``NodeWindow`` has a column of each name (not null).
_FIGURES = tuple(f.name for f in fields(WindowFigures))


def check_stragglers(job: Job, generation: int, detection: DetectionPolicy | None = None) -> Incident | None:
    """Judge the newest windows of ``generation``; raise the straggler incident once per rank."""
    if detection is None:
        ratio = settings.NIGHTWATCH.get("STRAGGLER_RATIO") or (CPU_STRAGGLER_RATIO if job.accelerator == "cpu" else 0.0)
        detection = DetectionPolicy(straggler_ratio=ratio) if ratio > 0 else DetectionPolicy()
    exchanges = list(NodeWindow.objects.filter(job=job, generation=generation)
                     .order_by("-last_step").values_list("last_step", flat=True).distinct()
                     [:LOOKBACK_WINDOWS * detection.straggler_windows])
    if len(exchanges) < detection.straggler_hold:
        return None
    # Tuples, not model instances: the 512-node job's check reads 24 windows x 512 rows.
    rows = (NodeWindow.objects.filter(job=job, generation=generation, last_step__in=exchanges)
            .order_by("last_step", "node").values_list("last_step", *_FIGURES))
    windows = [[WindowFigures(*row[1:]) for row in group]
               for _, group in groupby(rows, key=lambda row: row[0])]
    found = find_straggler(windows, detection)
    if found is None:
        return None
    if Incident.objects.filter(job=job, kind=IncidentKind.STRAGGLER, evidence__detail__generation=generation,
                               evidence__detail__rank=found.rank).exists():
        return None
    hostname = _hostname(job, generation, found.node)
    remaining_s, basis = remaining_time(job, windows)
    detail = {**_detail(found, hostname, generation, exchanges[0]),
              "remaining": {"remaining_s": remaining_s, "basis": basis}}
    return orchestrator.report_fault(
        job.pk, policy.STRAGGLER, generation=generation, nodes=(hostname,) if hostname else (),
        detail=detail, lost_fraction=found.lost_fraction, remaining_s=remaining_s,
        restart_cost_s=detection.straggler_restart_cost_s)


def remaining_time(job: Job, windows: list[list[WindowFigures]]) -> tuple[float | None, str]:
    """(seconds of training left or None, how that was found, in words).

    The steps left are the recovery policy's ``max_steps`` less the job's last step; the pace is
    the median over ``windows`` of each window's median step (whole-job stalls such as checkpoints
    are a minority of windows, so the median passes them by).
    """
    end = RecoveryPolicy.of(job).max_steps
    if end is None:
        return None, "unknown: the job has no max_steps in its recovery policy, so its end is not known"
    if job.last_step is None:
        return None, "unknown: the job has reported no step yet"
    steps = [statistics.median(w.step_median_s for w in window) for window in windows if window]
    if not steps:
        return None, "unknown: no step times measured yet"
    step_s = statistics.median(steps)
    left = max(0, end - job.last_step)
    return round(left * step_s, 1), (f"max_steps {end} - step {job.last_step} = {left} steps left x "
                                      f"{step_s:.3g} s a step (the median step over the last {len(steps)} windows, "
                                      "at the pace the job runs now)")


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
