"""In-loop guard rails: the rolling state around the pure detectors in ``agents.detectors``.

- ``GradientGuard``: skip a step whose gradient norm is non-finite or above k × the median of
  the last W kept steps. Under DDP every rank holds the same all-reduced gradients, hence the
  same norm, history and decision, so the ranks skip together without a collective.
- ``LossWatch``: judge each step's loss once, as it happens: NaN, spikes (robust score and a
  minimum size), LR restarts, level shifts, slow divergence; the verdict says marker or pause.
- ``DriftWatch``: at each exchange, a rank whose mean loss drifts from the others' by a few per cent.
- ``SpreadWatch``: at each exchange, ranks whose mean losses disagree by more than half their mean,
  the same rank on the same side exchange after exchange (noise does not stay on one side).
- ``judge_consistency``: given every rank's (loss, gradient norm), flag a relative spread above
  the threshold, naming the rank farthest from the others.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agents import detectors


@dataclass(frozen=True)
class GuardSettings:
    """Thresholds of the guards; the defaults follow the reference notes (k=10, W=100)."""

    grad_k: float = 10.0
    grad_window: int = 100
    min_history: int = 10  # steps of history before the median rules are applied
    skip_bad_steps: bool = True  # False: report exploding/NaN steps but still apply them
    check_every: int = 10  # steps between cross-rank exchanges (consistency + control)
    spread_threshold: float = 0.5  # relative spread of loss or gradient norm that is flagged
    #: The loss spread is judged on the ranks' mean losses over the exchange window, and must stay
    #: above ``spread_threshold`` with the same rank on the same side for this many exchanges...
    spread_hold: int = 3
    #: ...unless it reaches this at once (with two ranks: one rank's loss 4× the other's).
    spread_now: float = 1.2
    #: Loss spikes, level shifts, divergence and a drifting rank (docs/detection.md).
    detection: detectors.DetectionPolicy = field(default_factory=detectors.DetectionPolicy)

    def __post_init__(self) -> None:
        for name in ("grad_window", "check_every", "spread_hold"):
            if getattr(self, name) < 1:
                raise ValueError(f"GuardSettings.{name} must be at least 1")


class GradientGuard:
    def __init__(self, settings: GuardSettings):
        self.settings = settings
        self._kept: deque[float] = deque(maxlen=settings.grad_window)

    def judge(self, grad_norm: float) -> detectors.GuardDecision:
        decision = detectors.grad_norm_guard(grad_norm, self._kept, k=self.settings.grad_k,
                                             min_history=self.settings.min_history)
        if not decision.skip:
            # Only kept steps shape the median, so a burst of explosions cannot raise the bar.
            self._kept.append(grad_norm)
        return decision


@dataclass(frozen=True)
class LossVerdict:
    """What the loss watch made of one step; ``action`` is "none", "marker" or "pause"."""

    kind: str | None = None  # "nan", "spike", "level_shift", "divergence" or None
    action: str = "none"
    reason: str = ""
    score: float | None = None  # robust z-score against the baseline
    baseline: float | None = None  # the baseline median
    threshold: float | None = None  # the loss above which a step is a spike
    consecutive: int = 0  # spiking steps in a row, this one included
    since_step: int | None = None  # divergence: the step the rise started from (roll back before it)
    rise: float | None = None  # level shift / divergence: relative size
    #: A pause that rests on this rank's own loss at one step (a lone spike whose update was
    #: applied): the hooks ask the other ranks whether they saw it too before it pauses anything
    #: (``Telemetry``: one rank's hard micro-batch is not the model's spike).
    alone: bool = False

    @property
    def spike(self) -> bool:
        return self.kind == "spike"

    def detail(self, loss: float) -> dict[str, Any]:
        """The event detail: what the detector saw (the dashboard explains markers with it)."""
        return {"loss": loss, "action": self.action, "score": self.score, "baseline": self.baseline,
                "threshold": self.threshold, "consecutive": self.consecutive, "since_step": self.since_step,
                "rise": self.rise, "reason": self.reason}


class LossWatch:
    """Judges every step's loss once, as it happens (``agents.detectors.DetectionPolicy``).

    - NaN/Inf: pause (as before).
    - A spike is a loss above both ``spike_z`` robust deviations and ``spike_min_rel`` over the
      median of the last ``spike_window`` *unflagged* losses (flagged steps never move the
      baseline). A lone spike whose update the gradient guard skipped, or one under
      ``spike_pause_rel``, is a marker; a run of ``spike_run_pause`` spikes, or a spike of at least
      ``spike_pause_rel`` whose update was applied, pauses (rollback proposed).
    - The LR the scheduler set is read every step: a jump (restart, warm-up) opens a grace period
      in which the loss may bump: spikes need more, and level shifts and divergence wait.
    - A step change that stays (flat, above the older baseline) is a level shift: the baseline
      restarts from the new level and one marker says so.
    - Divergence: block medians of ``divergence_block`` steps; the newest ``divergence_rel`` above
      the lowest since the last re-baseline and still rising pauses, proposing a rollback to before
      the lowest block.
    """

    def __init__(self, policy: detectors.DetectionPolicy, *, speaks_for_job: bool = True):
        self.policy = policy
        #: Rank 0 speaks for the job: its spikes and divergence may pause. Another rank's are markers
        #: only, since a loss that moves on one rank alone is that rank's problem, named by the
        #: cross-rank drift check, not a job-wide spike (NaN pauses from any rank).
        self.speaks_for_job = speaks_for_job
        self._window: deque[float] = deque(maxlen=policy.spike_window)
        self.consecutive = 0
        self._step = 0
        self._lr: float | None = None
        self._grace_until = 0
        self._blocks: list[tuple[int, float]] = []  # (first step, median) of complete blocks
        self._block: list[float] = []
        self._block_start = 1
        self._diverged = False
        self._window_sum = 0.0
        self._window_n = 0

    def observe(self, loss: float, *, lr: float | None = None, skipped: bool = False) -> LossVerdict:
        policy = self.policy
        self._step += 1
        self._watch_lr(lr)
        in_grace = self._step <= self._grace_until
        if not math.isfinite(loss):
            self.consecutive = 0
            return LossVerdict("nan", "pause", "non-finite loss")
        self._window_sum += loss
        self._window_n += 1
        verdict = LossVerdict()
        if len(self._window) >= policy.spike_min_history:
            base = detectors.robust_baseline(self._window, recent=policy.spike_recent)
            threshold = detectors.spike_threshold(base, policy, in_grace=in_grace)
            score = base.score(loss)
            if loss > threshold:
                self.consecutive += 1
                alone = False
                pause_rel = policy.spike_pause_rel + (policy.lr_grace_rel if in_grace else 0.0)
                if self.consecutive >= policy.spike_run_pause:
                    action, why = "pause", f"{self.consecutive} loss spikes in a row"
                elif skipped:
                    action, why = "marker", "loss spike; the guard skipped the update"
                elif base.rel(loss) < pause_rel:
                    action, why = "marker", f"a lone loss spike under {pause_rel:+.0%} (a run would pause)"
                else:
                    action, why = "pause", "loss spike the skip did not absorb (the update was applied)"
                    alone = True
                if action == "pause" and not self.speaks_for_job:
                    action, why = "marker", why + " (this rank only: a marker; rank 0 speaks for the job)"
                    alone = False
                verdict = LossVerdict("spike", action, why, score, base.median, threshold, self.consecutive,
                                      alone=alone)
                self._add_to_block(loss, in_grace)
                if self.consecutive >= policy.spike_window:  # a new level, not a spike: start again
                    self._window.clear()
                return verdict
            verdict = LossVerdict(score=score, baseline=base.median, threshold=threshold)
        self.consecutive = 0
        self._window.append(loss)
        if not in_grace:
            shift = self._level_shift()
            if shift is not None:
                recent = list(self._window)[-policy.shift_window:]
                self._window.clear()
                self._window.extend(recent)
                # The divergence test keeps its blocks: it tells a step from a rise by itself, and a
                # slow rise misread as a shift must not be forgotten.
                return LossVerdict("level_shift", "marker", f"loss level moved {shift:+.1%} and stayed: re-baselined",
                                   verdict.score, verdict.baseline, verdict.threshold, rise=shift)
        diverged = self._add_to_block(loss, in_grace)
        return diverged or verdict

    def take_window_mean(self) -> float:
        """The mean finite loss since the last call (NaN when there was none): the exchange's figure
        for the cross-rank drift check."""
        mean = self._window_sum / self._window_n if self._window_n else math.nan
        self._window_sum, self._window_n = 0.0, 0
        return mean

    def _watch_lr(self, lr: float | None) -> None:
        if lr is None or not math.isfinite(lr):
            return
        if self._lr is not None and self._lr > 0 and lr > self._lr * self.policy.lr_jump:
            self._grace_until = self._step + self.policy.lr_grace_steps
            self._blocks.clear()
            self._block.clear()
            self._diverged = False
        self._lr = lr

    def _level_shift(self) -> float | None:
        n = self.policy.shift_window
        if len(self._window) < 2 * n:
            return None
        values = list(self._window)
        # The steps just before against the newest: a ramp rises as much inside the newest steps
        # as between the two, a step does not.
        return detectors.level_shift(values[-n:], values[-2 * n:-n], self.policy)

    def _add_to_block(self, loss: float, in_grace: bool) -> LossVerdict | None:
        if in_grace:
            self._block.clear()
            self._block_start = self._step + 1
            return None
        if not self._block:
            self._block_start = self._step
        self._block.append(loss)
        if len(self._block) < self.policy.divergence_block:
            return None
        self._blocks.append((self._block_start, statistics.median(self._block)))
        self._block = []
        if self._diverged:
            return None
        found = detectors.divergence([m for _, m in self._blocks], self.policy)
        if found is None:
            return None
        low, rise = found
        self._diverged = True  # said once; a resume starts a new watch
        since = self._blocks[low][0]
        return LossVerdict("divergence", "pause" if self.speaks_for_job else "marker",
                           f"loss rising for {self._step - since} steps: {rise:+.1%} over its low at step {since}",
                           since_step=since, rise=rise)


class DriftWatch:
    """At each cross-rank exchange: is one rank's loss drifting from the others'?

    A rank whose mean loss over the window is ``rank_drift_rel`` off the other ranks' median, on
    the same side, for ``rank_drift_hold`` exchanges in a row (or ``rank_drift_now`` off at once)
    is named. From ``rank_drift_noise_ranks`` ranks on, both bars widen with the job's own noise:
    ranks that see small batches near convergence differ by 10 % and more when healthy (four CPU
    ranks of the quickstart's CNN: 54 of 64 exchanges flagged at the fixed bars, none with the noise).
    The same on every rank: every rank sees the same all-gathered figures.
    """

    def __init__(self, policy: detectors.DetectionPolicy):
        self.policy = policy
        self._side: tuple[int, bool] | None = None
        self._held = 0
        self._noise: deque[float] = deque(maxlen=policy.rank_drift_noise_window)

    def judge(self, means: list[float]) -> tuple[int, float] | None:
        """(rank, relative drift) once the drift is established, else None."""
        if len(means) < 2:
            return None
        drift = detectors.rank_drift(means)
        worst = max(range(len(drift)), key=lambda i: abs(drift[i]))
        size = abs(drift[worst])
        hold_bar, now_bar = self._bars(drift)
        if len(means) == 2 or size < hold_bar:
            # With two ranks a drift cannot say which one moved; the spread check still runs.
            self._side, self._held = None, 0
            return None
        side = (worst, drift[worst] > 0)
        self._held = self._held + 1 if side == self._side else 1
        self._side = side
        if self._held >= self.policy.rank_drift_hold or size >= now_bar:
            return worst, drift[worst]
        return None

    def noise(self) -> float | None:
        """The job's cross-rank noise as the bars use it (None before any, or with too few ranks)."""
        return max(self._noise[-1], statistics.median(self._noise)) if self._noise else None

    def _bars(self, drift: list[float]) -> tuple[float, float]:
        policy = self.policy
        finite = [abs(d) for d in drift if math.isfinite(d)]
        if len(drift) < policy.rank_drift_noise_ranks or len(finite) < policy.rank_drift_noise_ranks:
            return policy.rank_drift_rel, policy.rank_drift_now
        self._noise.append(statistics.median(finite))
        noise = self.noise() or 0.0
        return (max(policy.rank_drift_rel, policy.rank_drift_noise_k * noise),
                max(policy.rank_drift_now, policy.rank_drift_now_noise_k * noise))


@dataclass(frozen=True)
class Disagreement:
    """Ranks whose mean losses disagree for longer than noise would (``SpreadWatch.judge``)."""

    rank: int  # the rank farthest from the others' median (with two ranks the higher, either may be wrong)
    spread: float  # relative spread of the values judged
    held: int  # exchanges in a row over the bar with the same rank on the same side, this one included


class SpreadWatch:
    """At each cross-rank exchange: do the ranks' losses disagree by more than noise explains?

    Data-parallel ranks see different batches, so their losses differ; with small batches near
    convergence, by a lot. The quickstart's CNN on two ranks (4 samples a micro-batch, loss ≈ 0.03)
    had this step's losses spread over half their mean at 34 % of its exchanges, healthy. Two
    things tell a rank that computes something different from that noise:

    - averaging: the spread is taken of each rank's mean loss over the exchange window (4 % of the
      same exchanges over the bar), this step's losses only where a window mean is missing;
    - persistence: noise falls on either side of the others, a wrong rank stays on its side. The
      spread must exceed ``threshold`` with the same rank farthest from the others' median on the
      same side for ``hold`` exchanges in a row, or exceed ``now`` at once. Two-sided noise that
      crosses the bar 4 % of the time stays on one side for 3 exchanges about once in 60,000.

    The same on every rank: every rank judges the same all-gathered figures.
    """

    def __init__(self, threshold: float, *, hold: int, now: float):
        self.threshold, self.hold, self.now = threshold, hold, now
        self._side: tuple[int, bool] | None = None
        self._held = 0

    def judge(self, means: list[float], losses: list[float]) -> Disagreement | None:
        """The disagreement once established, else None. ``means``: each rank's mean loss over
        the window; ``losses``: this step's, judged instead when a mean is missing (NaN)."""
        values = means if all(math.isfinite(v) for v in means) else losses
        if len(values) < 2 or not all(math.isfinite(v) for v in values):  # a NaN is the NaN detector's
            self._side, self._held = None, 0
            return None
        spread = detectors.relative_spread(values)
        if spread <= self.threshold:
            self._side, self._held = None, 0
            return None
        # The rank farthest from the others' median; with two ranks, the higher one (either may be wrong).
        drift = detectors.rank_drift(values)
        rank = max(range(len(drift)), key=lambda i: abs(drift[i]))
        side = (rank, drift[rank] > 0)
        self._held = self._held + 1 if side == self._side else 1
        self._side = side
        if self._held >= self.hold or spread >= self.now:
            return Disagreement(rank, spread, self._held)
        return None


@dataclass(frozen=True)
class Consistency:
    inconsistent: bool
    losses: list[float]
    grad_norms: list[float]
    loss_spread: float
    grad_norm_spread: float
    suspect_rank: int | None
    drift: float | None = None  # the suspect's relative drift from the others (DriftWatch)


def judge_consistency(losses: list[float], grad_norms: list[float], threshold: float,
                      drift: tuple[int, float] | None = None, *,
                      disagreement: Disagreement | None | bool = True) -> Consistency:
    """Inconsistent when the gradient norms spread beyond ``threshold`` (after the all-reduce they
    should be identical, noise or not), when the losses disagree, or when ``drift``
    (``DriftWatch.judge``) names a rank drifting over the windows; the drift names the rank.

    ``disagreement``: what ``SpreadWatch.judge`` made of the losses (None: nothing established).
    ``True`` (the default) judges this step's losses alone, the spread against ``threshold`` at
    once: the rule before issue 21, kept for callers without the exchange's history.
    """
    # Non-finite values are the NaN detector's: it pauses on its own, with a rollback.
    loss_spread = detectors.relative_spread([v for v in losses if math.isfinite(v)] or [0.0])
    grad_spread = detectors.relative_spread([v for v in grad_norms if math.isfinite(v)] or [0.0])
    losses_disagree = loss_spread > threshold if disagreement is True else isinstance(disagreement, Disagreement)
    inconsistent = losses_disagree or grad_spread > threshold or drift is not None
    suspect = None
    if drift is not None:
        suspect = drift[0]
    elif isinstance(disagreement, Disagreement):
        suspect = disagreement.rank
    elif inconsistent:
        suspect = detectors.outlier_rank(losses if losses_disagree else grad_norms)
    return Consistency(inconsistent, losses, grad_norms, loss_spread, grad_spread, suspect,
                       drift[1] if drift is not None else None)
