from datetime import UTC, datetime, timedelta

import pytest

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


def test_a_step_less_stretch_counts_as_badput_while_it_happens():
    """Issue 21: during a 15 s hang ETTR rose (wall time grew, badput did not) and only fell at
    detection. Past the grace, the stretch since the last step is detection time as it happens."""
    def ettr(now: float, **extra) -> float:
        return compute(started_at=at(0), now=at(now), first_step_at=at(10), incidents=[], median_step_s=0.5,
                       checkpoint_blocking_s=0, last_step_at=at(60), stall_grace_s=3.0, **extra).ettr

    within_grace = compute(started_at=at(0), now=at(62), first_step_at=at(10), incidents=[], median_step_s=0.5,
                           checkpoint_blocking_s=0, last_step_at=at(60), stall_grace_s=3.0)
    assert within_grace.badput_s["detection"] == 0  # a step or a report batch may still be on its way
    hung = [ettr(t) for t in (64, 67, 70, 75)]
    assert hung == sorted(hung, reverse=True) and hung[0] < 50 / 62  # falls while the hang goes on
    assert abs(ettr(75) - 50 / 75) < 1e-9  # productive: 10 s → 60 s only
    # Detected at 75 (fault_at = the last step, as the hang sweep records it): the incident's span
    # takes over and the figure does not jump.
    incident = IncidentTimes(fault_at=at(60), detected_at=at(75), first_step_at=None)
    detected = compute(started_at=at(0), now=at(75), first_step_at=at(10), incidents=[incident], median_step_s=0.5,
                       checkpoint_blocking_s=0, last_step_at=at(60), stall_grace_s=3.0)
    assert detected.badput_s["detection"] == 15 and abs(detected.ettr - ettr(75)) < 1e-9
    # A job that stepped recently, or is not running (last_step_at not given), has no stall.
    assert compute(started_at=at(0), now=at(75), first_step_at=at(10), incidents=[], median_step_s=0.5,
                   checkpoint_blocking_s=0, last_step_at=None).badput_s["detection"] == 0


@pytest.mark.django_db
def test_the_status_ettr_falls_during_a_hang_not_only_at_detection(running, api, cast):
    """The figure ``launch --wait`` and the dashboard show (``goodput_of``), from the database."""
    from django.utils import timezone

    from jobs.goodput import goodput_of
    from jobs.models import Generation, Job

    now = timezone.now()
    Generation.objects.create(job=running, number=1, world_size=2, state="running",
                              started_at=now - timedelta(seconds=100), first_step_at=now - timedelta(seconds=90))
    Job.objects.filter(pk=running.pk).update(last_step_at=now - timedelta(seconds=1))
    running.refresh_from_db()
    stepping = goodput_of(running, now=now)
    assert stepping.badput_s["detection"] == 0 and abs(stepping.ettr - 0.9) < 1e-6
    Job.objects.filter(pk=running.pk).update(last_step_at=now - timedelta(seconds=20))  # hung for 20 s
    running.refresh_from_db()
    hung = goodput_of(running, now=now)
    assert hung.badput_s["detection"] == pytest.approx(20, abs=0.01) and hung.ettr == pytest.approx(0.7, abs=1e-4)
    body = api(cast.tokens["viewer"]).get(f"/api/v1/jobs/{running.pk}/status").json()
    assert body["ettr"] < 0.71
    Job.objects.filter(pk=running.pk).update(state="paused")  # not running: no stall is counted
    running.refresh_from_db()
    assert goodput_of(running, now=now).badput_s["detection"] == 0
