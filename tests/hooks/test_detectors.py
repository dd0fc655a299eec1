"""agents.detectors: each pure function with literal data."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from agents import detectors
from tests.hooks.conftest import REPO


def test_detectors_do_not_pull_in_torch():
    # The server and the agent import these; they must stay plain Python.
    probe = "import sys, agents.detectors; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            cwd=REPO)
    assert result.stdout.strip() == "False"


class TestGradNormGuard:
    history = [1.0, 1.2, 0.9, 1.1, 1.0, 0.95, 1.05, 1.0, 1.1, 0.9]

    def test_a_norm_above_k_times_the_median_is_skipped(self):
        decision = detectors.grad_norm_guard(10.5, self.history, k=10)
        assert decision.skip and decision.median == 1.0
        assert "10.5 > 10 x median 1" in decision.reason

    def test_a_norm_at_or_below_k_times_the_median_is_kept(self):
        decision = detectors.grad_norm_guard(10.0, self.history, k=10)
        assert not decision.skip and decision.reason is None and decision.median == 1.0

    @pytest.mark.parametrize("norm", [math.nan, math.inf])
    def test_a_non_finite_norm_is_skipped_even_without_history(self, norm):
        decision = detectors.grad_norm_guard(norm, [], k=10)
        assert decision.skip and "non-finite" in decision.reason

    def test_the_median_rule_waits_for_enough_history(self):
        assert not detectors.grad_norm_guard(1e6, self.history[:4], min_history=5).skip
        assert detectors.grad_norm_guard(1e6, self.history[:5], min_history=5).skip


class TestLossSpike:
    flat = [2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02, 1.98, 2.1, 1.9]

    def test_a_loss_far_above_the_rolling_median_is_a_spike(self):
        assert detectors.is_loss_spike(4.0, self.flat)
        assert detectors.loss_spike_score(4.0, self.flat) > 6

    def test_ordinary_noise_and_drops_are_not_spikes(self):
        assert not detectors.is_loss_spike(2.12, self.flat)
        assert not detectors.is_loss_spike(0.5, self.flat)  # a sudden improvement is no incident

    def test_nan_is_a_spike_and_warming_up_is_not(self):
        assert detectors.is_loss_spike(math.nan, self.flat)
        assert detectors.loss_spike_score(9.0, self.flat[:3]) is None

    def test_a_perfectly_flat_window_does_not_make_every_wobble_infinite(self):
        score = detectors.loss_spike_score(2.001, [2.0] * 20)
        assert math.isfinite(score) and score < 1

    def test_one_earlier_spike_does_not_hide_the_next(self):
        # The median/MAD barely move for one outlier, where a mean/stddev would be dragged along.
        assert detectors.is_loss_spike(4.0, [*self.flat[1:], 50.0])


class TestSpread:
    def test_relative_spread_is_range_over_mean(self):
        assert detectors.relative_spread([1.0, 3.0]) == pytest.approx(1.0)
        assert detectors.relative_spread([2.0, 2.0, 2.0]) == 0.0
        assert detectors.relative_spread([5.0]) == 0.0

    def test_a_non_finite_value_makes_the_spread_infinite(self):
        assert detectors.relative_spread([1.0, math.nan]) == math.inf

    def test_no_values_is_an_error(self):
        with pytest.raises(ValueError):
            detectors.relative_spread([])

    def test_the_outlier_rank_is_the_one_farthest_from_the_median(self):
        assert detectors.outlier_rank([2.0, 2.1, 6.0, 1.9]) == 2
        assert detectors.outlier_rank([2.0, math.nan, 2.0]) == 1


class TestStragglers:
    def test_percentile_interpolates(self):
        assert detectors.percentile([1, 2, 3, 4, 5], 50) == 3
        assert detectors.percentile([1, 2, 3, 4, 5], 99) == pytest.approx(4.96)
        assert detectors.percentile([7], 99) == 7

    def test_a_rank_with_a_slow_tail_stands_out(self):
        times = {0: [1.0] * 100, 1: [1.0] * 100, 2: [1.0] * 90 + [3.0] * 10}
        ratios = detectors.straggler_tail_ratios(times)
        assert ratios[0] == pytest.approx(1.0) and ratios[1] == pytest.approx(1.0)
        assert ratios[2] == pytest.approx(3.0)

    def test_ranks_without_samples_are_left_out(self):
        assert detectors.straggler_tail_ratios({0: [], 1: [2.0]}) == {1: 1.0}
        assert detectors.straggler_tail_ratios({}) == {}


class TestYoungDaly:
    def test_the_reference_example_gives_about_77_minutes(self):
        assert detectors.young_daly_interval(5 * 60, 10 * 3600) / 60 == pytest.approx(77.46, abs=0.01)

    def test_in_steps(self):
        assert detectors.young_daly_interval_steps(5 * 60, 10 * 3600, step_time_s=2.0) == 2324
        assert detectors.young_daly_interval_steps(0.0, 3600, step_time_s=1.0) == 1

    @pytest.mark.parametrize(("cost", "mtbf"), [(-1, 10), (1, 0)])
    def test_nonsense_inputs_are_refused(self, cost, mtbf):
        with pytest.raises(ValueError):
            detectors.young_daly_interval(cost, mtbf)
