"""agents.protocol.hooks: the messages round-trip through dump/parse and refuse what they should."""

from __future__ import annotations

import math

import pytest

from agents.protocol import ProtocolError, dump, parse
from agents.protocol.hooks import (
    EXIT_PAUSED,
    EXIT_RESUME_REFUSED,
    EXIT_STALE_GENERATION,
    CheckpointCommit,
    Control,
    Event,
    ReportBatch,
    ReportsAccepted,
    StepReport,
)


def step_report(**overrides):
    fields = {"job": "7", "generation": 3, "rank": 1, "step": 12, "loss": 2.5, "grad_norm": 0.7,
              "world_size": 2, "data_cursor": 96, "samples": 4, "tokens": 128,
              "phases": {"input": 0.001, "compute": 0.02, "optimizer": 0.004, "checkpoint": 0.0},
              "skipped": False, "spike": False, "nan": False, "inconsistent": False, "time": 1.7e9}
    return StepReport(**{**fields, **overrides})


def event(**overrides):
    fields = {"job": "7", "generation": 3, "rank": 0, "step": 12, "kind": "guard_skip", "key": "0:0:12:guard_skip:0",
              "message": "skipped step 12", "detail": {"grad_norm": 1e6}, "time": 1.7e9}
    return Event(**{**fields, **overrides})


def test_a_batch_round_trips_and_a_nan_loss_travels_as_a_string():
    batch = ReportBatch(job="7", generation=3, reports=[step_report(loss=math.nan, nan=True)], events=[event()])
    wire = dump(batch)
    assert wire["reports"][0]["loss"] == "nan"
    back = parse(ReportBatch, wire)
    assert math.isnan(back.reports[0].loss) and back.events[0] == batch.events[0]


def test_a_record_of_another_generation_cannot_ride_in_a_batch():
    wire = dump(ReportBatch(job="7", generation=3, reports=[step_report()]))
    wire["reports"][0]["generation"] = 2
    with pytest.raises(ProtocolError) as raised:
        parse(ReportBatch, wire)
    assert raised.value.field == "reports.0"


def test_a_batch_may_say_how_old_its_newest_step_was_when_sent():
    wire = dump(ReportBatch(job="7", generation=3, reports=[step_report()]))
    assert parse(ReportBatch, wire).newest_step_age_s is None  # a reporter that does not say
    assert parse(ReportBatch, {**wire, "newest_step_age_s": 27.5}).newest_step_age_s == 27.5
    for bad in (-0.1, "soon", math.inf):
        with pytest.raises(ProtocolError) as raised:
            parse(ReportBatch, {**wire, "newest_step_age_s": bad})
        assert raised.value.field == "newest_step_age_s"


def test_a_batch_holds_at_most_1000_reports():
    wire = dump(ReportBatch(job="7", generation=3, reports=[step_report(step=i + 1) for i in range(1001)]))
    with pytest.raises(ProtocolError, match="at most 1000"):
        parse(ReportBatch, wire)


@pytest.mark.parametrize(("field", "value", "where"), [
    ("phases", {"backward": 0.1}, "phases.backward"),
    ("step", 0, "step"),
    ("rank", -1, "rank"),
])
def test_step_reports_refuse_out_of_range_values(field, value, where):
    wire = dump(step_report())
    wire[field] = value
    with pytest.raises(ProtocolError) as raised:
        parse(StepReport, wire)
    assert raised.value.field == where


def test_an_unknown_event_kind_is_refused():
    with pytest.raises(ProtocolError, match="must be one of"):
        parse(Event, dump(event(kind="bored")))


def test_control_defaults_mean_carry_on():
    control = parse(Control, {"generation": 4})
    assert (control.stale, control.checkpoint_now, control.pause, control.checkpoint_interval_steps) == (
        False, False, False, None)
    with pytest.raises(ProtocolError):
        parse(Control, {"generation": 4, "checkpoint_interval_steps": 0})


def test_the_reports_answer_carries_control():
    answer = parse(ReportsAccepted, {"accepted": 2, "duplicates": 1, "control": {"generation": 4, "pause": True}})
    assert answer.control.pause and answer.duplicates == 1


def test_a_checkpoint_commit_round_trips():
    commit = CheckpointCommit(job="7", generation=3, step=40, path="/ckpt/step-00000040-g3-abc", loss=2.1,
                              config_hash="bc31edbc9a7c7c70", data_cursor=320, world_size=2, size_bytes=10_000,
                              blocking_s=0.03, total_s=1.2, manifest={"step": 40, "files": []})
    assert parse(CheckpointCommit, dump(commit)) == commit


def test_exit_codes_are_distinct_and_outside_the_signal_range():
    codes = {EXIT_PAUSED, EXIT_STALE_GENERATION, EXIT_RESUME_REFUSED}
    assert len(codes) == 3 and all(1 < code < 128 for code in codes)
