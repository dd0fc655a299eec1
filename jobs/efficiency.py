"""A job's efficiency figures: MFU, GPU utilisation, downtime ratio and cost, from recorded facts.

``snapshot(job)`` returns plain numbers for the API, the dashboard and the metrics exporter
(``gauges``); the efficiency alerts (``alerts.efficiency``) page on them. They are jobs' figures,
so they live with the jobs app, below everything that reads them. The arithmetic is
``jobs.efficiency_math``; this module only gathers its inputs:

- parameters and FLOPs per token: the hooks' ``model`` event (``agents.hooks``), unless the job's
  ``EfficiencyTarget`` overrides FLOPs per token;
- tokens per step and step time: rank 0's step reports of the newest generation that trained
  (its last ``WINDOW_STEPS`` steps; every rank trains the same batch size, so the job's tokens
  per step are rank 0's times the world size; step time = median of rank 0's phase sums);
- peak: per node of that generation, ``labels['peak_tflops']`` (per accelerator), else the GPU
  table by NVML name, else — CPU jobs and nodes without GPUs — ``CPU_PEAK_TFLOPS``, times the
  job's processes per node;
- downtime ratio and cost: ``jobs.goodput.goodput_of``. Downtime is what faults cost in wall
  time (detection + restart + paused); cost spreads the price of the job's accelerators
  (``PoolPrice`` by ``Node.labels['pool']``, else the settings) over the whole goodput split.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, F, Max, OuterRef, Subquery, Sum
from django.db.models.fields.json import KT
from django.utils import timezone

from jobs import efficiency_math as math_
from jobs.goodput import goodput_of
from jobs.models import EfficiencyTarget, Generation, PoolPrice, StepMetric, TrainingEvent
from jobs.steps import recent_step_seconds
from nodes.models import GPU
from nodes.services import retention, rollup

#: Steps of the newest generation that make up "recent" throughput.
WINDOW_STEPS = 50
#: Fewer steps than this say nothing yet about a generation's speed.
MIN_STEPS = 5
#: Badput kinds that are downtime: the job was not training because of a fault.
DOWNTIME_KINDS = ("detection", "restart", "paused")


def settings_() -> dict:
    return settings.NIGHTWATCH["EFFICIENCY"]


def model_facts(job) -> dict:
    """Parameters and FLOPs per token as the hooks last reported them (``model`` event)."""
    event = TrainingEvent.objects.filter(job=job, kind="model").order_by("-generation", "-reported_at").first()
    return dict(event.detail) if event else {}


def throughput(job) -> tuple[int | None, math_.Throughput | None, int]:
    """(generation, recent throughput, steps in the window) of the newest generation with reports."""
    generation = StepMetric.objects.filter(job=job).aggregate(g=Max("generation"))["g"]
    if generation is None:
        return None, None, 0
    rows = StepMetric.objects.filter(job=job, generation=generation, rank=0)
    last = rows.aggregate(s=Max("step"))["s"]
    if last is None:
        return generation, None, 0
    window = rows.filter(step__gt=last - WINDOW_STEPS)
    steps = window.count()
    tokens = window.aggregate(t=Sum(F("tokens") * F("world_size")))["t"] or 0
    step_times = recent_step_seconds(job, generation=generation, limit=WINDOW_STEPS)
    if not steps or not step_times:
        return generation, None, steps
    return generation, math_.Throughput(tokens_per_step=tokens / steps, step_s=statistics.median(step_times)), steps


@dataclass(frozen=True)
class NodeFacts:
    """What peak and price need of a kind of node: its peak and pool labels, its first GPU's name
    (None: no GPU), and how many of the generation's nodes are of that kind."""

    peak_label: str | float | None  # the node's ``peak_tflops`` label (text on PostgreSQL)
    pool: str | None  # its ``pool`` label
    gpu_name: str | None
    count: int = 1


@dataclass(frozen=True)
class JobNodes:
    """The generation's nodes: their ids (for telemetry) and their kinds (for peak and price)."""

    pks: list[int]
    kinds: list[NodeFacts]


def _nodes_of(job, generation: int | None) -> JobNodes:
    """The generation's nodes grouped by what peak and price depend on: a few rows however many
    nodes (a 512-node job is usually one kind), not a node and its GPUs at a time (node and GPU
    objects with every GPU's last reading took a 512-node job's page a second; their plain
    values, 15 ms)."""
    row = Generation.objects.filter(job=job, number=generation).first() if generation else None
    if row is None:
        row = Generation.objects.filter(job=job).order_by("-number").first()
    if row is None:
        return JobNodes([], [])
    nodes = row.nodes.order_by()
    first_gpu = GPU.objects.filter(node=OuterRef("pk")).order_by("index").values("name")[:1]
    kinds = (nodes.annotate(peak=KT("labels__peak_tflops"), pool=KT("labels__pool"), gpu=Subquery(first_gpu))
             .values("peak", "pool", "gpu").annotate(count=Count("pk")).order_by("peak", "pool", "gpu"))
    return JobNodes(list(nodes.values_list("pk", flat=True)),
                    [NodeFacts(kind["peak"], kind["pool"], kind["gpu"], kind["count"]) for kind in kinds])


def device_peak_tflops(job, node: NodeFacts) -> float | None:
    """Peak of one of ``node``'s accelerators for ``job``: the node's label, the GPU table, or the
    nominal CPU figure for CPU jobs and GPU-less nodes; None for a GPU not in the table."""
    if node.peak_label is not None:
        try:
            return float(node.peak_label)
        except (TypeError, ValueError):
            pass
    if job.accelerator == "cpu" or node.gpu_name is None:
        return float(settings_()["CPU_PEAK_TFLOPS"])
    return math_.peak_tflops_of(node.gpu_name)


def price_of(node: NodeFacts, prices: dict[str, float]) -> float:
    """A GPU-hour of ``node``: its pool's ``PoolPrice`` (``prices``, from ``pool_prices``), else
    the settings' price for the pool, else the default."""
    pool = node.pool
    if pool:
        if pool in prices:
            return prices[pool]
        if pool in settings_()["POOL_PRICES"]:
            return float(settings_()["POOL_PRICES"][pool])
    return float(settings_()["DEFAULT_PRICE_PER_GPU_HOUR"])


def pool_prices(nodes: list[NodeFacts]) -> dict[str, float]:
    """The ``PoolPrice`` rows of the pools ``nodes`` belong to, in one query."""
    pools = {node.pool for node in nodes} - {None}
    return {row.pool: float(row.price_per_gpu_hour) for row in PoolPrice.objects.filter(pool__in=pools)}


def gpu_utilization(job, node_ids: list[int]) -> float | None:
    """Mean GPU utilisation (percent) of the job's nodes over the recent window; None without samples."""
    now = timezone.now()
    since = now - timedelta(seconds=settings_()["UTILIZATION_WINDOW_S"])
    return rollup.mean_utilization(node_ids, since,
                                   raw_since=retention.retention().raw_cutoff(now))


def snapshot(job, goodput=None) -> dict:
    """Every efficiency figure of ``job`` as plain numbers (None where unknown). What the API
    shows and what a metrics exporter can publish as gauges. ``goodput``: the job's
    ``goodput_of`` result when the caller has it already (it is the expensive part)."""
    target = EfficiencyTarget.objects.filter(job=job).first()
    facts = model_facts(job)
    parameters = facts.get("parameters")
    fpt = math_.flops_per_token(parameters, (target.flops_per_token if target else None)
                                or facts.get("flops_per_token"))
    generation, speed, steps = throughput(job)
    nodes = _nodes_of(job, generation)
    kinds = nodes.kinds
    peaks = [device_peak_tflops(job, kind) for kind in kinds]
    # The nominal CPU figure makes the alerts work on CPU jobs, but an MFU or a GPU-hour cost of a
    # CPU job means nothing to a person: pages show them only where a GPU's peak is known.
    gpu_peak_known = (job.accelerator == "gpu" and bool(kinds)
                      and all(kind.gpu_name is not None or kind.peak_label is not None for kind in kinds)
                      and None not in peaks)
    peak_tflops = (sum(p * job.nproc_per_node * kind.count for p, kind in zip(peaks, kinds, strict=True))
                   if kinds and None not in peaks else None)
    mfu = (math_.mfu(speed, fpt, peak_tflops * 1e12)
           if speed and fpt and peak_tflops and steps >= MIN_STEPS else None)
    goodput = goodput if goodput is not None else goodput_of(job)
    badput = dict(goodput.badput_s)
    downtime_s = sum(badput.get(kind, 0.0) for kind in DOWNTIME_KINDS)
    prices = pool_prices(kinds)
    rate = math_.hourly_rate((job.nproc_per_node * kind.count, price_of(kind, prices)) for kind in kinds)
    cost = math_.cost(rate_per_hour=rate, wall_s=goodput.wall_s, productive_s=goodput.productive_s, badput_s=badput)
    margin = target.mfu_margin if target and target.mfu_margin is not None else settings_()["MFU_MARGIN"]
    return {
        "generation": generation,
        "parameters": parameters,
        "flops_per_token": fpt,
        "steps_in_window": steps,
        "tokens_per_step": speed.tokens_per_step if speed else None,
        "step_s": speed.step_s if speed else None,
        "tokens_per_s": speed.tokens_per_s if speed else None,
        "achieved_tflops": speed.tokens_per_s * fpt / 1e12 if speed and fpt else None,
        "peak_tflops": peak_tflops,
        "gpu_peak_known": gpu_peak_known,
        "mfu": mfu,
        "expected_mfu": target.expected_mfu if target else None,
        "mfu_margin": margin,
        "gpu_utilization_pct": gpu_utilization(job, nodes.pks) if job.accelerator == "gpu" else None,
        "wall_s": goodput.wall_s,
        "productive_s": goodput.productive_s,
        "ettr": goodput.ettr,
        "badput_s": badput,
        "downtime_s": downtime_s,
        "downtime_ratio": downtime_s / goodput.wall_s if goodput.wall_s > 0 else 0.0,
        "cost": {"currency": settings_()["CURRENCY"], "rate_per_hour": cost.rate_per_hour, "total": cost.total,
                 "productive": cost.productive, "wasted": cost.wasted, "wasted_total": cost.wasted_total},
    }


def gauges(job, figures: dict | None = None) -> dict[str, float]:
    """``snapshot`` flattened for a metrics exporter: name -> number, unknown figures left out.

    Per-kind figures are named ``<name>:<kind>`` (``cost_wasted:restart``, ``badput_s:paused``) so
    an exporter can turn the suffix into a label.
    """
    figures = figures if figures is not None else snapshot(job)
    flat: dict[str, float] = {}
    for name in ("mfu", "expected_mfu", "tokens_per_s", "step_s", "achieved_tflops", "peak_tflops",
                 "gpu_utilization_pct", "wall_s", "productive_s", "ettr", "downtime_s", "downtime_ratio"):
        if figures[name] is not None:
            flat[name] = float(figures[name])
    cost = figures["cost"]
    flat.update({"cost_total": cost["total"], "cost_productive": cost["productive"],
                 "cost_wasted_total": cost["wasted_total"], "cost_rate_per_hour": cost["rate_per_hour"]})
    flat.update({f"cost_wasted:{kind}": value for kind, value in cost["wasted"].items()})
    flat.update({f"badput_s:{kind}": value for kind, value in figures["badput_s"].items()})
    return flat
