"""In-loop guard rails: the rolling state around the pure detectors in ``agents.detectors``.

- ``GradientGuard``: skip a step whose gradient norm is non-finite or above k × the median of
  the last W kept steps. Under DDP every rank holds the same all-reduced gradients, hence the
  same norm, history and decision, so the ranks skip together without a collective.
- ``SpikeWatch``: flag a loss far above its rolling median (robust z-score); reported, not
  skipped, since the reference treats spikes as evidence for the circuit breaker.
- ``judge_consistency``: given every rank's (loss, gradient norm), flag a relative spread above
  the threshold, naming the rank farthest from the others.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from agents import detectors


@dataclass(frozen=True)
class GuardSettings:
    """Thresholds of the guards; the defaults follow the reference notes (k=10, W=100)."""

    grad_k: float = 10.0
    grad_window: int = 100
    min_history: int = 10  # steps of history before the median rules are applied
    skip_bad_steps: bool = True  # False: report exploding/NaN steps but still apply them
    spike_z: float = 6.0
    spike_window: int = 50
    check_every: int = 10  # steps between cross-rank exchanges (consistency + control)
    spread_threshold: float = 0.5  # relative spread of loss or gradient norm that is flagged

    def __post_init__(self) -> None:
        for name in ("grad_window", "spike_window", "check_every"):
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


class SpikeWatch:
    def __init__(self, settings: GuardSettings):
        self.settings = settings
        self._recent: deque[float] = deque(maxlen=settings.spike_window)
        self.consecutive = 0

    def observe(self, loss: float) -> tuple[bool, float | None]:
        """(is this loss a spike, its robust z-score or None while warming up)."""
        score = detectors.loss_spike_score(loss, self._recent, min_history=self.settings.min_history)
        spike = score is not None and score > self.settings.spike_z
        self.consecutive = self.consecutive + 1 if spike else 0
        if math.isfinite(loss):
            # Spikes stay in the window: if the loss level genuinely moved, the window follows
            # it instead of flagging every step from then on.
            self._recent.append(loss)
        return spike, score


@dataclass(frozen=True)
class Consistency:
    inconsistent: bool
    losses: list[float]
    grad_norms: list[float]
    loss_spread: float
    grad_norm_spread: float
    suspect_rank: int | None


def judge_consistency(losses: list[float], grad_norms: list[float], threshold: float) -> Consistency:
    loss_spread = detectors.relative_spread(losses)
    grad_spread = detectors.relative_spread(grad_norms)
    inconsistent = loss_spread > threshold or grad_spread > threshold
    suspect = None
    if inconsistent:
        suspect = detectors.outlier_rank(losses if loss_spread >= grad_spread else grad_norms)
    return Consistency(inconsistent, losses, grad_norms, loss_spread, grad_spread, suspect)
