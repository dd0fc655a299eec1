from datetime import UTC, datetime, timedelta

from jobs.goodput_math import IncidentTimes, compute

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_no_incident_only_startup_and_checkpoint_stalls():
    g = compute(started_at=at(0), now=at(1000), first_step_at=at(10), incidents=[], median_step_s=0.5,
                checkpoint_blocking_s=5)
    assert g.badput_s["startup"] == 10 and g.badput_s["checkpoint_stall"] == 5
    assert g.productive_s == 985 and abs(g.ettr - 0.985) < 1e-9


def test_an_incident_costs_detection_restart_lost_work_and_paused_time():
    incident = IncidentTimes(fault_at=at(100), detected_at=at(103), first_step_at=at(163), lost_steps=20,
                             paused_s=40)
    g = compute(started_at=at(0), now=at(1000), first_step_at=at(0), incidents=[incident], median_step_s=0.5,
                checkpoint_blocking_s=0)
    assert g.badput_s == {"startup": 0, "detection": 3, "restart": 20, "paused": 40, "lost_work": 10,
                          "checkpoint_stall": 0}
    assert g.productive_s == 1000 - 73
    assert abs(sum(g.badput_s.values()) + g.productive_s - g.wall_s) < 1e-9


def test_an_open_incident_counts_until_now_and_productive_never_goes_negative():
    incident = IncidentTimes(fault_at=None, detected_at=at(10), first_step_at=None, lost_steps=10_000)
    g = compute(started_at=at(0), now=at(100), first_step_at=at(1), incidents=[incident], median_step_s=1,
                checkpoint_blocking_s=0)
    assert g.badput_s["restart"] == 90
    assert g.productive_s == 0 and g.ettr == 0
