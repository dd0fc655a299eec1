"""The loss detectors judged per step (``LossWatch``), the cross-rank checks (``DriftWatch``,
``SpreadWatch``), the straggler detector over node windows, and the control plane's reading of the verdicts: pure,
literal or seeded data, fast."""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from agents import detectors
from agents.hooks.guards import DriftWatch, GuardSettings, LossWatch, SpreadWatch, judge_consistency
from agents.protocol.hooks import Event
from jobs import detection, policy

POLICY = detectors.DetectionPolicy()


def curve(steps: int, seed: int = 0, noise: float = 0.01, level: float = 2.0) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + 0.5 * (t + 50) ** -0.5) * (1 + noise * rng.gauss(0, 1)) for t in range(steps)]


def run(losses, *, lrs=None, skipped=(), watch=None):
    watch = watch or LossWatch(POLICY)
    verdicts = []
    for t, loss in enumerate(losses, start=1):
        lr = lrs[t - 1] if lrs else 1e-3
        verdicts.append((t, watch.observe(loss, lr=lr, skipped=t in skipped)))
    return [(t, v) for t, v in verdicts if v.kind]


class TestSpikes:
    def test_a_one_step_spike_whose_update_was_applied_pauses_at_once(self):
        losses = curve(400)
        losses[300] *= 1.25
        seen = run(losses)
        assert [(t, v.kind, v.action) for t, v in seen] == [(301, "spike", "pause")]
        v = seen[0][1]
        assert v.score > POLICY.spike_z and v.baseline and losses[300] > v.threshold > v.baseline

    def test_a_lone_small_spike_is_a_marker_but_two_in_a_row_pause(self):
        # +12 %: over the spike minimum (+10 %), under the lone-spike pause size (+15 %): what a hard
        # batch on rank 0 or the noise on a fresh level shift reaches in one step.
        losses = curve(400, noise=0.003)
        losses[300] *= 1.12
        seen = run(losses)
        assert [(t, v.kind, v.action) for t, v in seen] == [(301, "spike", "marker")]
        losses[301] *= 1.12
        assert [(t, v.action) for t, v in run(losses)] == [(301, "marker"), (302, "pause")]

    def test_a_lone_spike_the_guard_skipped_is_a_marker_but_a_run_pauses(self):
        losses = curve(400)
        losses[300] *= 6
        assert [(t, v.action) for t, v in run(losses, skipped={301})] == [(301, "marker")]
        losses[301] *= 6
        assert [(t, v.action) for t, v in run(losses, skipped={301, 302})] == [(301, "marker"), (302, "pause")]

    def test_noise_a_hard_batch_and_a_drop_are_not_spikes(self):
        losses = curve(600, noise=0.015)
        losses[200] *= 1.07  # a hard batch: within the minimum size
        losses[400] *= 0.5
        assert run(losses) == []

    def test_a_nan_pauses_and_does_not_enter_the_baseline(self):
        losses = curve(300)
        losses[250] = math.nan
        seen = run(losses)
        assert [(t, v.kind, v.action) for t, v in seen] == [(251, "nan", "pause")]

    def test_another_rank_only_marks_its_own_spikes(self):
        losses = curve(400)
        losses[300] *= 2
        seen = run(losses, watch=LossWatch(POLICY, speaks_for_job=False))
        assert [(t, v.kind, v.action) for t, v in seen] == [(301, "spike", "marker")]


class TestLookAlikes:
    def test_an_lr_restart_bump_is_expected(self):
        losses, lrs = curve(1200, noise=0.01), []
        for t in range(1200):
            lrs.append(1e-3 if t < 600 else 1e-3 * (3 if t >= 600 else 1))
            if t >= 600:
                losses[t] *= 1 + 0.09 * math.exp(-(t - 600) / 50)  # +9 %: over the minimum size without the grace
        assert run(losses, lrs=lrs) == []

    def test_a_level_shift_is_one_marker_and_never_a_pause(self):
        losses = curve(1200, seed=3)
        losses = [x * (1.05 if t >= 600 else 1) for t, x in enumerate(losses)]
        seen = run(losses)
        assert [(v.kind, v.action) for _, v in seen] == [("level_shift", "marker")]
        assert 600 < seen[0][0] <= 660 and seen[0][1].rise == pytest.approx(0.05, abs=0.015)


class TestDivergence:
    def test_a_slow_rise_pauses_within_300_steps_naming_where_it_began(self):
        losses = curve(1500, seed=5)
        losses = [x * (1 + 0.0004 * max(0, t - 700)) for t, x in enumerate(losses)]
        seen = run(losses)
        assert [(v.kind, v.action) for _, v in seen] == [("divergence", "pause")]
        step, verdict = seen[0]
        assert 700 < step <= 1000
        assert 600 <= verdict.since_step <= 750 and verdict.rise >= POLICY.divergence_rel


    def test_a_step_change_inside_the_middle_span_is_not_a_rise(self):
        # The step lands mid-block, so the block medians rise over both spans of the trend test;
        # the blocks after it are flat, so it is a level shift, never a divergence.
        for at in range(600, 700, 5):
            losses = curve(1200, seed=at, noise=0.005)
            losses = [x * (1.05 if t >= at else 1) for t, x in enumerate(losses)]
            assert all(v.kind != "divergence" for _, v in run(losses)), at


class TestDrift:
    def test_a_rank_a_few_per_cent_off_is_named_after_the_hold(self):
        watch = DriftWatch(POLICY)
        means = [2.0, 2.01, 1.99, 2.07]  # rank 3: +3.5 %
        assert [watch.judge(means) for _ in range(3)][:2] == [None, None]
        assert watch.judge(means)[0] == 3
        consistency = judge_consistency(means, [1.0] * 4, 0.5, (3, 0.035))
        assert consistency.inconsistent and consistency.suspect_rank == 3

    def test_noise_and_two_ranks_name_nobody(self):
        watch = DriftWatch(POLICY)
        assert all(watch.judge([2.0, 2.02, 1.99, 2.01]) is None for _ in range(10))
        assert all(DriftWatch(POLICY).judge([2.0, 2.5]) is None for _ in range(5))

    def test_a_nan_is_left_to_the_nan_detector(self):
        assert not judge_consistency([2.0, math.nan, 2.0], [1.0, 1.0, 1.0], 0.5).inconsistent

    def test_a_drift_must_stay_on_one_side(self):
        watch = DriftWatch(POLICY)
        means = [[2.0, 2.01, 1.99, 2.07], [2.0, 2.01, 1.99, 1.93]] * 3  # rank 3 ±3.5 %, alternating
        assert [watch.judge(m) for m in means] == [None] * 6

    def test_the_bars_widen_with_a_noisy_jobs_own_noise(self):
        def named(factor: float) -> list[int]:
            watch = DriftWatch(POLICY)
            verdicts = [watch.judge([m * (factor if r == 3 else 1.0) for r, m in enumerate(x["means"])])
                        for x in NOISY_4]
            return [v[0] for v in verdicts if v is not None]

        fixed = DriftWatch(replace(POLICY, rank_drift_noise_ranks=5))  # four ranks: the fixed bars
        assert sum(fixed.judge(x["means"]) is not None for x in NOISY_4) > len(NOISY_4) / 2
        assert named(1.0) == []
        assert len(named(1.5)) > len(NOISY_4) / 3 and set(named(1.5)) == {3}


#: Real exchanges of a healthy, noisy job: CPU ranks of examples/byo/watched.py with 4 samples a
#: micro-batch. On two ranks, this step's losses spread over 0.5 at a third of the exchanges; on four,
#: the window means differ by 5-40 %.
_EXCHANGES = json.loads((Path(__file__).parent / "noisy_exchanges.json").read_text())
NOISY, NOISY_4 = _EXCHANGES["two_ranks"], _EXCHANGES["four_ranks"]


def spread_watch() -> SpreadWatch:
    settings = GuardSettings()
    return SpreadWatch(settings.spread_threshold, hold=settings.spread_hold, now=settings.spread_now)


def flagged(exchanges, factor: float = 1.0, rank: int = 1) -> list[tuple[int, int]]:
    """(exchange, suspect) where ``SpreadWatch`` flags the exchanges, one rank's losses × ``factor``."""
    watch, out = spread_watch(), []
    for i, x in enumerate(exchanges):
        scale = [factor if r == rank else 1.0 for r in range(len(x["means"]))]
        found = watch.judge([m * f for m, f in zip(x["means"], scale, strict=True)],
                            [v * f for v, f in zip(x["losses"], scale, strict=True)])
        if found is not None:
            out.append((i, found.rank))
    return out


class TestSpread:
    def test_a_noisy_healthy_job_is_never_flagged(self):
        single_step = sum(detectors.relative_spread(x["losses"]) > 0.5 for x in NOISY)
        assert single_step > len(NOISY) / 4  # the old rule's false flags: this step's spread alone
        assert flagged(NOISY) == []

    @pytest.mark.parametrize("rank", [0, 1])
    def test_a_rank_off_by_2x_in_the_same_noise_is_named_from_the_third_exchange(self, rank):
        found = flagged(NOISY, factor=2.0, rank=rank)
        assert found[0] == (2, rank) and len(found) > len(NOISY) / 3
        assert {suspect for _, suspect in found} == {rank}

    def test_noise_over_the_bar_on_alternating_sides_is_not_persistence(self):
        watch = spread_watch()
        assert all(watch.judge(means, means) is None for means in [[1.0, 2.0], [2.0, 1.0]] * 5)

    def test_the_hold_restarts_below_the_bar_and_a_huge_spread_needs_no_hold(self):
        watch = spread_watch()
        assert [watch.judge(m, m) for m in ([1.0, 2.0], [1.0, 2.0], [1.0, 1.1], [1.0, 2.0])] == [None] * 4
        assert watch.judge([1.0, 5.0], [1.0, 5.0]).held == 2  # spread 1.33 ≥ 1.2: at once

    def test_a_rank_named_among_four_and_nans_left_to_the_nan_detector(self):
        watch = spread_watch()
        verdicts = [watch.judge([1.0, 1.02, 0.98, 2.0], [1.0, 1.0, 1.0, 1.0]) for _ in range(3)]
        assert verdicts[:2] == [None, None] and verdicts[2].rank == 3
        # A missing window mean falls back to this step's losses; a NaN loss judges nothing.
        assert spread_watch().judge([math.nan, 1.0], [1.0, 9.0]).rank == 1
        assert spread_watch().judge([1.0, 9.0], [math.nan, 9.0]) is not None  # the means are finite
        assert spread_watch().judge([math.nan, 9.0], [math.nan, 9.0]) is None

    def test_only_an_established_disagreement_makes_the_losses_inconsistent(self):
        wide = [1.0, 2.0]  # this step's spread 0.67: over the bar
        assert judge_consistency(wide, [1.0, 1.0], 0.5).inconsistent  # the single-step rule (bench legacy)
        assert not judge_consistency(wide, [1.0, 1.0], 0.5, disagreement=None).inconsistent
        # The gradient norms are all-reduced: their spread needs no persistence.
        assert judge_consistency([1.0, 1.0], [1.0, 2.0], 0.5, disagreement=None).inconsistent
        held = spread_watch()
        for _ in range(3):
            found = held.judge([1.0, 3.0], wide)
        consistency = judge_consistency(wide, [1.0, 1.0], 0.5, disagreement=found)
        assert consistency.inconsistent and consistency.suspect_rank == 1


def windows(slow_rank=None, slow_by=0.0, phase="compute", stall=False, hiccup_rank=None):
    """One exchange window of 4 nodes × 2 ranks (rank = 2 × node + i)."""
    out = []
    for node in range(4):
        ranks = []
        for i in range(2):
            rank = 2 * node + i
            p = {"input": 0.02, "compute": 0.7 * (1 + 0.003 * i), "optimizer": 0.2, "checkpoint": 5.0 if stall else 0.0}
            if rank == slow_rank:
                p[phase] += slow_by * 0.9
            if rank == hiccup_rank:
                p["input"] += 0.9
            ranks.append((rank, p))
        slow, sp = max(ranks, key=lambda r: sum(r[1].values()))
        out.append(detectors.WindowFigures(node, 2, sorted(sum(p.values()) for _, p in ranks)[0] / 2
                                           + sorted(sum(p.values()) for _, p in ranks)[1] / 2,
                                           slow, sum(sp.values()), sp,
                                           {k: sum(p[k] for _, p in ranks) / 2 for k in sp}))
    return out


class TestStragglers:
    def test_a_rank_slow_for_the_hold_is_named_with_its_node_phase_and_cost(self):
        seen = [windows()] * 3 + [windows(slow_rank=5, slow_by=0.10, phase="optimizer")] * 5
        found = detectors.find_straggler(seen, POLICY)
        assert (found.rank, found.node, found.phase) == (5, 2, "optimizer")
        assert found.ratio == pytest.approx(1.09, abs=0.02) and found.lost_fraction == pytest.approx(0.08, abs=0.02)

    def test_checkpoint_stalls_and_one_window_hiccups_never_count(self):
        seen = [w for rank in (3, 5, 0, 6)
                for w in (windows(), windows(stall=True), windows(hiccup_rank=rank), windows(stall=True))]
        assert detectors.find_straggler(seen, POLICY) is None
        assert detectors.find_straggler([windows(slow_rank=1, slow_by=0.1)] * 3, POLICY) is None  # not held yet
        # The same rank hiccuping in two windows of eight is not held either.
        seen = [windows(hiccup_rank=3), windows(), windows(hiccup_rank=3)] + [windows()] * 5
        assert detectors.find_straggler(seen, POLICY) is None

    def test_the_pick_of_each_node_s_noisiest_rank_cancels_out(self):
        # Every node's slowest rank is its noisiest this window: 3 % over its node's mean, which
        # over the job's mean would be a straggler; against the other nodes' slowest it is not.
        noisy = [detectors.WindowFigures(n, 4, 1.0, 4 * n, 1.03, {"compute": 0.73, "optimizer": 0.3},
                                         {"compute": 0.70, "optimizer": 0.3}) for n in range(8)]
        assert detectors.find_straggler([noisy] * 8, POLICY) is None
        slow_node = detectors.WindowFigures(1, 4, 1.0, 4, 1.06, {"compute": 0.76, "optimizer": 0.3},
                                            {"compute": 0.71, "optimizer": 0.3})
        found = detectors.find_straggler([[noisy[0], slow_node, *noisy[2:]]] * 8, POLICY)
        assert (found.rank, found.node, found.phase) == (4, 1, "compute")
        assert found.ratio == pytest.approx(1.03, abs=0.005)

    def test_node_excess_equals_the_median_over_every_other_node(self):
        """The leave-one-out medians (read off one sort) give exactly what the direct definition
        gives: each node against the median of all the other nodes' slowest ranks, ties, odd and
        even node counts and missing phases included."""
        def direct(window):
            out = {}
            for figures in window:
                peers = [dict(w.slowest_phases) for w in window if w is not figures]
                step = statistics.median(sum(p.values()) for p in peers)
                if step > 0:
                    out[figures.node] = (figures.slowest_rank, {
                        phase: (figures.slowest_phases.get(phase, 0.0)
                                - statistics.median(p.get(phase, 0.0) for p in peers)) / step
                        for phase in detectors.STRAGGLER_PHASES})
            return out

        rng = random.Random(7)
        phases = list(detectors.STRAGGLER_PHASES)
        for nodes in (2, 3, 4, 7, 64, 65):
            for _ in range(20):
                window = []
                for node in range(nodes):
                    # Few distinct values, so that ties are common; sometimes a phase is missing.
                    slowest = {p: rng.choice((0.0, 0.1, 0.25, 0.3)) for p in phases if rng.random() > 0.1}
                    window.append(detectors.WindowFigures(node, 8, 1.0, 8 * node, sum(slowest.values()),
                                                          slowest, dict(slowest)))
                assert detectors.node_excess(window) == direct(window)

    def test_the_policy_replaces_only_when_it_pays(self):
        ev = dict(signal=policy.STRAGGLER, nodes=("gpu-03",), lost_fraction=0.2, restart_cost_s=300.0)
        assert policy.decide(policy.Evidence(**ev)).action == "alert"  # remaining time unknown
        assert policy.decide(policy.Evidence(**ev, remaining_s=1000.0, spares_available=1)).action == "alert"
        replace = policy.decide(policy.Evidence(**ev, remaining_s=36000.0, spares_available=1))
        assert replace.action == "restart_on_spare" and replace.drain == ("gpu-03",) and "saves about" in replace.reason


def event(step, kind, rank=0, **detail):
    return Event(job="j", generation=1, rank=rank, step=step, kind=kind, key=f"{rank}:{step}:{kind}",
                 message="m", detail=detail, time=1.0)


class TestServerReading:
    def test_the_verdict_not_the_batching_decides(self):
        events = [event(t, "spike", action="marker", consecutive=1) for t in (5, 9)] + [
            event(12, "spike", action="pause", consecutive=1)]
        one_batch = detection.judge_batch([], events, spike_limit=3)
        per_step = [detection.judge_batch([], [e], spike_limit=3) for e in events]
        assert one_batch.spike["step"] == 12
        assert [f.spike is not None for f in per_step] == [False, False, True]

    def test_another_rank_s_divergence_is_a_marker(self):
        flags = detection.judge_batch([], [event(900, "divergence", rank=2, action="marker", since_step=650)],
                                      spike_limit=3)
        assert flags.divergence is None and not flags.any

    def test_older_hooks_still_pause_on_a_run_and_divergence_is_read(self):
        assert detection.judge_batch([], [event(3, "spike", consecutive=3)], spike_limit=3).spike
        assert not detection.judge_batch([], [event(3, "spike", consecutive=2)], spike_limit=3).any
        flags = detection.judge_batch([], [event(900, "divergence", action="pause", since_step=650, rise=0.07)],
                                      spike_limit=3)
        assert flags.divergence["since_step"] == 650
        decision = policy.decide(policy.Evidence(signal=policy.DIVERGENCE, since_step=650, rise=0.07))
        assert decision.action == "pause" and decision.propose_rollback and "since step 650" in decision.reason


class TestASpikeOnOneRanksBatch:
    """A lone spike whose update was applied pauses only when the other ranks saw it too (their
    spike masks at the next exchange): rank 0's four-sample loss jumped +16-25 % three times in a
    30-minute chaos run while rank 1's did not, and each of those paused the job and paged a human."""

    class Pair:
        """Rank 0 of two, its peer's exchange row made up by the test (its spikes as a mask)."""

        rank, world_size, node, local_world_size, attempt = 0, 2, 0, 1, 0

        def __init__(self, peer_spikes: set[int]):
            self.peer_spikes = peer_spikes

        def all_gather_floats(self, values: list[float]) -> list[list[float]]:
            from agents.hooks.telemetry import SPIKE_MASK_FIELD
            from agents.hooks.windows import RankTimings

            step = self.exchange_step
            mask = sum(1 << (step - s) for s in self.peer_spikes if 0 <= step - s < 20)
            peer = [values[0], values[1], 0.0, 0.0, 0.0, 0.0, math.nan, float(mask), *RankTimings().row(1)]
            assert len(peer) == len(values) and SPIKE_MASK_FIELD == 7
            return [values, peer]

    class Events:
        stale = pause_requested = False
        checkpoint_interval = None

        def __init__(self):
            self.events: list[Event] = []

        def take_checkpoint_request(self) -> bool:
            return False

        def event(self, event: Event, urgent: bool = False) -> None:
            self.events.append(event)

        def report(self, report) -> None:
            pass

        def window(self, window) -> None:
            pass

    def run(self, peer_spikes: set[int], spiked_at: int = 301) -> list[Event]:
        """Hooks.step's order on rank 0: observe (and tell the telemetry), the exchange every 10th
        step, then step_done."""
        from agents.detectors import GuardDecision
        from agents.hooks.api import StepOutcome
        from agents.hooks.settings import Environment
        from agents.hooks.telemetry import Telemetry

        settings = GuardSettings()
        pair, events = self.Pair(peer_spikes), self.Events()
        telemetry = Telemetry(Environment(), pair, settings)  # type: ignore[arg-type]
        telemetry.reporter = events  # type: ignore[assignment]
        watch = LossWatch(settings.detection)
        losses = curve(330)
        losses[spiked_at - 1] *= 1.25
        for step, loss in enumerate(losses, start=1):
            verdict = watch.observe(loss, lr=1e-3)
            telemetry.judged(step, verdict, loss)
            if step % settings.check_every == 0:
                pair.exchange_step = step
                telemetry.exchange(step, loss, 1.0)
            telemetry.step_done(StepOutcome(step, loss, 1.0, False, verdict.spike, False, False),
                                GuardDecision(False), verdict, compute_s=0.1, optimizer_s=0.0, checkpoint_s=0.0,
                                data_cursor=step, samples=4, tokens=0)
        return [e for e in events.events if e.kind == "spike"]

    def test_a_spike_no_other_rank_saw_is_a_marker_told_at_the_next_exchange(self):
        (spike,) = self.run(peer_spikes=set())
        assert (spike.step, spike.detail["action"]) == (301, "marker")
        assert spike.detail["ranks_saw"] == 0 and "batch alone" in spike.message

    def test_a_spike_the_other_ranks_saw_too_pauses(self):
        (spike,) = self.run(peer_spikes={301})
        assert (spike.step, spike.detail["action"], spike.detail["ranks_saw"]) == (301, "pause", 1)

    def test_a_spike_at_an_exchange_step_is_judged_in_that_exchange(self):
        (spike,) = self.run(peer_spikes={310}, spiked_at=310)
        assert (spike.step, spike.detail["action"]) == (310, "pause")
        (spike,) = self.run(peer_spikes={309}, spiked_at=310)  # the peer's spike a step earlier: not this one
        assert (spike.step, spike.detail["action"]) == (310, "marker")
