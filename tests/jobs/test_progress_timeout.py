"""Issue 20: the progress timeout comes from the job's own rhythm (3 × the p99 of its recent step
times + 1 s, at least 2 s, or the policy's override), so a fast job is found hung in seconds while
a checkpoint save or a slow first step is never taken for a hang; a hang dates from the last step,
and the verdict comes within the timeout of it. A rank an agent found gone holds the verdict for the
crash's exit report (``rank_gone``), and the hooks' word that the loop is done (``run_ending``)
holds it while the run saves and exits, each for a bounded wait."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.conf import settings
from django.utils import timezone

from agents.protocol import agent as wire
from agents.protocol import dump, parse
from agents.protocol import hooks as hooks_protocol
from checkpoints.models import Checkpoint
from jobs import ingest, progress
from jobs.api.serializers import RecoveryPolicySerializer
from jobs.choices import JobState
from jobs.models import Generation, Incident, Job
from nodes.models import Node
from nodes.services import ingest as node_ingest

#: A day ahead of the real clock, in whole seconds: the ``job`` fixture's generation starts at the real
#: time, and a fault is never dated before its generation started (``exit_fault_time``). A fixed T0
#: made the rank's-death test fail on the day itself once the real clock passed it.
T0 = (timezone.now() + timedelta(days=1)).replace(microsecond=0)
FAST = {"input": 0.01, "compute": 0.07, "optimizer": 0.02}  # a 0.1 s step


# --- the rule, pure --------------------------------------------------------------------------

SAVED = [0.05]  # one measured save that blocked training for 50 ms (an async save)


def test_the_timeout_is_three_p99_steps_plus_a_second():
    steps = [5.0] * 98 + [6.0, 9.0]  # p99 of 100 steps: the 99th slowest, 6 s
    assert progress.rhythm_timeout_s(steps, SAVED) == pytest.approx(3 * 6.0 + 1.0)


def test_a_fast_job_gets_the_floor_and_a_slow_one_its_rhythm():
    assert progress.rhythm_timeout_s([0.1] * 50, SAVED) == progress.PROGRESS_TIMEOUT_FLOOR_S == 2.0
    assert progress.rhythm_timeout_s([1.5] * 50, SAVED) == pytest.approx(3 * 1.55 + 1.0)  # 5.65 s: past the floor
    assert progress.rhythm_timeout_s([3.0] * 50, SAVED) == pytest.approx(3 * (3.0 + 0.05) + 1.0)  # with its save


def test_no_step_history_gives_no_rhythm():
    assert progress.rhythm_timeout_s([]) is None
    assert progress.rhythm_timeout_s([], [5.0]) is None


def test_a_recent_checkpoint_save_counts_as_a_step_that_blocked_that_long():
    """A save every 500 steps is not among the last 50; its blocking time keeps it in the rhythm."""
    assert progress.rhythm_timeout_s([0.1] * 50, [9.0]) == pytest.approx(3 * 9.1 + 1.0)


def test_before_any_save_is_measured_the_next_saves_stall_is_unknown():
    assert progress.rhythm_timeout_s([0.1] * 50) == progress.UNMEASURED_SAVE_FLOOR_S
    assert progress.rhythm_timeout_s([10.0] * 50) == pytest.approx(31.0)


def test_the_percentile_is_a_value_that_occurred():
    assert progress.percentile([3.0, 1.0, 2.0], 99) == 3.0
    assert progress.percentile([1.0] * 99 + [9.0], 99) == 1.0
    assert progress.percentile([1.0] * 98 + [9.0, 9.0], 99) == 9.0


def test_a_policy_override_wins_over_the_rhythm(cast):
    cast.job.recovery_policy = {"progress_timeout_s": 7}
    assert progress.progress_timeout_s(cast.job, [0.1] * 50, [3.0]) == 7.0
    cast.job.recovery_policy = {}
    assert progress.progress_timeout_s(cast.job, []) == progress.DEFAULT_PROGRESS_TIMEOUT_S
    assert progress.progress_timeout_s(cast.job, [0.1] * 50, SAVED) == progress.PROGRESS_TIMEOUT_FLOOR_S


def test_the_deadline_runs_from_the_steps_own_time_within_a_bounded_lag():
    now = T0
    assert progress.progress_anchor(now, None) == now
    assert progress.progress_anchor(now, now - timedelta(seconds=0.1)) == now - timedelta(seconds=0.1)
    # A report waits up to the reporter's flush interval (1 s) after its step: all of it is trusted.
    assert progress.progress_anchor(now, now - timedelta(seconds=0.9)) == now - timedelta(seconds=0.9)
    lag = timedelta(seconds=progress.ANCHOR_LAG_MAX_S)
    assert progress.progress_anchor(now, now - timedelta(seconds=30)) == now - lag  # a node clock behind ours
    assert progress.progress_anchor(now, now + timedelta(seconds=30)) == now  # a node clock ahead


def test_a_rank_with_nothing_held_back_dates_its_step_by_the_age_it_gives():
    """The age is the rank's own measure (no skew), so it is trusted past ``ANCHOR_LAG_MAX_S``."""
    now = T0
    assert progress.progress_anchor(now, now - timedelta(seconds=30), 27.5) == now - timedelta(seconds=27.5)
    assert progress.progress_anchor(now, now + timedelta(seconds=30), 0.4) == now - timedelta(seconds=0.4)
    assert progress.progress_anchor(now, None, 0.0) == now


@pytest.mark.parametrize("value, ok", [(1, False), (2, True), (5, True), (None, True)])
def test_the_api_accepts_an_override_down_to_the_floor(value, ok):
    serializer = RecoveryPolicySerializer(data={"progress_timeout_s": value})
    assert serializer.is_valid() is ok, serializer.errors


# --- through the reports endpoint's ingest ---------------------------------------------------

@pytest.fixture
def job(cast):
    """cast.job running generation 1 on node1, its timeout derived (no policy override); one of its
    saves, from an earlier run, blocked training for 50 ms."""
    Job.objects.filter(pk=cast.job.pk).update(state=JobState.RUNNING, generation=1, recovery_policy={})
    generation = Generation.objects.create(job=cast.job, number=1, world_size=2, started_at=timezone.now())
    generation.nodes.add(cast.node1)
    cast.job.refresh_from_db()
    committed(cast.job, 0, 0.05)
    return cast.job


def committed(job, step, blocking_s):
    """A checkpoint of ``step`` in the registry, whose save blocked training ``blocking_s``."""
    Checkpoint.objects.create(job=job, step=step, location=f"/ckpt/{job.pk}/{step}", blocking_s=blocking_s)


def report(job, step, phases, *, at=None):
    """Rank 0's report of ``step`` (ending now, by the hooks' clock), ingested."""
    stamp = (at or timezone.now()).timestamp()
    body = {"job": str(job.pk), "generation": 1,
            "reports": [{"job": str(job.pk), "generation": 1, "rank": 0, "step": step, "loss": 2.0,
                         "grad_norm": 1.0, "world_size": 2, "data_cursor": 8 * step, "samples": 8,
                         "phases": phases, "time": stamp}]}
    ingest.record_reports(Job.objects.get(pk=job.pk), parse(hooks_protocol.ReportBatch, body), actor="test")


def train(job, clock, steps, phases=FAST, seconds=0.1, first=1):
    for step in range(first, first + steps):
        clock.shift(seconds)
        report(job, step, phases)


@pytest.mark.django_db
def test_a_fast_job_that_stops_stepping_is_hung_within_seconds_and_dates_from_its_last_step(job):
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 30)
        last_step = timezone.now()
        # Due one sweep early, so that a sweep running every PROGRESS_SWEEP_INTERVAL_S finds it in time.
        due = progress.PROGRESS_TIMEOUT_FLOOR_S - settings.PROGRESS_SWEEP_INTERVAL_S
        clock.shift(due - 0.05)
        assert not progress.expire_one_progress_deadline()
        clock.shift(0.1)
        assert progress.expire_one_progress_deadline()
        incident = Incident.objects.get(job=job)
        assert incident.evidence["signal"] == "hang"
        assert incident.fault_at == last_step  # the last progress, not the verdict
        detected_s = (incident.detected_at - incident.fault_at).total_seconds()
        assert detected_s == pytest.approx(due + 0.05) and detected_s < progress.PROGRESS_TIMEOUT_FLOOR_S


@pytest.mark.django_db
def test_a_hang_dates_from_the_steps_own_time_not_the_reports_arrival(job):
    """The reporter sends once a second: the last step's report arrives up to a second after it."""
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 10)
        clock.shift(0.1)
        stepped = timezone.now()
        clock.shift(0.8)  # the report waited for the reporter's next flush
        report(job, 11, FAST, at=stepped)
        timeout = progress.PROGRESS_TIMEOUT_FLOOR_S
        lead = timedelta(seconds=settings.PROGRESS_SWEEP_INTERVAL_S)
        assert Job.objects.get(pk=job.pk).progress_deadline == stepped + timedelta(seconds=timeout) - lead
        clock.shift(0.2)
        slow_clock_step = timezone.now() - timedelta(seconds=3)  # a node clock 3 s behind ours
        report(job, 12, FAST, at=slow_clock_step)
        # The deadline ran from at most ANCHOR_LAG_MAX_S before the arrival...
        anchored = timezone.now() - timedelta(seconds=progress.ANCHOR_LAG_MAX_S)
        assert Job.objects.get(pk=job.pk).progress_deadline == anchored + timedelta(seconds=timeout) - lead
        clock.shift(timeout)
        assert progress.expire_one_progress_deadline()
        # ...and the fault from the newest step's own time (the slow clock's report dates nothing earlier).
        assert Incident.objects.get(job=job).fault_at == stepped


@pytest.mark.django_db
def test_steps_held_back_by_overload_are_dated_by_their_age_so_a_hang_is_found_as_they_arrive(job):
    """Bench.fleet's run O: the injected hang's last steps waited 28 s in a spool that admission
    control kept refusing, and the deadline ran a whole timeout from their arrival (found 47 s after
    the hang, against a 20 s timeout). The batch that left nothing behind said how old its newest
    step was: the deadline runs from then, so the hang is found as the steps arrive. A batch with
    more behind it keeps the old rule: the newer steps are on their way."""
    timeout = progress.PROGRESS_TIMEOUT_FLOOR_S
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 10)
        stepped = timezone.now()  # step 10 ended, then the job hung; its reports were held back
        clock.shift(timeout + 20)
        batch = {"job": str(job.pk), "generation": 1, "newest_step_age_s": timeout + 20,
                 "reports": [{"job": str(job.pk), "generation": 1, "rank": 0, "step": 11, "loss": 2.0,
                              "grad_norm": 1.0, "world_size": 2, "data_cursor": 88, "samples": 8,
                              "phases": FAST, "time": stepped.timestamp()}]}
        held = {**batch, "newest_step_age_s": None}
        ingest.record_reports(Job.objects.get(pk=job.pk), parse(hooks_protocol.ReportBatch, held), actor="test")
        assert not progress.expire_one_progress_deadline()  # more may follow: a timeout from the arrival
        batch["reports"][0]["step"] = 12
        ingest.record_reports(Job.objects.get(pk=job.pk), parse(hooks_protocol.ReportBatch, batch), actor="test")
        assert Job.objects.get(pk=job.pk).progress_deadline < timezone.now()
        assert progress.expire_one_progress_deadline()
        incident = Incident.objects.get(job=job)
        assert incident.evidence["signal"] == "hang"
        assert incident.fault_at == stepped  # the step's age before its arrival: the hang, not the arrival


@pytest.mark.django_db
def test_an_age_past_the_generations_start_dates_the_hang_from_the_start(job):
    """The hooks are untrusted: a batch that claims its newest step is days old cannot date the hang
    (and the badput counted from it) before the generation began."""
    started = Generation.objects.get(job=job, number=1).started_at
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 10)
        batch = {"job": str(job.pk), "generation": 1, "newest_step_age_s": 3 * 86400.0,
                 "reports": [{"job": str(job.pk), "generation": 1, "rank": 0, "step": 11, "loss": 2.0,
                              "grad_norm": 1.0, "world_size": 2, "data_cursor": 88, "samples": 8,
                              "phases": FAST, "time": timezone.now().timestamp()}]}
        ingest.record_reports(Job.objects.get(pk=job.pk), parse(hooks_protocol.ReportBatch, batch), actor="test")
        assert progress.expire_one_progress_deadline()
        assert Incident.objects.get(job=job).fault_at == started


@pytest.mark.django_db
def test_another_ranks_word_on_its_steps_age_does_not_date_the_jobs_progress(job):
    """Another rank's batch holds only the steps it flagged: that nothing of *that* rank waits says
    nothing of rank 0's reports, which may still be held back."""
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 10)
        flagged = {"job": str(job.pk), "generation": 1, "rank": 1, "step": 11, "loss": 2.0, "grad_norm": 1.0,
                   "world_size": 2, "data_cursor": 88, "samples": 8, "phases": FAST, "spike": True,
                   "time": (timezone.now() - timedelta(seconds=30)).timestamp()}
        batch = {"job": str(job.pk), "generation": 1, "reports": [flagged], "newest_step_age_s": 30.0}
        ingest.record_reports(Job.objects.get(pk=job.pk), parse(hooks_protocol.ReportBatch, batch), actor="test")
        stored = Job.objects.get(pk=job.pk)
        assert stored.progress_caught_up_at is None
        assert stored.progress_deadline > timezone.now()  # the old rule: at most 1 s before the arrival


@pytest.mark.django_db
def test_a_checkpoint_stall_is_not_a_hang(job):
    """Saves that block 9 s, far past a fast job's 2 s timeout: the steps after one are judged with
    its 9.1 s step in their rhythm, and once it has left the newest 50 steps, with its measured
    blocking time; so the next save is not taken for a hang."""
    with time_machine.travel(T0, tick=False) as clock:
        committed(job, 10, 9.0)
        train(job, clock, 20)
        clock.shift(9.1)  # step 21 blocks on its save
        assert not progress.expire_one_progress_deadline()
        report(job, 21, {**FAST, "checkpoint": 9.0})
        committed(job, 21, 9.0)
        assert progress.job_progress_timeout_s(job) == pytest.approx(3 * 9.1 + 1.0)
        train(job, clock, 60, first=22)  # step 21 leaves the window of the newest 50
        assert progress.job_progress_timeout_s(job) == pytest.approx(3 * 9.1 + 1.0)
        clock.shift(9.1)  # step 82 blocks on the next save
        assert not progress.expire_one_progress_deadline()
        report(job, 82, {**FAST, "checkpoint": 9.0})
        assert not Incident.objects.filter(job=job).exists()


@pytest.mark.django_db
def test_an_occasional_long_step_in_the_window_is_not_a_hang(job):
    """An end-of-epoch stall (a new loader, an evaluation) of 3 s among 0.1 s steps: the next one
    like it, within the newest 50 steps, is inside 3 × 3 + 1 s; a real hang is still found then."""
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 20)
        clock.shift(3.0)
        report(job, 21, {**FAST, "input": 2.91})
        train(job, clock, 20, first=22)
        clock.shift(10.0 - settings.PROGRESS_SWEEP_INTERVAL_S - 0.1)
        assert not progress.expire_one_progress_deadline()
        clock.shift(0.2)
        assert progress.expire_one_progress_deadline()


# --- a rank an agent found gone: the exit report is on its way -----------------------------------

def agent_says(job, node, kind, detail, *, key):
    """The agent of ``node`` reports ``kind`` for the job's generation 1 now, through the ingest."""
    batch = parse(wire.EventBatch, {"events": [{"key": key, "kind": kind, "time": timezone.now().timestamp(),
                                                "job": str(job.pk), "generation": 1, "detail": dump(detail)}]})
    node_ingest.record_agent_events(node, wire.parse_event_details(batch))


def rank_gone(job, node):
    agent_says(job, node, "rank_gone", wire.RankGone(at=timezone.now().timestamp()), key="gone-1")


@pytest.mark.django_db
def test_a_rank_gone_holds_the_verdict_for_the_crashs_own_exit_report(cast, job, eager_celery,
                                                                       django_capture_on_commit_callbacks):
    """The raising rank of tests/e2e/test_recovery.py: torchrun reports it 4-5 s after the last step,
    past a fast job's 2 s timeout. The notice holds the sweep; the report then makes a crash with
    its exception (the pause of a deterministic one needs it), never a hang."""
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 30)
        clock.shift(0.3)
        rank_gone(job, cast.node1)
        clock.shift(progress.PROGRESS_TIMEOUT_FLOOR_S)
        assert progress.expire_one_progress_deadline()  # handled: the deadline waits for the report...
        assert not Incident.objects.filter(job=job).exists()
        assert Job.objects.get(pk=job.pk).progress_deadline == T0 + timedelta(
            seconds=3.0 + 0.3 + progress.RANK_GONE_WAIT_S)
        assert not progress.expire_one_progress_deadline()  # ...and nothing is due meanwhile
        clock.shift(3.0)
        report = wire.ExitReport(exit_code=1, ranks=[wire.RankExit(rank=1, local_rank=1, exit_code=1)],
                                 root_cause_rank=1, signature="traceback", error_line="ValueError: boom at step 30")
        with django_capture_on_commit_callbacks(execute=True):
            agent_says(job, cast.node1, "exited", report, key="exit-1")
        incident = Incident.objects.get(job=job)
        assert (incident.kind, incident.evidence["signal"], incident.evidence["error_line"]) == (
            "crash", "exit", "ValueError: boom at step 30")


@pytest.mark.django_db
def test_without_an_exit_report_within_the_wait_it_is_a_crash_dated_from_the_ranks_death(cast, job):
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 30)
        clock.shift(0.3)
        died = timezone.now()
        rank_gone(job, cast.node1)
        clock.shift(progress.RANK_GONE_WAIT_S - 0.1)
        assert progress.expire_one_progress_deadline()
        assert not Incident.objects.filter(job=job).exists()
        clock.shift(0.2)
        assert progress.expire_one_progress_deadline()
        incident = Incident.objects.get(job=job)
        assert (incident.kind, incident.evidence["signal"]) == ("crash", "exit")
        assert incident.evidence["nodes"] == [cast.node1.hostname]
        assert incident.evidence["detail"]["exit_report"] is None and incident.fault_at == died


@pytest.mark.django_db
def test_steps_after_the_notice_mean_it_stopped_nothing_and_a_later_stop_is_a_hang(cast, job):
    """A rank that ended without stopping training (it finished first, say): the hang rule applies
    to the steps that came after, as if there had been no notice."""
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 10)
        rank_gone(job, cast.node1)
        train(job, clock, 30, first=11)  # 3 s of steps after it
        clock.shift(progress.PROGRESS_TIMEOUT_FLOOR_S)
        assert progress.expire_one_progress_deadline()
        assert Incident.objects.get(job=job).evidence["signal"] == "hang"


@pytest.mark.django_db
def test_a_notice_of_an_earlier_generation_holds_nothing(cast, job):
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 10)
        rank_gone(job, cast.node1)
        Job.objects.filter(pk=job.pk).update(generation=2)  # the notice is generation 1's
        Generation.objects.create(job=job, number=2, world_size=2, started_at=timezone.now()).nodes.add(cast.node1)
        Job.objects.filter(pk=job.pk).update(progress_deadline=timezone.now())
        clock.shift(0.1)
        assert progress.expire_one_progress_deadline()
        assert Incident.objects.get(job=job).evidence["signal"] == "hang"


# --- the hooks said the loop is done: the final save and the exit follow ---------------------------

def hooks_say_the_run_ends(job, step):
    """Rank 0's ``run_ending`` at ``step`` (``agents.hooks.api.Hooks._announce_end``), ingested."""
    body = {"job": str(job.pk), "generation": 1,
            "events": [{"job": str(job.pk), "generation": 1, "rank": 0, "step": step, "kind": "run_ending",
                        "key": f"0:0:{step}:run_ending:0", "message": "training loop done",
                        "detail": {"step": step, "max_steps": step}, "time": timezone.now().timestamp()}]}
    ingest.record_reports(Job.objects.get(pk=job.pk), parse(hooks_protocol.ReportBatch, body), actor="test")


@pytest.mark.django_db
def test_a_run_that_said_it_ends_is_not_hung_while_it_saves_and_exits(job):
    """The quiet after the last step of tests/e2e/test_recovery.py's runs (final save, flush, exit:
    2-4 s) is past the 2 s floor; the word holds the sweep, and a run stuck there is still found."""
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 30)
        hooks_say_the_run_ends(job, 30)
        clock.shift(4.0)
        assert progress.expire_one_progress_deadline()  # handled: the deadline moved to the end of the wait
        assert not Incident.objects.filter(job=job).exists()
        assert Job.objects.get(pk=job.pk).progress_deadline == T0 + timedelta(
            seconds=3.0 + progress.RUN_ENDING_WAIT_S)
        assert not progress.expire_one_progress_deadline()
        clock.shift(progress.RUN_ENDING_WAIT_S - 4.0 + 0.1)
        assert progress.expire_one_progress_deadline()
        assert Incident.objects.get(job=job).evidence["signal"] == "hang"


@pytest.mark.django_db
def test_steps_past_the_word_mean_it_ended_nothing(job):
    """A script with a second loop after the first: its steps go on, and its hangs are found."""
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 10)
        hooks_say_the_run_ends(job, 10)
        train(job, clock, 10, first=11)
        clock.shift(progress.PROGRESS_TIMEOUT_FLOOR_S)
        assert progress.expire_one_progress_deadline()
        assert Incident.objects.get(job=job).evidence["signal"] == "hang"


@pytest.mark.django_db
def test_a_generation_whose_launch_has_not_reached_every_node_is_not_hung_while_starting(cast, job, settings):
    """Under overload a node's heartbeats (which fetch its launch) may be refused for minutes: the
    start-up allowance runs from the last node's acknowledgement, not from the launch."""
    from nodes import services as node_services

    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "STARTUP_TIMEOUT_S": 60}
    with time_machine.travel(T0, tick=False) as clock:
        Job.objects.filter(pk=job.pk).update(state=JobState.INITIALIZING,
                                             progress_deadline=timezone.now() + timedelta(seconds=60))
        launches = [node_services.enqueue_command(node, "launch", job=job, generation=1, payload={
            "script": "train.py", "nnodes": 2, "nproc_per_node": 1, "node_rank": rank,
            "rdzv_endpoint": "10.0.0.1:29400", "rdzv_id": "nw-1-g1"}) for rank, node in enumerate((cast.node1,
                                                                                                cast.node2))]
        clock.shift(45)
        node_services.ack_command(cast.node1, launches[0].pk, wire.CommandAck(
            command_id=str(launches[0].pk), idempotency_key=launches[0].idempotency_key, status="done",
            time=timezone.now().timestamp()), actor="node:gpu-01")
        clock.shift(16)  # past the allowance from the launch; gpu-02's heartbeats never got through
        assert progress.expire_one_progress_deadline()  # handled: held
        assert not Incident.objects.exists()
        assert Job.objects.get(pk=job.pk).progress_deadline == timezone.now() + timedelta(seconds=60)

        clock.shift(30)  # gpu-02 fetches it at last: the allowance runs from its acknowledgement
        node_services.ack_command(cast.node2, launches[1].pk, wire.CommandAck(
            command_id=str(launches[1].pk), idempotency_key=launches[1].idempotency_key, status="done",
            time=timezone.now().timestamp()), actor="node:gpu-02")
        acked_at = timezone.now()
        clock.shift(31)  # the held deadline passes, less than an allowance after the last ack
        assert progress.expire_one_progress_deadline() and not Incident.objects.exists()
        assert Job.objects.get(pk=job.pk).progress_deadline == acked_at + timedelta(seconds=60)
        clock.shift(30)
        assert progress.expire_one_progress_deadline()
        assert Incident.objects.get(job=job).evidence["signal"] == "hang"  # no first step after all


# --- no progress while the job's nodes are silent too: the heartbeat rules speak first ----------

def beat(node, seq):
    """``node``'s agent heartbeats now, through the real service."""
    from nodes.services import fleet

    fleet.record_heartbeat(node, wire.Heartbeat(node_id=node.hostname, seq=seq, time=timezone.now().timestamp()))


@pytest.mark.django_db
def test_steps_that_stop_with_the_nodes_heartbeats_wait_for_the_heartbeat_verdict(cast, job):
    """The chaos run's 30 s outage of the API: a 2-node fleet is too small for the fleet-silence hold
    to engage before a fast job's progress deadline, and the job was declared hung. While none of
    its nodes gets a heartbeat through either, the deadline waits for theirs; the buffered steps that
    arrive with contact move it on, and no incident is opened."""
    from nodes.services import sweeper
    from nodes.services.fleet import heartbeat_interval_s

    with time_machine.travel(T0, tick=False) as clock:
        beat(cast.node1, 1)
        train(job, clock, 30)
        outage = timezone.now()
        heartbeat_deadline = Node.objects.get(pk=cast.node1.pk).heartbeat_deadline
        clock.shift(progress.PROGRESS_TIMEOUT_FLOOR_S)
        # Past the progress deadline, but the node was heard from within 1.5 intervals: not deferred yet.
        # (The ingress is down for the agent too, so neither the node nor the job is heard of.)
        assert timezone.now() - outage < timedelta(seconds=1.5 * heartbeat_interval_s())
        clock.shift(1.5 * heartbeat_interval_s())
        assert progress.expire_one_progress_deadline()  # handled: deferred
        assert not Incident.objects.exists()
        deferred_to = Job.objects.get(pk=job.pk).progress_deadline
        assert deferred_to == max(heartbeat_deadline, timezone.now() + timedelta(seconds=heartbeat_interval_s()))
        assert not sweeper.expire_heartbeats()  # the node's own deadline has not passed either

        clock.shift(3)  # contact: the agent's heartbeat and the hooks' buffered steps arrive
        beat(cast.node1, 2)
        train(job, clock, 5, first=31)
        assert not progress.expire_one_progress_deadline()
        assert not Incident.objects.exists()


@pytest.mark.django_db
def test_a_job_whose_agents_keep_beating_is_hung_on_time(cast, job):
    """Heard-from nodes: no progress is a hang, within the timeout of the last step as before."""
    with time_machine.travel(T0, tick=False) as clock:
        beat(cast.node1, 1)
        train(job, clock, 30)
        clock.shift(progress.PROGRESS_TIMEOUT_FLOOR_S)
        beat(cast.node1, 2)
        assert progress.expire_one_progress_deadline()
        assert Incident.objects.get(job=job).evidence["signal"] == "hang"


@pytest.mark.django_db
def test_once_the_heartbeat_sweep_has_judged_the_silent_node_the_hang_rules_apply_again(cast, job):
    """The deferral lasts until the node's own heartbeat deadline, not for ever: a node marked
    unreachable has none left to wait for."""
    from nodes.services import sweeper

    with time_machine.travel(T0, tick=False) as clock:
        beat(cast.node1, 1)
        train(job, clock, 30)
        heartbeat_deadline = Node.objects.get(pk=cast.node1.pk).heartbeat_deadline
        clock.shift(10)
        assert progress.expire_one_progress_deadline() and not Incident.objects.exists()
        clock.move_to(heartbeat_deadline + timedelta(seconds=0.5))
        assert sweeper.expire_heartbeats() == 1
        assert Node.objects.get(pk=cast.node1.pk).health == "unreachable"
        # (The partition policy's task would act on the job too; the hang sweep no longer waits for it.)
        clock.move_to(Job.objects.get(pk=job.pk).progress_deadline + timedelta(seconds=0.1))
        assert progress.expire_one_progress_deadline()
        assert Incident.objects.get(job=job).evidence["signal"] == "hang"


# --- no progress while the whole fleet is silent: the first seconds of our own outage -------------

def fleet_of(count):
    """``count`` more healthy nodes that heartbeat (the job's node1 is among the heard)."""
    Node.objects.bulk_create(Node(hostname=f"fleet-{i:04}", address=f"10.1.{i // 250}.{i % 250}", health="healthy")
                             for i in range(count))


def all_beat():
    """Every node's heartbeat arrives now (a deadline three intervals on, as the service sets it);
    the fleet is counted afresh, as after any bulk change of it."""
    from nodes.services.fleet import forget_fleet_count, heartbeat_timeout

    now = timezone.now()
    Node.objects.update(last_heartbeat_at=now, heartbeat_deadline=now + heartbeat_timeout())
    forget_fleet_count()


@pytest.mark.django_db
def test_a_deadline_that_runs_out_as_the_whole_fleet_falls_silent_waits_for_contact(cast, job):
    """Bench.fleet's reconnect storm (run N): a training job's deadline ran out 7 s into the web
    processes' outage, with its nodes heard 7-8 s before, too soon for their own silence rule (1.5
    intervals) and for the fleet's. 100 nodes send 20 heartbeats a second: none for 2 s is our outage
    (``silence.lull``), so the verdict waits an interval, and the steps that come with contact move it on."""
    from nodes.services import silence
    from nodes.services.fleet import base_heartbeat_interval_s, heartbeat_interval_s

    fleet_of(98)
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 30)
        all_beat()  # and then nothing: the outage begins
        clock.shift(progress.PROGRESS_TIMEOUT_FLOOR_S)
        assert timezone.now() - Node.objects.get(pk=cast.node1.pk).last_heartbeat_at < timedelta(
            seconds=silence.QUIET_INTERVALS * heartbeat_interval_s())  # the job's own nodes' rule: not yet
        assert silence.lull(timezone.now()) and not silence.held()
        assert progress.expire_one_progress_deadline()  # handled: deferred
        assert not Incident.objects.exists()
        assert Job.objects.get(pk=job.pk).progress_deadline == timezone.now() + timedelta(
            seconds=base_heartbeat_interval_s())

        clock.shift(3)  # contact: the heartbeats and the hooks' buffered steps arrive
        all_beat()
        train(job, clock, 5, first=31)
        assert not progress.expire_one_progress_deadline()
        assert not Incident.objects.exists()


@pytest.mark.django_db
def test_a_fleet_still_heard_from_finds_a_hung_job_on_time(cast, job):
    """The lull is the whole fleet's: with heartbeats arriving from the other nodes a second apart,
    no progress is a hang within the timeout, as before."""
    fleet_of(98)
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 30)
        all_beat()
        clock.shift(progress.PROGRESS_TIMEOUT_FLOOR_S - 0.5)
        Node.objects.filter(hostname="fleet-0007").update(last_heartbeat_at=timezone.now())
        clock.shift(0.5)
        assert progress.expire_one_progress_deadline()
        assert Incident.objects.get(job=job).evidence["signal"] == "hang"


@pytest.mark.django_db
def test_a_lull_is_as_long_as_the_fleet_takes_to_send_twenty_heartbeats(cast):
    """Two nodes at 5 s send 20 heartbeats in 50 s: a small fleet's quiet is left to its nodes' own
    rule. A large one's is at least a second, several times the gap between its heartbeats."""
    from nodes.services import fleet, silence

    with time_machine.travel(T0, tick=False) as clock:
        all_beat()
        assert fleet.heartbeating_nodes() == 2 and fleet.heartbeat_interval_s() == 5
        clock.shift(49.9)
        assert not silence.lull(timezone.now())
        clock.shift(0.1)
        assert silence.lull(timezone.now())

        fleet_of(998)
        all_beat()
        interval = fleet.heartbeat_interval_s()  # paced: 1,000 nodes at 50 a second
        assert interval == 20 and silence.HUSH_BEATS * interval / 1000 < silence.LULL_FLOOR_S
        clock.shift(silence.LULL_FLOOR_S - 0.01)
        assert not silence.lull(timezone.now())
        clock.shift(0.01)
        assert silence.lull(timezone.now())
