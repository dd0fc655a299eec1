"""bench.recovery's --inprocess option and its step counts (no cluster: the figures come from the run)."""

from __future__ import annotations

import pytest

from bench.recovery import lost_steps, options, retrained_steps


class FakeTail:
    def __init__(self, lines: list[tuple[float, dict]]):
        self._lines = lines

    def samples(self) -> list[tuple[float, dict]]:
        return list(self._lines)


def test_inprocess_implies_warm_workers_and_snapshots_every_step():
    opts, rest = options(["--quick", "--inprocess", "3"])
    assert (opts.inprocess, opts.warm_workers, opts.snapshot_every, rest) == (3, True, 1, ["--quick"])
    assert options(["--inprocess", "2", "--snapshot-every", "5"])[0].snapshot_every == 5
    plain = options([])[0]
    assert (plain.inprocess, plain.warm_workers, plain.snapshot_every) == (0, False, 0)


def test_inprocess_refuses_to_run_without_snapshots():
    with pytest.raises(SystemExit):
        options(["--inprocess", "3", "--snapshot-every", "0"])


def test_a_step_the_survivor_finished_after_the_signal_counts_as_trained_again():
    # Fault at t=10. Rank 0 finished step 66 just after it (rank 1 had sent its gradients), and
    # round 1 restored the step-65 snapshot and trained step 66 again.
    lines = [(9.0, {"step": 65, "rank": 0, "round": 0}), (9.0, {"step": 65, "rank": 1, "round": 0}),
             (10.1, {"step": 66, "rank": 0, "round": 0}),
             (11.0, {"step": 66, "rank": 0, "round": 1}), (11.0, {"step": 66, "rank": 1, "round": 1})]
    tail = FakeTail(lines)
    resumed = {"step": 66, "rank": 0, "round": 1}
    assert lost_steps(tail, 10.0, resumed["step"]) == 0  # only lines seen before the signal
    assert retrained_steps(tail, resumed, "round") == 1


def test_retrained_steps_reads_torchruns_attempts_and_never_goes_negative():
    lines = [(1.0, {"step": 15, "rank": 0, "attempt": 0}), (2.0, {"step": 11, "rank": 0, "attempt": 1})]
    assert retrained_steps(FakeTail(lines), {"step": 11, "attempt": 1}, "attempt") == 5
    ahead = [(1.0, {"step": 3, "rank": 0, "round": 0}), (2.0, {"step": 6, "rank": 0, "round": 1})]
    assert retrained_steps(FakeTail(ahead), {"step": 6, "round": 1}, "round") == 0
    assert retrained_steps(FakeTail([]), {"step": 6, "round": 1}, "round") is None
