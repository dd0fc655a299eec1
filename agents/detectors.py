"""Pure detection algorithms shared by the training hooks and the control plane.

Plain functions over plain numbers: no I/O, no torch, no Django, so the same decision is made
inside ``train.py`` and on the server, and each one is unit-tested with literal data.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: 1.4826 × MAD estimates the standard deviation of normally distributed data.
_MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class GuardDecision:
    """Whether to skip an optimizer step, and why (``reason`` is None when the step is kept)."""

    skip: bool
    reason: str | None = None
    median: float | None = None


def grad_norm_guard(grad_norm: float, recent: Sequence[float], *, k: float = 10.0,
                    min_history: int = 10) -> GuardDecision:
    """Skip a step whose gradient norm is non-finite or above ``k`` × the median of ``recent``.

    ``recent`` holds the norms of the last W *kept* steps (the caller bounds it; W=100 by
    default in the hooks). Until ``min_history`` norms are known, only non-finite norms are
    skipped: a median of three early steps says little about what is normal.
    """
    if not math.isfinite(grad_norm):
        return GuardDecision(True, "non-finite gradient norm")
    if len(recent) < min_history:
        return GuardDecision(False)
    median = statistics.median(recent)
    if median > 0 and grad_norm > k * median:
        return GuardDecision(True, f"gradient norm {grad_norm:.4g} > {k:g} x median {median:.4g}", median)
    return GuardDecision(False, median=median)


def loss_spike_score(loss: float, recent: Sequence[float], *, min_history: int = 10) -> float | None:
    """A robust z-score of ``loss`` against the rolling window ``recent``; None while warming up.

    score = (loss - median) / (1.4826 × MAD), the median absolute deviation standing in for the
    standard deviation so that the spikes themselves do not inflate the yardstick the way they
    would a mean and variance. The MAD is floored at 1e-3 × |median| (and 1e-12) so a perfectly
    flat window does not turn a tiny wobble into an infinite score.
    """
    if len(recent) < min_history:
        return None
    if not math.isfinite(loss):
        return math.inf
    median = statistics.median(recent)
    mad = statistics.median(abs(x - median) for x in recent)
    scale = _MAD_TO_SIGMA * max(mad, 1e-3 * abs(median), 1e-12)
    return (loss - median) / scale


def is_loss_spike(loss: float, recent: Sequence[float], *, z_threshold: float = 6.0,
                  min_history: int = 10) -> bool:
    """True when ``loss`` sits more than ``z_threshold`` robust deviations *above* the window.

    Only upward moves count: a sudden drop in loss is not an incident.
    """
    score = loss_spike_score(loss, recent, min_history=min_history)
    return score is not None and score > z_threshold


def relative_spread(values: Sequence[float]) -> float:
    """(max - min) / |mean| across ranks; inf when any value is non-finite, 0 for one value.

    Data-parallel ranks see different batches, so their losses differ a little; gradient norms
    after the all-reduce should be identical. A large spread means a rank computes something
    different from its peers (silent data corruption, a bad GPU, a diverged replica).
    """
    if not values:
        raise ValueError("relative_spread needs at least one value")
    if not all(math.isfinite(v) for v in values):
        return math.inf
    mean = statistics.fmean(values)
    return (max(values) - min(values)) / (abs(mean) + 1e-12)


def outlier_rank(values: Sequence[float]) -> int:
    """Index of the value farthest from the median (non-finite values first): the rank to suspect.

    With two ranks both are equally far from the median and the first is returned; it takes a
    third rank to say which one is wrong.
    """
    finite = [v for v in values if math.isfinite(v)]
    median = statistics.median(finite) if finite else 0.0

    def distance(i: int) -> float:
        return abs(values[i] - median) if math.isfinite(values[i]) else math.inf

    return max(range(len(values)), key=distance)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def straggler_tail_ratios(step_times: Mapping[int, Sequence[float]]) -> dict[int, float]:
    """ρ_tail per rank = p99 of that rank's step times / median over ranks of their median step time.

    A synchronous job runs at the pace of its slowest rank, so a rank whose tail is far above the
    typical rank's median is costing everyone; ρ near 1 is healthy.
    """
    medians = [statistics.median(times) for times in step_times.values() if times]
    if not medians:
        return {}
    typical = statistics.median(medians)
    if typical <= 0:
        return {rank: math.inf for rank, times in step_times.items() if times}
    return {rank: percentile(times, 99) / typical for rank, times in step_times.items() if times}


def young_daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds) that minimises expected lost work: sqrt(2 × cost × MTBF).

    Example from the reference notes: a 5-minute save and a 10-hour MTBF give about 77 minutes.
    """
    if save_cost_s < 0 or mtbf_s <= 0:
        raise ValueError("save cost must be >= 0 and MTBF > 0")
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def young_daly_interval_steps(save_cost_s: float, mtbf_s: float, step_time_s: float) -> int:
    """The Young/Daly interval expressed in training steps (at least 1)."""
    if step_time_s <= 0:
        raise ValueError("step time must be > 0")
    return max(1, round(young_daly_interval(save_cost_s, mtbf_s) / step_time_s))
