"""The checkpoint interval from measured costs and failure rates (Young/Daly), pushed to "auto" jobs.

It lives in ``jobs``, above ``checkpoints``: it reads the job's incidents, step reports and state
as much as its checkpoints' save costs.

    interval = sqrt(2 × save cost × MTBF)        (agents.detectors.young_daly_interval)

Inputs, each shown with the answer:

- **save cost**: the median ``blocking_s`` of the job's recent commits, i.e. the time training
  actually stalls per save. With async saves most of the write happens in the background, so the
  blocking part is the cost; but a save cannot start before the previous one committed (the hooks
  wait, and that wait is counted as checkpoint time), so the interval is never shorter than the
  median ``total_s``.
- **MTBF**: from the job's incident history — failures of kind crash, hardware, hang or partition
  within the window (``NIGHTWATCH["MTBF_WINDOW_DAYS"]``, 30) — as exposure ÷ failures, the
  exposure being the part of the window the job existed. With no failure in the window (before
  there is history), the documented assumption: per-GPU MTBF (``NIGHTWATCH["GPU_MTBF_HOURS"]``,
  50,000 h) ÷ the job's GPU count (nnodes × nproc_per_node, one GPU per rank).
- **step time**: the median of recent steps' input + compute + optimizer phases (the checkpoint
  phase is left out: it is what the interval is trading against), to express the interval in
  steps.

``push_interval`` stores the steps in ``Job.recommended_interval_steps`` when the policy's
interval is "auto"; the hooks read it from ``GET /api/v1/jobs/{id}/control``
(``checkpoint_interval_steps``) and save that often from then on.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from agents.detectors import young_daly_interval
from checkpoints.models import Checkpoint
from checkpoints.policies import CheckpointPolicy
from core.events import EventKind, record_event
from jobs.choices import IncidentKind, JobState
from jobs.models import Incident, Job
from jobs.steps import recent_step_seconds

log = logging.getLogger(__name__)

FAILURE_KINDS = (IncidentKind.CRASH, IncidentKind.HARDWARE, IncidentKind.HANG, IncidentKind.PARTITION)
#: An assumption, not a measurement: datacenter GPUs are quoted at tens of thousands of hours
#: (the reference's own examples use 1,000 and 10,000 h for whole-server failure rates).
DEFAULT_GPU_MTBF_HOURS = 50_000
DEFAULT_MTBF_WINDOW_DAYS = 30
COST_SAMPLES = 20
STEP_SAMPLES = 500
#: A new recommendation replaces the pushed one only when it moves by more than this fraction,
#: so that noise in the medians does not rewrite the interval (and the audit log) every sweep.
CHANGE_THRESHOLD = 0.10
COMPUTE_PHASES = ("input", "compute", "optimizer")
#: Job states in which a generation is (about to be) training and polls the control endpoint.
PUSH_STATES = (JobState.INITIALIZING, JobState.RUNNING)


@dataclass(frozen=True)
class IntervalRecommendation:
    job: int
    computed_at: datetime
    save_cost_s: float | None  # median blocking seconds per save
    total_save_s: float | None  # median seconds from save start to commit
    cost_samples: int
    mtbf_s: float
    mtbf_source: str  # "incidents" or "assumed"
    failures: int
    exposure_s: float
    gpus: int
    gpu_mtbf_hours: float
    interval_s: float | None
    step_time_s: float | None
    step_samples: int
    interval_steps: int | None
    explanation: str

    def as_dict(self) -> dict:
        return asdict(self)


def recommend_interval(job: Job, *, now: datetime | None = None) -> IntervalRecommendation:
    """The Young/Daly interval for ``job`` with every input that went into it."""
    now = now or timezone.now()
    costs = list(Checkpoint.objects.filter(job=job, blocking_s__isnull=False)
                 .order_by("-created_at", "-pk").values_list("blocking_s", "total_s")[:COST_SAMPLES])
    save_cost = statistics.median(b for b, _ in costs) if costs else None
    totals = [t for _, t in costs if t is not None]
    total_save = statistics.median(totals) if totals else None

    gpu_mtbf_h = float(settings.NIGHTWATCH.get("GPU_MTBF_HOURS", DEFAULT_GPU_MTBF_HOURS))
    window = timedelta(days=float(settings.NIGHTWATCH.get("MTBF_WINDOW_DAYS", DEFAULT_MTBF_WINDOW_DAYS)))
    since = max(now - window, job.created_at)
    exposure_s = max((now - since).total_seconds(), 0.0)
    failures = Incident.objects.filter(job=job, kind__in=FAILURE_KINDS, detected_at__gte=since,
                                       detected_at__lte=now).count()
    gpus = max(1, job.nnodes * job.nproc_per_node)
    if failures and exposure_s > 0:
        mtbf_s, source = exposure_s / failures, "incidents"
        mtbf_words = f"{failures} failures in {exposure_s / 3600:.1f} h of history"
    else:
        mtbf_s, source = gpu_mtbf_h * 3600 / gpus, "assumed"
        mtbf_words = f"no failure in {exposure_s / 3600:.1f} h: assumed {gpu_mtbf_h:g} h per GPU / {gpus} GPUs"

    step_time, step_samples = _median_step_time(job)
    interval_s = steps = None
    if save_cost is None:
        explanation = "no measured save yet: no recommendation"
    else:
        interval_s = young_daly_interval(save_cost, mtbf_s)
        floor = ""
        if total_save is not None and interval_s < total_save:
            interval_s, floor = total_save, f", raised to the {total_save:.1f} s a save takes to commit"
        explanation = (f"sqrt(2 x {save_cost:.3g} s x {mtbf_s:.0f} s MTBF ({mtbf_words})) = {interval_s:.0f} s "
                       f"({interval_s / 60:.1f} min){floor}")
        if step_time:
            steps = max(1, round(interval_s / step_time))
            explanation += f" = {steps} steps of {step_time:.3g} s"
        else:
            explanation += "; no step times yet, so no interval in steps"
    return IntervalRecommendation(
        job=job.pk, computed_at=now, save_cost_s=save_cost, total_save_s=total_save, cost_samples=len(costs),
        mtbf_s=mtbf_s, mtbf_source=source, failures=failures, exposure_s=exposure_s, gpus=gpus,
        gpu_mtbf_hours=gpu_mtbf_h, interval_s=interval_s, step_time_s=step_time, step_samples=step_samples,
        interval_steps=steps, explanation=explanation,
    )


def _median_step_time(job: Job) -> tuple[float | None, int]:
    # Every rank's reports: more samples for the median of a synchronous job's step.
    times = [t for t in recent_step_seconds(job, limit=STEP_SAMPLES, phases=COMPUTE_PHASES, rank=None) if t > 0]
    return (statistics.median(times) if times else None), len(times)


def push_interval(job: Job, *, now: datetime | None = None, actor: str = "system:interval") -> bool:
    """Store the recommended interval (steps) on a job whose policy says "auto"; True if it changed."""
    if CheckpointPolicy.of(job).interval != "auto":
        return False
    recommendation = recommend_interval(job, now=now)
    new = recommendation.interval_steps
    current = job.recommended_interval_steps
    if new is None or (current and abs(new - current) <= CHANGE_THRESHOLD * current):
        return False
    # Compare-and-set: two sweeps racing must not both record a change.
    if not Job.objects.filter(pk=job.pk, recommended_interval_steps=current).update(recommended_interval_steps=new):
        return False
    job.recommended_interval_steps = new
    record_event(EventKind.CHECKPOINT_INTERVAL, actor=actor, job=job, generation=job.generation,
                 old_state=str(current or ""), new_state=str(new),
                 reason=f"checkpoint every {new} steps: {recommendation.explanation}",
                 evidence={k: (v.isoformat() if isinstance(v, datetime) else v)
                           for k, v in recommendation.as_dict().items()})
    return True


def push_intervals(*, now: datetime | None = None) -> int:
    """Beat: push the interval to every training job whose policy is "auto"; returns how many changed."""
    changed = 0
    for job in Job.objects.filter(state__in=PUSH_STATES, checkpoint_policy__interval="auto").order_by("pk"):
        try:
            changed += push_interval(job, now=now)
        except Exception:
            log.exception("could not push the checkpoint interval to job %s", job.pk)
    return changed

