"""Overload (nodes.services.overload, core.refusals): a node or job whose requests admission control
refused is spared, one by one, until a timeout after its last attempt, and nobody else is; while
heartbeats are answered late, a silent node is not declared unreachable and no job is hung."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from agents.hooks.reporter import Reporter
from core.events import EventKind
from core.models import ApiToken, hash_token
from dashboard.metrics import render
from jobs import progress
from jobs.choices import JobState
from jobs.models import Event, Job
from nodes import tasks
from nodes.choices import Health
from nodes.models import Node
from nodes.services import overload

T0 = "2026-11-30 12:00:00Z"


@pytest.fixture
def fleet(cast, settings, redis_counts):
    """Three nodes heartbeating every 2 s (deadline and window 6 s); hold at most 60 s."""
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "HEARTBEAT_INTERVAL_S": 2, "HEARTBEAT_MISSES": 3,
                           "FLEET_SILENCE_FRACTION": 0.55, "FLEET_SILENCE_MIN_NODES": 2, "FLEET_SILENCE_HOLD_S": 60,
                           "OVERLOAD_HEARTBEAT_REFUSALS": 1, "OVERLOAD_REFUSALS": 100, "OVERLOAD_LATE_HEARTBEATS": 10,
                           "OVERLOAD_QUEUE_DEPTH": 1000, "OVERLOAD_HOLD_S": 60}
    node3 = Node.objects.create(hostname="gpu-03", address="10.0.0.3", health="healthy")
    return [cast.node1, cast.node2, node3]


def beat(*nodes):
    for node in nodes:
        Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now(),
                                               heartbeat_deadline=timezone.now() + timedelta(seconds=6))


def shed(counts, *callers: str, **refused):
    """What the web processes would have added: 503s by class, now, and the raw tokens they refused."""
    counts.add({f"refused:{kind}": n for kind, n in refused.items()}, at=time.time(),
               refused={hash_token(raw): time.time() for raw in callers})


def late(counts, n: int = 10):
    """Heartbeats answered late (queued behind other work), now."""
    counts.add({"late:priority": n}, at=time.time())


def transitions() -> list[str]:
    return list(Event.objects.filter(kind=EventKind.FLEET_OVERLOAD).order_by("created_at", "pk")
                .values_list("new_state", flat=True))


def hung_job(cast) -> Job:
    Job.objects.filter(pk=cast.job.pk).update(state=JobState.RUNNING, generation=1,
                                              progress_deadline=timezone.now() - timedelta(seconds=1))
    return cast.job


def health(node) -> str:
    return Node.objects.get(pk=node.pk).health


@pytest.mark.django_db
def test_a_node_whose_heartbeats_were_refused_is_spared_until_a_timeout_after_its_last_attempt(
        cast, fleet, redis_counts, settings):
    """gpu-01's heartbeats were refused (alive, our fault); gpu-03 sent nothing (dead). One verdict,
    the right one, at once; gpu-01 too once it stops trying: a node dying in an overload is found."""
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "FLEET_SILENCE_FRACTION": 0.9}  # 2 of 3 silent: not ours
    forged = "nw_" + "x" * 43  # a token nobody holds names nobody
    with time_machine.travel(T0, tick=False) as clock:
        beat(*fleet)
        clock.shift(5)
        beat(fleet[1])
        shed(redis_counts, cast.tokens["agent"], forged, priority=40, other=900)
        clock.shift(2)  # T0+7: gpu-01 and gpu-03 past their deadlines (T0+6)
        assert tasks.expire_heartbeats() == 1
        assert [health(n) for n in fleet] == [Health.HEALTHY, Health.HEALTHY, Health.UNREACHABLE]
        assert Node.objects.get(pk=fleet[0].pk).heartbeat_deadline == timezone.now() - timedelta(seconds=2) + \
            timedelta(seconds=6)  # a timeout after the refusal at T0+5
        clock.shift(3)
        beat(fleet[1])
        assert tasks.expire_heartbeats() == 0  # T0+10: still within a timeout of its last attempt
        metrics = render().decode()
        assert "nightwatch_overloaded 1.0" in metrics
        assert "nightwatch_overload_hold 0.0" in metrics
        assert "nightwatch_heartbeat_expiry_spared_nodes_total 1.0" in metrics  # at T0+7
        clock.shift(2)
        beat(fleet[1])
        assert tasks.expire_heartbeats() == 1  # T0+12: it stopped trying at T0+5
    assert [health(n) for n in fleet] == [Health.UNREACHABLE, Health.HEALTHY, Health.UNREACHABLE]
    assert transitions() == ["overloaded", "recovered"]  # T0+12: a window without a refusal
    recovered = Event.objects.get(kind=EventKind.FLEET_OVERLOAD, new_state="recovered")
    assert "deadlines_reset" not in recovered.evidence  # nobody was held, so nothing starts over
    event = Event.objects.get(kind=EventKind.FLEET_OVERLOAD, new_state="overloaded")
    assert (event.evidence["heartbeats_refused"], event.evidence["refused"]) == (40, 940)
    assert "40 heartbeats refused in the last 6 s" in event.reason
    assert "spared one by one" in event.reason


@pytest.mark.django_db
def test_a_job_whose_reports_were_refused_is_not_hung_until_a_timeout_after_its_last_attempt(
        cast, fleet, redis_counts):
    _, job_token = ApiToken.issue(name="hooks", scope="job", job=cast.job, generation=1)
    _, fenced = ApiToken.issue(name="hooks-0", scope="job", job=cast.job, generation=0)
    with time_machine.travel(T0, tick=False) as clock:
        job = hung_job(cast)
        shed(redis_counts, job_token, fenced, other=500)
        assert progress.expire_one_progress_deadline() is True  # spared: its deadline moved
        timeout = progress.progress_timeout_s(job, [])
        assert Job.objects.get(pk=job.pk).progress_deadline == timezone.now() + timedelta(seconds=timeout)
        assert progress.expire_one_progress_deadline() is False
        assert not job.incidents.exists()
        clock.shift(timeout + 1)  # its hooks stopped trying a timeout ago: hung
        assert progress.expire_one_progress_deadline() is True
    assert job.incidents.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("retry_after_max_s, spared_s", [(10, 15), (1, 15), (20, 30)])
def test_a_fast_jobs_refused_reports_are_waited_for_as_long_as_its_reporter_backs_off(
        cast, fleet, redis_counts, settings, retry_after_max_s, spared_s):
    """A 2 s progress timeout is shorter than the wait of a reporter refused again and again (up to
    the longer of its 10 s backoff and the server's longest Retry-After, plus jitter): the job is
    spared for that long after its last refusal, not 2 s."""
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "RETRY_AFTER_MAX_S": retry_after_max_s}
    assert Reporter.__init__.__kwdefaults__["max_backoff"] == progress.REPORTER_MAX_BACKOFF_S
    assert progress.refused_retry_within_s() == spared_s
    _, job_token = ApiToken.issue(name="hooks", scope="job", job=cast.job, generation=1)
    Job.objects.filter(pk=cast.job.pk).update(recovery_policy={"progress_timeout_s": 2})
    with time_machine.travel(T0, tick=False) as clock:
        job = hung_job(cast)
        shed(redis_counts, job_token, other=500)
        refused_at = timezone.now()
        clock.shift(spared_s - 1)  # the reporter may still be backing off
        assert progress.expire_one_progress_deadline() is True and not job.incidents.exists()
        spared_until = refused_at + timedelta(seconds=spared_s)
        assert Job.objects.get(pk=job.pk).progress_deadline == spared_until
        clock.shift(2)  # no try for longer than any backoff: hung
        assert progress.expire_one_progress_deadline() is True
    assert job.incidents.count() == 1


@pytest.mark.django_db
def test_refusals_before_rank_0_delivered_everything_it_had_spare_nothing(cast, fleet, redis_counts):
    """Bench.fleet's run O: a hung job's last steps arrived 28 s late, behind refusals of its
    reports, and the refusals went on sparing it for a timeout more. Once rank 0's reporter says
    nothing waits behind its batch (``newest_step_age_s``), what was refused before has arrived: only
    a refusal after that spares the job."""
    from agents.protocol import parse
    from agents.protocol.hooks import ReportBatch
    from jobs import ingest
    from jobs.models import Generation

    _, job_token = ApiToken.issue(name="hooks", scope="job", job=cast.job, generation=1)
    Job.objects.filter(pk=cast.job.pk).update(recovery_policy={"progress_timeout_s": 2})
    Generation.objects.create(job=cast.job, number=1, world_size=2, started_at=timezone.now())

    def caught_up(step, age_s):
        report = {"job": str(cast.job.pk), "generation": 1, "rank": 0, "step": step, "loss": 2.0, "grad_norm": 1.0,
                  "world_size": 2, "data_cursor": 8 * step, "samples": 8, "phases": {"compute": 0.5},
                  "time": timezone.now().timestamp() - age_s}
        batch = {"job": str(cast.job.pk), "generation": 1, "reports": [report], "newest_step_age_s": age_s}
        ingest.record_reports(Job.objects.get(pk=cast.job.pk), parse(ReportBatch, batch), actor="test")

    with time_machine.travel(T0, tick=False) as clock:
        job = hung_job(cast)
        shed(redis_counts, job_token, other=500)
        clock.shift(1)
        caught_up(40, age_s=10.0)  # its held-back steps, the newest 10 s old, and nothing behind them
        assert Job.objects.get(pk=job.pk).progress_deadline < timezone.now()
        assert progress.expire_one_progress_deadline() is True
        assert job.incidents.count() == 1

        Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING)
        job.incidents.all().delete()
        clock.shift(1)
        caught_up(41, age_s=10.0)
        clock.shift(1)
        shed(redis_counts, job_token, other=500)  # refused after: newer steps may be held back again
        assert progress.expire_one_progress_deadline() is True
        assert not job.incidents.exists()


@pytest.mark.django_db
def test_a_fenced_generations_refused_reports_do_not_spare_the_current_one(cast, fleet, redis_counts):
    _, fenced = ApiToken.issue(name="hooks-0", scope="job", job=cast.job, generation=0)
    with time_machine.travel(T0, tick=False):
        job = hung_job(cast)
        shed(redis_counts, fenced, other=500)
        assert progress.expire_one_progress_deadline() is True
    assert job.incidents.count() == 1


@pytest.mark.django_db
def test_the_hold_lifts_after_a_clean_window_and_deadlines_start_over(cast, fleet, redis_counts):
    with time_machine.travel(T0, tick=False) as clock:
        beat(*fleet)
        clock.shift(5)
        beat(fleet[1], fleet[2])
        late(redis_counts)  # gpu-01's heartbeat may be one of those waiting in our queue
        clock.shift(2)
        assert tasks.expire_heartbeats() == 0
        job = hung_job(cast)
        assert progress.expire_one_progress_deadline() is False  # the jobs' sweep holds too
        for _ in range(4):  # 8 s without a refusal: a whole window in which we kept up
            clock.shift(2)
            beat(fleet[1], fleet[2])
        assert tasks.expire_heartbeats() == 0  # the lift: gpu-01's deadline starts over
        lifted_at = timezone.now()
        assert Node.objects.get(pk=fleet[0].pk).heartbeat_deadline == lifted_at + timedelta(seconds=6)
        assert Job.objects.get(pk=job.pk).progress_deadline >= lifted_at + timedelta(seconds=6)
        clock.shift(4)
        beat(fleet[1], fleet[2])
        assert tasks.expire_heartbeats() == 0  # not all at once the moment it lifted
        clock.shift(3)
        beat(fleet[1], fleet[2])
        assert tasks.expire_heartbeats() == 1  # still silent a timeout later: gone for real
    assert [health(n) for n in fleet] == [Health.UNREACHABLE, Health.HEALTHY, Health.HEALTHY]
    assert transitions() == ["overloaded", "recovered"]
    recovered = Event.objects.filter(kind=EventKind.FLEET_OVERLOAD).last()
    assert recovered.evidence["deadlines_reset"] == {"nodes": 1, "jobs": 1}
    assert "nightwatch_overload_hold 0.0" in render().decode()


@pytest.mark.django_db
def test_a_hold_longer_than_its_bound_is_given_up(fleet, redis_counts, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "OVERLOAD_HOLD_S": 10}
    with time_machine.travel(T0, tick=False) as clock:
        beat(*fleet)
        for _ in range(6):  # 12 s of late heartbeats; gpu-01 silent throughout
            late(redis_counts)
            clock.shift(2)
            beat(fleet[1], fleet[2])
            tasks.expire_heartbeats()
        assert transitions() == ["overloaded", "given_up"]
        assert health(fleet[0]) == Health.UNREACHABLE
        assert not overload.holding()
        clock.shift(8)  # the overload ends
        beat(fleet[1], fleet[2])
        tasks.expire_heartbeats()
    assert transitions() == ["overloaded", "given_up", "recovered"]


@pytest.mark.django_db
def test_refused_bulk_below_its_threshold_and_no_refusals_at_all_do_not_hold(fleet, redis_counts):
    with time_machine.travel(T0, tick=False) as clock:
        beat(*fleet)
        clock.shift(5)
        beat(fleet[1], fleet[2])
        shed(redis_counts, other=99)  # step reports shed, heartbeats all admitted
        clock.shift(2)
        assert tasks.expire_heartbeats() == 1
    assert health(fleet[0]) == Health.UNREACHABLE
    assert transitions() == []


@pytest.mark.django_db
def test_refusals_of_others_hold_neither_sweep(cast, fleet, redis_counts):
    """Heartbeats and reports refused, none of them gpu-01's or the job's: silent is silent."""
    with time_machine.travel(T0, tick=False) as clock:
        beat(*fleet)
        clock.shift(5)
        beat(fleet[1], fleet[2])
        shed(redis_counts, cast.tokens["agent2"], priority=30, other=500)
        clock.shift(2)
        assert tasks.expire_heartbeats() == 1
        job = hung_job(cast)
        assert progress.expire_one_progress_deadline() is True
    assert health(fleet[0]) == Health.UNREACHABLE
    assert job.incidents.exists()
    assert transitions() == ["overloaded"]


@pytest.mark.django_db
def test_late_heartbeats_are_overload_and_a_deep_queue_is_when_bounded(fleet, redis_counts, settings):
    now = timezone.now()
    redis_counts.add({"late:priority": 10}, at=now.timestamp())
    assert overload.measure(now).reasons() == ["10 heartbeats answered 2 s or more late in the last 6 s"]
    redis = redis_counts.client()
    redis.delete("celery")  # tasks earlier tests queued in this run's own Redis database
    redis.rpush("celery", *[b"x"] * 1000)
    try:
        assert "1000 tasks waiting in the Celery queue" in overload.measure(now).reasons()
        settings.NIGHTWATCH = {**settings.NIGHTWATCH, "OVERLOAD_QUEUE_DEPTH": 0}  # the default: off
        assert overload.measure(now).queue_depth == 1000
        assert overload.measure(now).reasons() == ["10 heartbeats answered 2 s or more late in the last 6 s"]
    finally:
        redis.delete("celery")


@pytest.mark.django_db
def test_without_redis_the_signals_are_unknown_and_nothing_holds(fleet, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there: Redis is down
    load = overload.measure(timezone.now())
    assert (load.refused, load.heartbeats_refused, load.late_heartbeats, load.queue_depth) == (None, None, None, None)
    assert load.reasons() == []
    settings.REDIS_URL = ""  # the embedded demo: no Redis at all
    assert overload.measure(timezone.now()).reasons() == []
