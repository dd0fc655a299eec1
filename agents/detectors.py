"""Pure detection algorithms shared by the training hooks and the control plane.

Plain functions over plain numbers: no I/O, no torch, no Django, so the same decision is made
inside ``train.py`` and on the server, and each one is unit-tested with literal data.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

#: 1.4826 × MAD estimates the standard deviation of normally distributed data.
_MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class DetectionPolicy:
    """Every detector's thresholds, in one place (docs/detection.md explains each one and the figures
    ``python -m bench.detect`` measured with these defaults).

    The hooks judge loss spikes, level shifts, divergence and a drifting rank with it; the control
    plane judges stragglers with it. Pure Python, so both sides share it.
    """

    # -- loss spikes: judged once per step by each rank's hooks ---------------------------------
    #: Unflagged losses the robust baseline (median, MAD) is taken over.
    spike_window: int = 100
    #: The newest unflagged losses whose own spread also bounds the scale (a noisy stretch starts).
    spike_recent: int = 20
    #: Steps of history before a loss can be judged at all (warm-up).
    spike_min_history: int = 20
    #: Robust z-score a spike must exceed: (loss - median) / (1.4826 × MAD).
    spike_z: float = 7.0
    #: ...and its minimum size relative to the baseline median (+10 %): a z-score alone flags tiny
    #: wobbles on a very smooth curve.
    spike_min_rel: float = 0.10
    #: Consecutive spiking steps that pause the job (a single spike pauses too unless the guard
    #: skipped its update or it is small: then it is a marker).
    spike_run_pause: int = 2
    #: A lone spike whose update was applied pauses only from this size over the baseline median
    #: (+15 %; + ``lr_grace_rel`` within an LR restart's grace); a smaller one is a marker. One step
    #: of +10-15 % is what a hard batch on rank 0, a fresh level shift or a noisy stretch's first
    #: steps reach with their noise; a real spike that small and that short did little harm.
    spike_pause_rel: float = 0.15
    # -- the LR schedule (the hooks read the optimizer's LR every step) ---------------------------
    #: The LR rising by this factor from one step to the next is a restart (or warm-up): expected.
    lr_jump: float = 1.3
    #: For this many steps after such a jump the loss may bump: spikes need ``lr_grace_rel`` more,
    #: and neither level shifts nor divergence are judged.
    lr_grace_steps: int = 150
    lr_grace_rel: float = 0.05
    # -- level shifts (a data-mix change): re-baselined, reported once as a marker -------------
    #: Recent unflagged steps compared with the older part of the baseline window.
    shift_window: int = 30
    #: Relative rise of the recent median that is a level shift...
    shift_min_rel: float = 0.02
    #: ...provided the recent steps are flat (their halves differ by less than this part of the rise).
    shift_flatness: float = 0.35
    # -- slow divergence: a trend test over a long window ------------------------------------
    #: Steps per block; the trend is judged on block medians.
    divergence_block: int = 25
    #: Rise of the newest block over the lowest block since the last re-baseline (+6 %)...
    divergence_rel: float = 0.06
    #: ...and still rising: up by this much over each of the last two spans of ``divergence_lookback`` blocks...
    divergence_still_rising: float = 0.01
    divergence_lookback: int = 3
    #: ...and over its last two blocks (a step change inside the middle span rises over both spans,
    #: but is flat after it).
    divergence_recent_rise: float = 0.005
    # -- a rank whose loss drifts from the others (judged at each cross-rank exchange) ----------
    #: Relative distance of a rank's mean loss over the exchange window from the other ranks' median.
    rank_drift_rel: float = 0.02
    #: Consecutive exchanges the same rank must stay that far off...
    rank_drift_hold: int = 3
    #: ...unless it is this far off (then one exchange is enough).
    rank_drift_now: float = 0.08
    #: Both bars widen with the job's own noise, from this many ranks on: the hold's bar to this many
    #: times the noise, the at-once bar to ``rank_drift_now_noise_k`` times. The noise is the median
    #: over ranks of each rank's drift (one bad rank among four or more does not move it), this
    #: exchange's or the median of the last ``rank_drift_noise_window`` exchanges', whichever is larger
    #: (noise grows as a loss falls: an estimate that only looks back lags behind it).
    rank_drift_noise_k: float = 3.0
    rank_drift_now_noise_k: float = 8.0
    rank_drift_noise_window: int = 10
    rank_drift_noise_ranks: int = 4
    # -- stragglers: judged by the control plane over the node windows -----------------------
    #: A rank's phase (compute, communication, input) over the job's median of that phase, as the
    #: extra seconds it costs relative to the job's median step (+2.5 %).
    straggler_ratio: float = 1.025
    #: Exchange windows (of ``GuardSettings.check_every`` steps) judged together...
    straggler_windows: int = 8
    #: ...of which the same rank must be that slow, in the same phase, in at least this many (a small
    #: straggler is not its node's slowest rank in every window: its peers' offsets and jitter).
    straggler_hold: int = 4
    #: A window whose job-wide median step is this many times the running median is a whole-job
    #: stall (a checkpoint): it neither counts nor breaks a hold.
    straggler_stall_ratio: float = 1.3
    #: Restarting on a spare costs about this long (checkpoint, relaunch, first step).
    straggler_restart_cost_s: float = 300.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"DetectionPolicy.{f.name} must be positive")


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


# -- loss: robust baseline, spikes, level shifts, divergence ----------------------------------

@dataclass(frozen=True)
class Baseline:
    """A robust view of recent losses: the median and 1.4826 × MAD (floored, see below)."""

    median: float
    scale: float

    def score(self, loss: float) -> float:
        return (loss - self.median) / self.scale

    def rel(self, loss: float) -> float:
        return loss / self.median - 1.0 if self.median > 0 else math.inf


def robust_baseline(values: Sequence[float], *, recent: int = 0) -> Baseline:
    """Median and robust scale of ``values`` (not empty, oldest first). The scale is the larger of
    the MAD of all values and the spread of the newest ``recent`` ones (from their differences),
    so that the start of a noisy stretch widens it at once. It is floored at 1e-3 × |median| (and
    1e-12) so a perfectly flat window does not turn a tiny wobble into an infinite score."""
    median = statistics.median(values)
    mad = statistics.median(abs(x - median) for x in values)
    if 0 < recent < len(values):
        # Differences of neighbours: a rise inside the tail (a broad spike building up) does not
        # widen it, noise does. MAD(diff) / sqrt(2) estimates the same spread as the MAD.
        tail = list(values)[-recent - 1:]
        diffs = [b - a for a, b in zip(tail, tail[1:], strict=False)]
        mad = max(mad, statistics.median(abs(d) for d in diffs) / math.sqrt(2.0))
    return Baseline(median, _MAD_TO_SIGMA * max(mad, 1e-3 * abs(median), 1e-12))


def spike_threshold(baseline: Baseline, policy: DetectionPolicy, *, in_grace: bool) -> float:
    """The loss above which a step is a spike: both ``spike_z`` robust deviations and
    ``spike_min_rel`` (more within an LR restart's grace) above the baseline median."""
    rel = policy.spike_min_rel + (policy.lr_grace_rel if in_grace else 0.0)
    return max(baseline.median + policy.spike_z * baseline.scale, baseline.median * (1.0 + rel))


def level_shift(recent: Sequence[float], older: Sequence[float], policy: DetectionPolicy) -> float | None:
    """The relative size of a step change that stayed, or None.

    ``recent`` (the newest unflagged losses) sits above ``older`` by at least ``shift_min_rel`` and
    is flat: its two halves differ by less than ``shift_flatness`` × the rise. A slow rise
    (divergence) is not flat; noise is not that large.
    """
    if len(recent) < 4 or not older:
        return None
    base = statistics.median(older)
    if base <= 0:
        return None
    rise = statistics.median(recent) / base - 1.0
    half = len(recent) // 2
    drift = abs(statistics.median(recent[half:]) - statistics.median(recent[:half])) / base
    if rise >= policy.shift_min_rel and drift < policy.shift_flatness * rise:
        return rise
    return None


def divergence(blocks: Sequence[float], policy: DetectionPolicy) -> tuple[int, float] | None:
    """(index of the lowest block, rise) when the loss has been rising against its own baseline:
    the newest block median is ``divergence_rel`` above the lowest since the last re-baseline, it
    rose over each of the last two spans of ``divergence_lookback`` blocks (by
    ``divergence_still_rising``) and over its last two blocks (``divergence_recent_rise``). A step
    change (a level shift) rises over one span only, or, inside the middle block, over both and is
    flat since; noise does not rise twice. None otherwise. ``blocks`` are block medians, oldest first."""
    lookback = policy.divergence_lookback
    if len(blocks) <= 2 * lookback:
        return None
    # The baseline is the lowest median of three neighbouring blocks: the lowest single block of a
    # noisy stretch sits below the level by its noise.
    smooth = [statistics.median(blocks[i:i + 3]) for i in range(len(blocks) - 2)]
    low = min(range(len(smooth)), key=smooth.__getitem__)
    if smooth[low] <= 0:
        return None
    rise = blocks[-1] / smooth[low] - 1.0
    step = 1.0 + policy.divergence_still_rising
    rising = (blocks[-1] > blocks[-1 - lookback] * step
              and blocks[-1 - lookback] > blocks[-1 - 2 * lookback] * step
              and blocks[-1] > blocks[-3] * (1.0 + policy.divergence_recent_rise))
    if rise >= policy.divergence_rel and rising:
        return low, rise
    return None


# -- a rank that drifts from the others ----------------------------------------------------

def rank_drift(means: Sequence[float]) -> list[float]:
    """Each rank's window-mean loss relative to the median of the *other* ranks' (0 = in line;
    inf for a non-finite mean). With two ranks each is measured against the other."""
    out = []
    for i, value in enumerate(means):
        others = [v for j, v in enumerate(means) if j != i and math.isfinite(v)]
        if not math.isfinite(value):
            out.append(math.inf)
        elif not others:
            out.append(0.0)
        else:
            ref = statistics.median(others)
            out.append(value / ref - 1.0 if ref > 0 else 0.0)
    return out


# -- stragglers -------------------------------------------------------------------------------

#: The step phases a straggler is judged on, and what each means in words. The checkpoint phase is
#: a whole-job stall by nature and never counts.
STRAGGLER_PHASES = {"compute": "compute", "optimizer": "communication", "input": "input"}


@dataclass(frozen=True)
class WindowFigures:
    """One node's figures in one exchange window (what ``NodeWindow`` carries)."""

    node: int
    ranks: int
    step_median_s: float
    slowest_rank: int
    slowest_s: float
    slowest_phases: Mapping[str, float]
    phases: Mapping[str, float]


@dataclass(frozen=True)
class Straggler:
    rank: int
    node: int
    phase: str  # a key of STRAGGLER_PHASES
    ratio: float  # the rank's step time over the job's median step time
    lost_fraction: float  # throughput the whole job loses to it: 1 - 1 / ratio
    windows: int  # consecutive windows it was seen in


def node_excess(window: Sequence[WindowFigures]) -> dict[int, tuple[int, dict[str, float]]]:
    """Per node of one exchange window: its slowest rank and, phase by phase, the extra seconds of
    that rank's phase over its peers', as a part of the peers' median step (0.05: the phase costs
    5 % of a step more than usual): ``{node: (rank, {phase: excess})}``.

    The peers are the other nodes (each node's mean phase; the median over them) and the rest of
    its own node (from the node's mean, when it has other ranks), so a one-node job works.

    Each node's peers are all the other nodes, so each median leaves one node out: it is read off
    the window's sorted values (``_LeaveOneOut``), O(n log n) a window, not O(n²) (512 nodes: 6 s
    of a Celery worker per straggler check, issue 18).
    """
    out: dict[int, tuple[int, dict[str, float]]] = {}
    if len(window) >= 2:
        # The other nodes' slowest ranks: each was chosen for being its node's slowest, so each
        # carries the same upward pick of its node's noise as this one (a node's mean does not).
        steps = _LeaveOneOut([sum(w.slowest_phases.values()) for w in window])
        phases = {phase: _LeaveOneOut([w.slowest_phases.get(phase, 0.0) for w in window])
                  for phase in STRAGGLER_PHASES}
        for i, figures in enumerate(window):
            step = steps.median_without(i)
            if step <= 0:
                continue
            out[figures.node] = (figures.slowest_rank, {
                phase: (figures.slowest_phases.get(phase, 0.0) - phases[phase].median_without(i)) / step
                for phase in STRAGGLER_PHASES})
        return out
    for figures in window:
        if figures.ranks < 2:
            continue
        # One node: the rest of it, from the node's mean.
        n = figures.ranks
        peer = {p: (n * figures.phases.get(p, 0.0) - figures.slowest_phases.get(p, 0.0)) / (n - 1)
                for p in figures.phases}
        step = sum(peer.values())
        if step <= 0:
            continue
        out[figures.node] = (figures.slowest_rank, {
            phase: (figures.slowest_phases.get(phase, 0.0) - peer.get(phase, 0.0)) / step
            for phase in STRAGGLER_PHASES})
    return out


class _LeaveOneOut:
    """The median of ``values`` with the ``i``-th left out, for every ``i``, from one sort: the same
    float as ``statistics.median`` of the rest (the middle one, or the mean of the middle two)."""

    def __init__(self, values: Sequence[float]):
        self.values = values
        self.sorted = sorted(values)

    def median_without(self, i: int) -> float:
        s = self.sorted
        gone = bisect.bisect_left(s, self.values[i])  # equal values are interchangeable

        def rest(k: int) -> float:
            return s[k] if k < gone else s[k + 1]

        n = len(s) - 1
        if n % 2:
            return rest(n // 2)
        return (rest(n // 2 - 1) + rest(n // 2)) / 2


def _pick_phase(excess: Mapping[str, float], bar: float) -> tuple[str, float] | None:
    """The phase a rank is slow in (``excess`` at least ``bar``), own work first: under DDP the peers
    of a slow rank wait for it in the all-reduce, which shows as *their* communication, as large as
    its own extra work. Communication is named only when no own work explains half of it."""
    own = max(((p, e) for p, e in excess.items() if p != "optimizer"), key=lambda pe: pe[1], default=None)
    comm = excess.get("optimizer", 0.0)
    if own is not None and own[1] >= bar and not (comm >= bar and own[1] < 0.5 * comm):
        return own
    if comm >= bar:
        return "optimizer", comm
    return None


def window_straggler(window: Sequence[WindowFigures], policy: DetectionPolicy) -> tuple[int, int, str, float] | None:
    """The slowest rank of one exchange window, when it is ``straggler_ratio`` slow there: (rank,
    node, phase, ratio), the largest such node's finding. One window is never enough to raise an
    incident (``find_straggler`` judges several); this is what one window shows (the bench, tests)."""
    bar = policy.straggler_ratio - 1.0
    best = None
    for node, (rank, excess) in node_excess(window).items():
        picked = _pick_phase(excess, bar)
        if picked is not None and (best is None or picked[1] + 1.0 > best[3]):
            best = (rank, node, picked[0], 1.0 + picked[1])
    return best


def find_straggler(windows: Sequence[Sequence[WindowFigures]], policy: DetectionPolicy) -> Straggler | None:
    """A rank that is its node's slowest, slow in the same phase by ``straggler_ratio``, in
    ``straggler_hold`` of the last ``straggler_windows`` judged windows (given oldest first); its
    ratio is the median over those windows (``node_excess``: against the other nodes' slowest
    ranks, so that the pick of each node's noisiest rank cancels out).

    Whole-job stalls are left out (the window's median step is ``straggler_stall_ratio`` above the
    median of all windows given): they neither count nor take a place among the windows judged. A
    one-step hiccup lifts one window of one rank; two in eight windows do not make the hold.
    """
    if not windows:
        return None
    steps = [statistics.median(w.step_median_s for w in window) for window in windows if window]
    if not steps:
        return None
    usual = statistics.median(steps)
    judged = [window for window in windows
              if window and statistics.median(w.step_median_s for w in window) <= policy.straggler_stall_ratio * usual]
    judged = judged[-policy.straggler_windows:]
    if len(judged) < policy.straggler_hold:
        return None
    bar = policy.straggler_ratio - 1.0
    # Each node's slowest rank, in each window where its phase is over the bar.
    seen: dict[tuple[int, int, str], list[float]] = {}
    for window in judged:
        for node, (rank, excess) in node_excess(window).items():
            picked = _pick_phase(excess, bar)
            if picked is not None:
                seen.setdefault((rank, node, picked[0]), []).append(picked[1])
    held = [(key, values) for key, values in seen.items() if len(values) >= policy.straggler_hold]
    if not held:
        return None
    (rank, node, phase), values = max(held, key=lambda item: (len(item[1]), statistics.median(item[1])))
    ratio = 1.0 + statistics.median(values)
    return Straggler(rank, node, phase, ratio, 1.0 - 1.0 / ratio, len(values))
