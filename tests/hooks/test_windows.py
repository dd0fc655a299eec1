"""agents.hooks.windows: every rank's step timings summarised per node, as rank 0 reports them."""

from __future__ import annotations

import pytest

from agents.hooks.windows import FIELDS, RankTimings, node_windows
from agents.protocol import ProtocolError, dump, parse
from agents.protocol.hooks import NodeWindow, ReportBatch


def timings(steps, compute_s, *, first=1):
    rank = RankTimings()
    for i, compute in enumerate([compute_s] * steps if isinstance(compute_s, float) else compute_s):
        rank.add(first + i, {"input": 0.01, "compute": compute, "optimizer": 0.02, "checkpoint": 0.0})
    return rank


def test_a_rank_sums_its_steps_into_means_and_its_longest_step():
    row = dict(zip(FIELDS, timings(4, [0.1, 0.1, 0.5, 0.1], first=11).row(node=3), strict=True))
    assert (row["node"], row["steps"], row["first_step"], row["last_step"]) == (3, 4, 11, 14)
    assert row["mean_s"] == pytest.approx(0.03 + 0.2) and row["max_s"] == pytest.approx(0.53)
    assert row["compute_s"] == pytest.approx(0.2) and row["checkpoint_s"] == 0.0


def test_one_window_per_node_names_its_slowest_rank_and_leaves_out_ranks_that_did_not_train():
    # Two nodes of four ranks; rank 6 (node 1) computes twice as long; rank 3 trained no step yet.
    rows = [timings(10, 0.2 if rank == 6 else 0.1).row(node=rank // 4) for rank in range(8)]
    rows[3] = RankTimings().row(node=0)
    first, second = node_windows(rows, job="7", generation=2, time=1e9)
    assert (first.node, first.ranks, second.node, second.ranks) == (0, 3, 1, 4)
    assert (second.slowest_rank, second.slowest_s) == (6, pytest.approx(0.23))
    assert second.step_median_s == pytest.approx(0.13) and second.step_max_s == pytest.approx(0.23)
    assert second.slowest_phases["compute"] == pytest.approx(0.2)
    assert second.phases["compute"] == pytest.approx((3 * 0.1 + 0.2) / 4)
    assert (first.first_step, first.last_step) == (1, 10)
    # What rank 0 builds is a valid wire message, and survives the round trip.
    batch = ReportBatch(job="7", generation=2, windows=[first, second])
    assert parse(ReportBatch, dump(batch)) == batch


def test_a_window_that_ends_before_it_starts_is_refused_at_the_boundary():
    body = dump(node_windows([timings(2, 0.1).row(node=0)], job="7", generation=2, time=1e9)[0])
    with pytest.raises(ProtocolError, match="last_step"):
        parse(NodeWindow, body | {"first_step": 5, "last_step": 4})
    with pytest.raises(ProtocolError, match="phases"):
        parse(NodeWindow, body | {"phases": {"warmup": 1.0}})
