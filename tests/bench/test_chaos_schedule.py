"""The chaos benchmark's ground truth and bookkeeping: the fault schedule and the goodput ledger.

No processes: the schedule is pure, and the ledger is checked on hand-made sample-log lines whose
right answers can be counted by hand.
"""

from __future__ import annotations

import pytest

from bench import _faults as F
from bench._goodput import Record, account, lineage, sample_errors, stream_positions

ISSUE_SCALE = {"duration_s": 1800.0, "mtbf_s": 180.0}


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    first = F.fault_schedule(7, **ISSUE_SCALE)
    assert first == F.fault_schedule(7, **ISSUE_SCALE)
    assert first != F.fault_schedule(8, **ISSUE_SCALE)
    assert [f.as_dict() for f in first] == [f.as_dict() for f in F.fault_schedule(7, **ISSUE_SCALE)]


def test_faults_stay_inside_the_run_and_follow_the_mean_time_between_failures():
    gaps, counts = [], []
    for seed in range(200):
        faults = F.fault_schedule(seed, **ISSUE_SCALE, warmup_s=20, tail_s=15)
        assert all(20 < f.at <= 1800 - 15 for f in faults)
        assert [f.at for f in faults] == sorted(f.at for f in faults)
        times = [20.0, *(f.at for f in faults)]
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
        counts.append(len(faults))
    assert 160 < sum(gaps) / len(gaps) < 200  # exponential gaps with a 180 s mean
    assert 8.5 < sum(counts) / len(counts) < 11  # (1800 - 35) / 180 = 9.8 faults a run


def test_every_kind_appears_in_a_run_of_the_issues_scale():
    faults = F.fault_schedule(0, **ISSUE_SCALE)  # the report's default seed
    assert {f.kind for f in faults} == set(F.KINDS)
    for seed in range(100):  # any run with as many faults as kinds sees every kind; an Xid at most once
        faults = F.fault_schedule(seed, **ISSUE_SCALE)
        if len(faults) >= len(F.KINDS):
            assert {f.kind for f in faults} == set(F.KINDS), seed
        assert sum(f.kind == F.XID for f in faults) <= 1


def test_rank_faults_name_a_rank_and_an_outage_its_length():
    faults = F.fault_schedule(0, **ISSUE_SCALE, outage_s=12.0)
    for fault in faults:
        if fault.kind in (F.RANK_KILL, F.RANK_HANG, F.NAN, F.CORRUPT_CHECKPOINT):
            assert fault.rank in (0, 1)
        if fault.kind == F.CONTROL_PLANE_OUTAGE:
            assert fault.duration_s == 12.0 and "12 s" in fault.target


def test_a_run_too_short_for_faults_is_refused():
    with pytest.raises(ValueError, match="leaves no time"):
        F.fault_schedule(0, duration_s=30, mtbf_s=10, warmup_s=20, tail_s=15)
    with pytest.raises(ValueError, match="positive"):
        F.fault_schedule(0, duration_s=300, mtbf_s=0)


# --- the ledger ----------------------------------------------------------------------------------

ORDER = list(range(100, 200))  # the data stream: position p is sample id 100 + p
POSITIONS = stream_positions(ORDER)


def lines(steps, *, start, rank, step_s=1.0, attempt=0, batch=2, world=2, cursor_of=None, round=0):
    """Log lines of one rank for ``steps``, one a second from ``start``; each step's ids are the
    stream positions that step consumes (``cursor_of(step)``: positions before it)."""
    out = []
    for i, step in enumerate(steps):
        cursor = cursor_of(step) if cursor_of else (step - 1) * batch * world
        ids = tuple(ORDER[cursor + rank * batch + j] for j in range(batch))
        out.append(Record(start + i * step_s, step, rank, attempt, ids, round))
    return out


def both_ranks(steps, *, start, **kw):
    return [*lines(steps, start=start, rank=0, **kw), *lines(steps, start=start + 0.01, rank=1, **kw)]


def test_an_uninterrupted_run_is_all_productive():
    records = both_ranks(range(1, 11), start=0.0)
    ledger = account(records, wall_s=10.0, position=POSITIONS)
    assert (ledger.steps_trained, ledger.steps_surviving, ledger.lost_steps) == (10, 10, 0)
    assert ledger.productive_s == pytest.approx(10.0)  # 9 gaps of 1 s + the first step at the median
    assert ledger.ettr == pytest.approx(1.0)
    assert (ledger.trained_twice, ledger.skipped) == (0, 0)


def test_a_resume_from_an_older_checkpoint_loses_the_steps_after_it():
    # Steps 1-8, a crash, 5 s of recovery, then a resume from the step-5 checkpoint: 6-12.
    records = [*both_ranks(range(1, 9), start=0.0), *both_ranks(range(6, 13), start=13.0)]
    ledger = account(records, wall_s=20.0, position=POSITIONS)
    assert ledger.steps_trained == 15 and ledger.steps_surviving == 12 and ledger.lost_steps == 3
    # surviving: steps 1-5 (1 + 4 x 1 s) and 6-12 (first at the median, 6 x 1 s)
    assert ledger.productive_s == pytest.approx(12.0)
    assert ledger.ettr == pytest.approx(12.0 / 20.0)
    assert [(s.seen, s.step) for s in ledger.segment_starts] == [(0.0, 1), (13.0, 6)]
    assert (ledger.trained_twice, ledger.skipped) == (0, 0)  # re-trained samples replaced the lost ones


def test_a_resume_that_repeats_or_skips_data_is_counted():
    # The resumed run restarts the data one step too early: step 6 trains step 5's samples again...
    early = [*both_ranks(range(1, 6), start=0.0),
             *both_ranks(range(6, 9), start=10.0, cursor_of=lambda s: (s - 2) * 4)]
    ledger = account(early, wall_s=20.0, position=POSITIONS)
    assert ledger.trained_twice == 4 and ledger.skipped == 0  # step 5's 4 samples twice
    # ...or one step too late: step 6's samples are never trained.
    late = [*both_ranks(range(1, 6), start=0.0), *both_ranks(range(6, 9), start=10.0, cursor_of=lambda s: s * 4)]
    ledger = account(late, wall_s=20.0, position=POSITIONS)
    assert ledger.trained_twice == 0 and ledger.skipped == 4


def test_a_deliberate_rollback_skip_is_not_counted():
    late = [*both_ranks(range(1, 6), start=0.0), *both_ranks(range(6, 9), start=10.0, cursor_of=lambda s: s * 4)]
    ledger = account(late, wall_s=20.0, position=POSITIONS, skip=[(20, 24)])
    assert ledger.skipped == 0


def test_the_lineage_follows_repeated_rewinds():
    # 1-10, back to 5 (6-8), back to 3 (4-6): the final model holds 1-3 of the first run and 4-6 of the third.
    records = [*lines(range(1, 11), start=0, rank=0), *lines(range(6, 9), start=20, rank=0),
               *lines(range(4, 7), start=40, rank=0)]
    kept = lineage(records)
    assert [(records[i].seen, records[i].step) for i in kept] == [(0, 1), (1, 2), (2, 3), (40, 4), (41, 5), (42, 6)]


def test_a_restart_that_continues_at_the_next_step_still_starts_a_segment():
    # A crash right after the step-5 checkpoint: the resume trains step 6 next, 30 s later.
    records = [*lines(range(1, 6), start=0, rank=0), *lines(range(6, 9), start=34, rank=0)]
    ledger = account(records, wall_s=40.0, position=POSITIONS)
    assert [s.step for s in ledger.segment_starts] == [1, 6]
    assert ledger.productive_s == pytest.approx(8.0) and ledger.lost_steps == 0


def test_an_in_process_restart_that_continues_at_the_next_step_starts_a_segment_however_quick():
    # A rank dies after step 5, whose snapshot both copies hold; the round of in-process restarts
    # trains step 6 next, 1.5 s later: not a step of 1.5 s (the gap limit is 20 x the median), a restart.
    records = [*lines(range(1, 6), start=0, rank=0), *lines(range(6, 9), start=5.5, rank=0, round=1)]
    ledger = account(records, wall_s=9.0, position=POSITIONS)
    assert [s.step for s in ledger.segment_starts] == [1, 6]
    assert ledger.productive_s == pytest.approx(8.0) and ledger.lost_steps == 0


def test_a_rank_ahead_of_the_other_at_the_end_is_not_a_skip():
    records = [*both_ranks(range(1, 6), start=0.0), *lines([6], start=5.5, rank=1)]
    assert account(records, wall_s=6.0, position=POSITIONS).skipped == 0


def test_sample_ids_outside_the_stream_and_a_stream_that_wraps_are_refused():
    ranks = {0: [Record(0.0, 1, 0, 0, (999,))]}
    with pytest.raises(ValueError, match="not in the data stream"):
        sample_errors(ranks, {0: [0]}, POSITIONS)
    with pytest.raises(ValueError, match="larger than the run"):
        stream_positions([1, 2, 1])


def test_overlapping_faults_get_the_detection_of_their_own_kind_and_a_resume_before_the_next_fault():
    from bench.chaos import attribute

    faults = [{"kind": F.NAN, "effective_at_s": 10.0, "applied": True},
              {"kind": F.RANK_KILL, "effective_at_s": 10.5, "applied": True},
              {"kind": F.XID, "effective_at_s": 40.0, "applied": False},
              {"kind": F.RANK_HANG, "effective_at_s": 50.0, "applied": True},
              {"kind": F.CONTROL_PLANE_OUTAGE, "effective_at_s": 60.0, "applied": True}]
    detections = [(11.4, "crash"), (11.6, "numerical"), (61.0, "partition")]
    starts = [(2.0, 1), (30.0, 101), (80.0, 151)]
    attribute(faults, detections, starts, 100.0)
    nan, kill, xid, hang, outage = faults
    assert (nan["detection_s"], nan["detected_as"]) == (1.6, "numerical")
    assert (kill["detection_s"], kill["detected_as"]) == (0.9, "crash")
    assert "recovery_s" not in nan and nan["resumed_after_later_faults"] == {"at_s": 30.0, "kinds": [F.RANK_KILL]}
    assert (kill["recovery_s"], kill["resumed_step"]) == (19.5, 100)
    assert "detection_s" not in xid and "recovery_s" not in xid  # not applied: no figures
    assert "detection_s" not in hang  # nothing noticed the hang; the partition belongs to the outage
    assert (outage["detection_s"], outage["detected_as"]) == (1.0, "partition")
    assert outage["recovery_s"] == 20.0 and "recovery_s" not in hang


def test_a_crash_after_a_later_kill_belongs_to_the_kill_not_to_an_unnoticed_earlier_fault():
    from bench.chaos import attribute

    # The checkpoint fault's kill landed while the job was being paused: nothing noticed it.
    faults = [{"kind": F.CORRUPT_CHECKPOINT, "effective_at_s": 61.7, "applied": True},
              {"kind": F.RANK_KILL, "effective_at_s": 91.5, "applied": True}]
    attribute(faults, [(91.8, "crash")], [(20.0, 1)], 180.0)
    assert "detection_s" not in faults[0]
    assert faults[1]["detection_s"] == 0.3


# --- corrupt loads -------------------------------------------------------------------------------

def test_a_corrupt_load_is_judged_by_what_the_run_restored_not_by_its_step():
    """The 30-minute in-process run counted a corrupt load: most likely a snapshot of the step whose
    disk checkpoint the fault had corrupted (a pause saves a checkpoint at the step its snapshot
    holds). The script names what it restored; only the corrupted directory is a corrupt load."""
    import dataclasses
    from types import SimpleNamespace

    from bench._goodput import SegmentStart
    from bench.chaos import corrupt_loads

    side = SimpleNamespace(t0=1000.0, corrupted=[{"path": "/ckpt/step-00000500-g1-ab", "step": 500, "at": 1010.0}])
    first = SegmentStart(1001.0, 1, None)
    snapshot = SegmentStart(1020.0, 501, "/dev/shm/nightwatch/job/own/step-00000500-g1")
    disk = dataclasses.replace(snapshot, restored="/ckpt/step-00000500-g1-ab")
    unnamed = dataclasses.replace(snapshot, restored=None)
    assert corrupt_loads(side, [first, snapshot]) == []
    assert corrupt_loads(side, [first, disk]) == [{"at_s": 20.0, "step": 500, "restored": disk.restored}]
    assert [c["step"] for c in corrupt_loads(side, [first, unnamed])] == [500]  # a script that names nothing
    before = dataclasses.replace(disk, seen=1005.0)  # loaded before the fault corrupted it
    assert corrupt_loads(side, [first, before]) == []


def test_the_first_line_of_a_round_carries_what_it_restored_into_the_ledger():
    rows = [Record(float(i), i, 0, 0, (100 + i,), 0) for i in range(1, 5)]
    rows += [Record(20.0, 4, 0, 0, (104,), 1, "/snap/step-3"), Record(21.0, 5, 0, 0, (105,), 1)]
    ledger = account(rows, wall_s=30.0, position={100 + i: i for i in range(10)})
    assert [(s.step, s.restored) for s in ledger.segment_starts] == [(1, None), (4, "/snap/step-3")]
    assert Record.parse(1.0, {"step": 2, "rank": 0, "ids": [1], "restored": "/x"}).restored == "/x"
