"""In-process restarts (issue 20), as the control plane records them (``jobs.inprocess``): rank 0's
``resumed`` event with an ``in_process`` detail, posted by the hooks' reporter, becomes one crash
incident resolved at once (decision ``restart_in_process``), dated from the agent's ``rank_gone``
notice of that death, with the steps it lost and the node it happened on, and counted in goodput;
``recovery_policy.inprocess_restarts`` is taken by the spec API and reaches the launch."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from agents.protocol import agent as wire
from agents.protocol import dump, parse
from agents.protocol.agent import Command, parse_command_payload
from core.events import EventKind
from core.models import Event
from core.tokens import job_token_for
from jobs import inprocess, services, state
from jobs.choices import Decision, IncidentKind, IncidentState, JobState
from jobs.goodput import goodput_of
from jobs.models import Generation, Incident, Job, TrainingEvent
from jobs.policies import RecoveryPolicy
from nodes.models import NodeCommand
from nodes.services import ingest as node_ingest

#: A day ahead of the real clock (as in test_progress_timeout): the generation starts at T0.
T0 = (timezone.now() + timedelta(days=1)).replace(microsecond=0)
FAST = {"input": 0.01, "compute": 0.07, "optimizer": 0.02}  # a 0.1 s step
STEP_S = 0.1


@pytest.fixture
def clock():
    with time_machine.travel(T0, tick=False) as traveller:
        yield traveller


@pytest.fixture
def job(cast, clock):
    """cast.job initializing generation 1 on node1 (two ranks), started at T0."""
    state.transition(cast.job, JobState.INITIALIZING, actor="test")
    Generation.objects.create(job=cast.job, number=1, world_size=2, started_at=timezone.now()).nodes.add(cast.node1)
    cast.job.refresh_from_db()
    return cast.job


@pytest.fixture
def hooks(job, cast, api, django_capture_on_commit_callbacks):
    """``hooks(reports=..., events=...)``: rank 0's reporter posts a batch of generation 1 with the
    generation's job token (what the launch hands train.py), on-commit work run; the answer."""
    client = api(job_token_for(job, 1, cast.node1))

    def post(reports=(), events=(), *, execute=True):
        body = {"job": str(job.pk), "generation": 1, "reports": list(reports), "events": list(events), "windows": []}
        with django_capture_on_commit_callbacks(execute=execute) as callbacks:
            response = client.post(f"/api/v1/jobs/{job.pk}/reports", body, format="json")
        assert response.status_code == 202, response.content
        post.callbacks = callbacks
        return response.json()

    return post


def step(job, number):
    """Rank 0's report of step ``number``, ending now."""
    return {"job": str(job.pk), "generation": 1, "rank": 0, "step": number, "loss": 2.0, "grad_norm": 1.0,
            "world_size": 2, "data_cursor": 8 * number, "samples": 8, "phases": FAST,
            "time": timezone.now().timestamp()}


def train(hooks, job, clock, first, last):
    """Steps ``first``..``last``, one every 0.1 s, each posted as it ends."""
    for number in range(first, last + 1):
        clock.shift(STEP_S)
        hooks(reports=[step(job, number)])


def trained(job, clock, first, last):
    """Steps ``first``..``last``, one every 0.1 s, not yet posted (the reporter's queue)."""
    reports = []
    for number in range(first, last + 1):
        clock.shift(STEP_S)
        reports.append(step(job, number))
    return reports


def rank_gone(job, node, at, stopped_s=None):
    """The agent of ``node`` says a rank of generation 1 died at ``at`` (keyed per death, as
    ``Agent._rank_gone`` does), through the agent events' ingest; with ``stopped_s``, that it found
    the rank stopped at ``at`` and killed it that much later."""
    notice = wire.RankGone(at=at.timestamp(), stopped_s=stopped_s)
    batch = parse(wire.EventBatch, {"events": [{"key": f"rank_gone:{job.pk}:1:{notice.at:.3f}", "kind": "rank_gone",
                                                "time": timezone.now().timestamp(), "job": str(job.pk),
                                                "generation": 1, "detail": dump(notice)}]})
    node_ingest.record_agent_events(node, wire.parse_event_details(batch))


def resumed(job, restored, round_number, *, failed_at=None, rank=0, in_process=True):
    """Rank ``rank``'s ``resumed`` event of round ``round_number`` (``Hooks._resume_from_snapshot``),
    reported now; with the ``in_process`` detail of ``agents.hooks.inprocess.Restart``."""
    detail = {"step": restored, "checkpoint": None, "snapshot": f"step-{restored:08d}", "from_partner": False,
              "world_size": 2, "previous_world_size": 2}
    if in_process:
        detail["in_process"] = {"round": round_number, "restarts": round_number, "error": "",
                                "failed_at": failed_at.timestamp() if failed_at else None,
                                "replacement": failed_at is None}
    return {"job": str(job.pk), "generation": 1, "rank": rank, "step": restored, "kind": "resumed",
            "key": f"0.{round_number}:{rank}:{restored}:resumed:0", "message": f"resumed from step {restored}",
            "detail": detail, "time": timezone.now().timestamp()}


def audit(job, kind):
    return list(Event.objects.filter(job=job, kind=kind).order_by("pk"))


def crash_and_resume(hooks, job, cast, clock, *, restored, round_number, seen_after=0.02, down=1.0):
    """A rank dies 0.05 s on; its agent tells of it 0.05 s later, the survivors' collective breaks
    ``seen_after`` s after the death, and rank 0 reports the next round resumed ``down`` s after it.
    Returns (died, failed_at, resumed_at, the resumed event posted)."""
    clock.shift(0.05)
    died = timezone.now()
    clock.shift(0.05)
    rank_gone(job, cast.node1, died)
    failed_at = died + timedelta(seconds=seen_after)
    clock.shift(down - 0.05)
    event = resumed(job, restored, round_number, failed_at=failed_at)
    hooks(events=[event])
    return died, failed_at, timezone.now(), event


# --- the incident --------------------------------------------------------------------------------

@pytest.mark.django_db
def test_an_in_process_restart_is_one_resolved_crash_dated_from_the_rank_gone_notice(cast, job, hooks, clock):
    train(hooks, job, clock, 1, 12)
    died, failed_at, resumed_at, event = crash_and_resume(hooks, job, cast, clock, restored=10, round_number=1)

    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision, incident.state) == (
        IncidentKind.CRASH, Decision.RESTART_IN_PROCESS, IncidentState.RESOLVED)
    assert incident.generation.number == 1
    assert incident.fault_at == died  # the agent's notice, not the survivors' failed_at nor the report
    assert (incident.detected_at, incident.first_step_at) == (failed_at, resumed_at)
    assert incident.resolved_at is not None
    assert incident.lost_steps == 12 - 10  # trained past the restored snapshot, redone
    # The node is named for the crash-lemon rule, not blamed as hardware (tests/jobs/test_lemon_nodes.py).
    assert incident.evidence["nodes"] == ["gpu-01"] and not incident.nodes.exists()
    assert incident.evidence["resumed_event"] == TrainingEvent.objects.get(job=job, kind="resumed").pk
    [opened], [resolved] = audit(job, EventKind.INCIDENT_OPEN), audit(job, EventKind.INCIDENT_RESOLVED)
    assert (opened.actor, opened.generation, opened.evidence) == (
        "node:gpu-01", 1, {"incident": incident.pk, "decision": "restart_in_process"})
    assert resolved.evidence == {"incident": incident.pk, "decision": "restart_in_process",
                                 "lost_steps": 2, "restored_step": 10}
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING  # the generation goes on

    # The reporter sends the batch again (its answer was lost): a replay, not a second restart; nor
    # is the on-commit work run twice (a retried task).
    clock.shift(0.5)
    hooks(events=[event])
    assert TrainingEvent.objects.filter(job=job).count() == 1
    assert inprocess.record_restart(incident.evidence["resumed_event"]) is None
    assert Incident.objects.filter(job=job).count() == 1
    assert len(audit(job, EventKind.INCIDENT_OPEN)) == len(audit(job, EventKind.INCIDENT_RESOLVED)) == 1

    # The next death in the same generation, and its round: an incident of its own, with its own times.
    train(hooks, job, clock, 11, 20)
    died2, _, resumed_at2, _ = crash_and_resume(hooks, job, cast, clock, restored=18, round_number=2, down=0.6)
    first, second = Incident.objects.filter(job=job).order_by("pk")
    assert (first.fault_at, first.lost_steps) == (died, 2)  # untouched
    assert (second.fault_at, second.first_step_at, second.lost_steps) == (died2, resumed_at2, 20 - 18)
    assert second.decision == Decision.RESTART_IN_PROCESS and second.state == IncidentState.RESOLVED
    assert len(audit(job, EventKind.INCIDENT_OPEN)) == len(audit(job, EventKind.INCIDENT_RESOLVED)) == 2


@pytest.mark.django_db
def test_a_stopped_rank_its_agent_killed_is_a_hang_detected_when_it_was_killed(cast, job, hooks, clock):
    train(hooks, job, clock, 1, 12)
    clock.shift(0.05)
    stopped = timezone.now()  # the agent first saw it stopped
    clock.shift(1.0)
    killed = timezone.now()
    rank_gone(job, cast.node1, stopped, stopped_s=1.0)
    clock.shift(0.6)
    hooks(events=[resumed(job, 11, 1, failed_at=killed + timedelta(seconds=0.02))])
    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision, incident.state) == (
        IncidentKind.HANG, Decision.RESTART_IN_PROCESS, IncidentState.RESOLVED)
    assert (incident.fault_at, incident.detected_at) == (stopped, killed)
    assert "stopped (hung) for 1.0 s, killed by its agent" in incident.classification
    assert incident.evidence["rank_gone"]["stopped_s"] == 1.0 and incident.lost_steps == 1


@pytest.mark.django_db
def test_without_a_notice_the_fault_dates_from_when_the_survivors_saw_the_round_break(job, hooks, clock):
    """The agent's notice lost or not yet in: the hooks' own ``failed_at`` dates it, no node is blamed."""
    train(hooks, job, clock, 1, 12)
    failed_at = timezone.now() + timedelta(seconds=0.1)
    clock.shift(1.0)
    hooks(events=[resumed(job, 10, 1, failed_at=failed_at)])
    incident = Incident.objects.get(job=job)
    assert incident.fault_at == failed_at and incident.evidence["nodes"] == []


@pytest.mark.django_db
def test_a_later_restart_whose_notice_is_not_in_yet_is_not_dated_from_the_earlier_death(cast, job, hooks, clock):
    """The second death's notice comes after its round's resume (the agent's batch refused a while
    under load, say): the first death's notice, already told for the first restart, must not date
    the second one, or the time between the two restarts would count as detection badput."""
    train(hooks, job, clock, 1, 12)
    died, *_ = crash_and_resume(hooks, job, cast, clock, restored=10, round_number=1)
    train(hooks, job, clock, 11, 40)
    failed_at2 = timezone.now() + timedelta(seconds=0.1)
    clock.shift(0.5)
    hooks(events=[resumed(job, 38, 2, failed_at=failed_at2)])
    rank_gone(job, cast.node1, failed_at2)  # late
    first, second = Incident.objects.filter(job=job).order_by("pk")
    assert first.fault_at == died
    assert second.fault_at == failed_at2 and second.evidence["nodes"] == []  # the survivors' word: no notice yet


@pytest.mark.django_db
def test_two_restarts_told_in_one_batch_are_each_dated_from_their_own_death(cast, job, hooks, clock):
    """A rank that dies again right after its round resumed: both rounds' ``resumed`` events wait in
    the reporter's queue for the same flush, after both notices came in."""
    train(hooks, job, clock, 1, 12)
    clock.shift(0.05)
    died = timezone.now()
    rank_gone(job, cast.node1, died)
    clock.shift(0.5)
    first_round = resumed(job, 10, 1, failed_at=died + timedelta(seconds=0.02))
    clock.shift(0.3)
    died2 = timezone.now()
    rank_gone(job, cast.node1, died2)
    clock.shift(0.5)
    second_round = resumed(job, 10, 2, failed_at=died2 + timedelta(seconds=0.02))
    hooks(events=[first_round, second_round])
    first, second = Incident.objects.filter(job=job).order_by("fault_at")
    assert (first.fault_at, second.fault_at) == (died, died2)
    assert first.evidence["in_process"]["round"] == 1 and second.evidence["in_process"]["round"] == 2


@pytest.mark.django_db
def test_the_lost_steps_are_those_trained_before_the_death_not_those_of_the_new_round(cast, job, hooks, clock):
    """The ``resumed`` event is no urgent event: the reporter sends it with the next round's first
    steps in the same batch; those steps, past the last one before the death, were not lost."""
    train(hooks, job, clock, 1, 12)
    clock.shift(0.05)
    rank_gone(job, cast.node1, timezone.now())
    clock.shift(0.5)
    event = resumed(job, 10, 1, failed_at=timezone.now())
    hooks(reports=trained(job, clock, 11, 16), events=[event])  # steps 11 and 12 redone, 13-16 new
    assert Job.objects.get(pk=job.pk).last_step == 16
    assert Incident.objects.get(job=job).lost_steps == 12 - 10


# --- what is no in-process restart ---------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize("told", [
    pytest.param({"in_process": False}, id="an ordinary resume"),
    pytest.param({"rank": 1}, id="another rank's word"),
])
def test_only_rank_0s_word_of_an_in_process_round_makes_an_incident(cast, job, hooks, clock, told):
    train(hooks, job, clock, 1, 12)
    rank_gone(job, cast.node1, timezone.now())
    clock.shift(1.0)
    hooks(events=[resumed(job, 10, 1, failed_at=timezone.now(), **told)])
    stored = TrainingEvent.objects.get(job=job, kind="resumed")  # on the timeline
    assert not Incident.objects.filter(job=job).exists()
    assert not audit(job, EventKind.INCIDENT_OPEN)
    if told.get("in_process") is False:  # nor does the recording itself take it for one
        assert inprocess.record_restart(stored.pk) is None and not Incident.objects.filter(job=job).exists()


def move_on(job):
    """The job restarts meanwhile: generation 2."""
    for new_state in (JobState.QUIESCING, JobState.RECOVERING):
        state.transition(job, new_state, actor="test")
    state.transition(job, JobState.INITIALIZING, actor="test", restart=True)


def pause(job):
    state.transition(job, JobState.PAUSED, actor="test")


@pytest.mark.django_db
@pytest.mark.parametrize("meanwhile", [move_on, pause], ids=["moved on to generation 2", "paused"])
def test_a_restart_of_a_generation_no_longer_running_is_not_recorded(cast, job, hooks, clock, meanwhile):
    """The batch was stored while generation 1 ran; by the time its on-commit work runs, the job
    left it. The generation's processes are gone or going: nothing to record."""
    train(hooks, job, clock, 1, 12)
    rank_gone(job, cast.node1, timezone.now())
    clock.shift(1.0)
    hooks(events=[resumed(job, 10, 1, failed_at=timezone.now())], execute=False)
    assert hooks.callbacks  # the incident is recorded after commit...
    meanwhile(job)
    for callback in hooks.callbacks:  # ...which comes now
        callback()
    assert not Incident.objects.filter(job=job).exists()


# --- goodput -------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_goodput_counts_the_restarts_downtime_and_lost_steps(cast, job, hooks, clock):
    """Timeline (s after T0): steps every 0.1 s from 0.1 to 1.2; the rank dies at 1.25; the
    survivors see it at 1.27; round 1 resumes from step 10 at 2.25 and redoes steps 11-12 before
    training on to step 20 at 3.25."""
    train(hooks, job, clock, 1, 12)
    crash_and_resume(hooks, job, cast, clock, restored=10, round_number=1, seen_after=0.02, down=1.0)
    train(hooks, job, clock, 11, 20)
    assert timezone.now() == T0 + timedelta(seconds=3.25)

    figures = goodput_of(Job.objects.get(pk=job.pk))
    badput = figures.badput_s
    assert figures.wall_s == pytest.approx(3.25)
    assert badput["startup"] == pytest.approx(0.1)  # until the first step
    assert badput["detection"] == pytest.approx(0.02)  # death → the survivors saw it
    assert badput["restart"] == pytest.approx(0.98)  # → round 1's resume
    assert badput["lost_work"] == pytest.approx(2 * 0.1)  # steps 11 and 12, at the median 0.1 s
    assert figures.productive_s == pytest.approx(3.25 - 0.1 - 1.0 - 0.2)
    assert figures.ettr == pytest.approx(1.95 / 3.25)


# --- the policy: the spec API and the launch -----------------------------------------------------

def launch_spec(api, cast, recovery_policy):
    return api(cast.tokens["ci"]).post("/api/v1/jobs", {"name": "tiny", "entrypoint": "examples/train.py",
                                                        "recovery_policy": recovery_policy}, format="json")


@pytest.mark.django_db
@pytest.mark.parametrize("value", [0, 1, 100])
def test_the_spec_api_takes_a_budget_from_0_to_100_and_stores_it(cast, api, value):
    response = launch_spec(api, cast, {"inprocess_restarts": value})
    assert response.status_code == 201, response.content
    assert response.json()["recovery_policy"]["inprocess_restarts"] == value
    stored = Job.objects.get(pk=response.json()["id"])
    assert stored.recovery_policy["inprocess_restarts"] == value
    assert RecoveryPolicy.of(stored).inprocess_restarts == value


@pytest.mark.django_db
def test_the_budget_is_off_unless_asked_for(cast, api):
    response = launch_spec(api, cast, {"max_restarts": 2})
    assert response.status_code == 201, response.content
    assert response.json()["recovery_policy"]["inprocess_restarts"] == 0
    assert RecoveryPolicy.of(Job.objects.get(pk=response.json()["id"])).inprocess_restarts == 0


@pytest.mark.django_db
@pytest.mark.parametrize(("value", "reason"), [
    (101, "Ensure this value is less than or equal to 100."),
    (-1, "Ensure this value is greater than or equal to 0."),
    ("twice", "A valid integer is required."),
])
def test_the_spec_api_refuses_a_budget_out_of_range_with_the_field_named(cast, api, value, reason):
    before = Job.objects.count()
    response = launch_spec(api, cast, {"inprocess_restarts": value})
    assert response.status_code == 400, response.content
    assert response["Content-Type"] == "application/problem+json"
    problem = response.json()
    assert problem["status"] == 400 and problem["title"] == "Invalid request"
    assert {"field": "recovery_policy.inprocess_restarts", "reason": reason} in problem["errors"], problem
    assert Job.objects.count() == before


def start(**recovery_policy):
    job = Job.objects.create(name="gpt", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             accelerator="cpu", created_by="test", recovery_policy=recovery_policy)
    services.start_job(job, actor="test")
    command = NodeCommand.objects.get(job=job, kind="launch")
    return command.payload, parse_command_payload(Command(id="c", kind="launch", idempotency_key="k", job="j",
                                                          generation=command.generation, payload=command.payload))


@pytest.mark.django_db
def test_the_launch_carries_the_budget_when_the_policy_turns_it_on(cast):
    stored, parsed = start(inprocess_restarts=2)
    assert stored["inprocess_restarts"] == 2 and parsed.inprocess_restarts == 2


@pytest.mark.django_db
@pytest.mark.parametrize("policy", [{}, {"inprocess_restarts": 0}], ids=["absent", "zero"])
def test_without_a_budget_the_launch_has_no_such_key_so_older_agents_take_it(cast, policy):
    stored, parsed = start(**policy)
    assert "inprocess_restarts" not in stored and parsed.inprocess_restarts is None
