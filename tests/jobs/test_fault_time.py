"""Issue 24, item 8: an incident's fault time comes from the earliest evidence, not the detection;
a node whose agent comes back quickly and confirms nothing runs had a crash, not a partition."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from jobs import orchestrator, services
from jobs.choices import JobState
from jobs.models import Generation, Incident, Job, StepMetric
from nodes.choices import Health
from nodes.models import Node


@pytest.fixture
def job(cast):
    job = Job.objects.create(name="gpt", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             accelerator="cpu", created_by="test",
                             recovery_policy={"max_restarts": 3, "backoff_seconds": 0})
    services.start_job(job, actor="test")
    Generation.objects.filter(job=job).update(started_at=timezone.now() - timedelta(hours=2))
    job.refresh_from_db()
    return job


def lose(job, hostname="gpu-01", *, heartbeat_age_s=3.0):
    """The heartbeat sweep's verdict: the node is unreachable, its last heartbeat that long ago."""
    Node.objects.filter(hostname=hostname).update(health=Health.UNREACHABLE,
                                                  last_heartbeat_at=timezone.now() - timedelta(seconds=heartbeat_age_s))
    orchestrator.handle_node_health(hostname, Health.UNREACHABLE, ["no heartbeat"])


@pytest.mark.django_db
@pytest.mark.parametrize("stamps", [
    pytest.param({"ended_at": 0.0, "exited_at": 2.0}, id="torchrun-closing-the-group"),
    # Issue 20: torchrun's own log time of the failure and the agent's sighting of the dead rank
    # come before torchrun closing the group (ended_at).
    pytest.param({"torchrun_failed_at": 0.0, "rank_exited_at": 0.2, "ended_at": 0.3, "exited_at": 2.0},
                 id="the-rank-seen-dying"),
])
def test_an_exit_dates_from_its_earliest_evidence_not_from_detection(cast, job, stamps):
    """Seconds after the failure each stamp of the exit report says; the earliest is the fault."""
    failed = timezone.now() - timedelta(seconds=5.5)
    orchestrator.handle_exit(job.pk, 1, "gpu-01", {"exit_code": 1, "signature": "signal", **{
        name: (failed + timedelta(seconds=after)).timestamp() for name, after in stamps.items()}})
    incident = Incident.objects.get(job=job)
    assert abs((incident.fault_at - failed).total_seconds()) < 0.01
    assert (incident.detected_at - incident.fault_at).total_seconds() >= 5.5


@pytest.mark.django_db
def test_the_fault_is_never_dated_before_the_ranks_last_sign_of_life_or_after_now(cast, job):
    alive = timezone.now() - timedelta(seconds=2)
    StepMetric.objects.create(job=job, generation=1, rank=0, step=7, loss=1.0, world_size=2, data_cursor=56,
                              samples=4, reported_at=alive, received_at=alive)
    long_ago = (timezone.now() - timedelta(hours=1)).timestamp()  # a log last written long before the end
    assert orchestrator.exit_fault_time(job, 1, {"ended_at": long_ago}) == alive
    future = (timezone.now() + timedelta(hours=1)).timestamp()  # a node clock running ahead
    assert orchestrator.exit_fault_time(job, 1, {"ended_at": future}) <= timezone.now()
    assert orchestrator.exit_fault_time(job, 1, {}) is None
    started = Generation.objects.get(job=job, number=1).started_at
    assert orchestrator.exit_fault_time(job, 1, {"ended_at": (started - timedelta(days=1)).timestamp()}) == alive


@pytest.mark.django_db
def test_an_unreachable_node_dates_from_its_last_heartbeat(cast, job):
    lose(job, heartbeat_age_s=3.0)
    incident = Incident.objects.get(job=job)
    assert incident.kind == "partition"
    assert (incident.detected_at - incident.fault_at).total_seconds() >= 3.0


@pytest.mark.django_db
def test_an_agent_back_within_the_window_confirming_nothing_runs_is_a_crash_restarted(cast, job):
    lose(job)
    job.refresh_from_db()
    assert job.state == JobState.QUIESCING
    # The restarted agent found the generation's torchrun gone and reports it ended.
    orchestrator.handle_exit(job.pk, 1, "gpu-01", {"exit_code": None, "signature": "unknown", "ranks": []})
    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision) == ("crash", "restart")
    assert incident.evidence["reclassified_from"] == "partition"
    assert "came back and confirmed nothing runs" in incident.classification
    while orchestrator.advance_recovery(job.pk):
        pass
    job.refresh_from_db()
    assert (job.state, job.generation) == (JobState.INITIALIZING, 2)  # relaunched, nobody approved


@pytest.mark.django_db
def test_a_job_already_paused_for_the_partition_resumes_when_the_agent_returns(cast, job):
    lose(job)
    Job.objects.filter(pk=job.pk).update(quiesce_deadline=timezone.now() - timedelta(seconds=1))
    assert orchestrator.advance_recovery(job.pk)  # the quiesce deadline passed: paused, escalated
    assert Job.objects.get(pk=job.pk).state == JobState.PAUSED
    # The agent, back, reports that the generation had ended while it was away.
    orchestrator.handle_exit(job.pk, 1, "gpu-01", {"exit_code": None, "signature": "unknown", "ranks": []})
    while orchestrator.advance_recovery(job.pk):
        pass
    job.refresh_from_db()
    assert (job.state, job.generation) == (JobState.INITIALIZING, 2)
    assert Incident.objects.get(job=job).kind == "crash"


@pytest.mark.django_db
def test_a_late_return_stays_a_partition_for_a_human(cast, job):
    lose(job)
    with time_machine.travel(timezone.now() + orchestrator.agent_return_window() + timedelta(seconds=5)):
        orchestrator.handle_exit(job.pk, 1, "gpu-01", {"exit_code": None, "signature": "unknown", "ranks": []})
        while orchestrator.advance_recovery(job.pk):
            pass
    job.refresh_from_db()
    incident = Incident.objects.get(job=job)
    assert (incident.kind, job.state) == ("partition", JobState.PAUSED)


@pytest.mark.django_db
def test_not_when_another_node_is_still_lost_or_the_ranks_ran_on_until_stopped(cast, job):
    Generation.objects.get(job=job, number=1).nodes.add(cast.node2)
    lose(job)
    Node.objects.filter(hostname=cast.node2.hostname).update(health=Health.UNREACHABLE)
    orchestrator.handle_exit(job.pk, 1, "gpu-01", {"exit_code": None, "signature": "unknown", "ranks": []})
    assert Incident.objects.get(job=job).kind == "partition"


@pytest.mark.django_db
def test_a_stop_acknowledged_by_a_returning_node_stays_a_partition(cast, job):
    """Its ranks ran on through the silence until our stop reached them: a human decides."""
    lose(job)
    orchestrator.handle_exit(job.pk, 1, "gpu-01", {"exit_code": -15, "requested_stop": True, "ranks": []})
    orchestrator.confirm_stopped(job.pk, 1, "gpu-01")
    while orchestrator.advance_recovery(job.pk):
        pass
    assert (Incident.objects.get(job=job).kind, Job.objects.get(pk=job.pk).state) == ("partition", JobState.PAUSED)


@pytest.mark.django_db
def test_a_nan_dates_from_the_step_that_went_nan(cast, job, eager_celery):
    from jobs.models import TrainingEvent

    went_nan = timezone.now() - timedelta(seconds=4)
    for step, nan in ((5, False), (6, True), (7, True)):
        at = went_nan + timedelta(seconds=step - 6)
        StepMetric.objects.create(job=job, generation=1, rank=0, step=step, loss=None if nan else 1.0, nan=nan,
                                  world_size=2, data_cursor=8 * step, samples=4, reported_at=at, received_at=at)
    Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING)
    job.refresh_from_db()
    orchestrator.handle_hook_flags(job, 1, nan=True, spikes=0, inconsistent=None)
    incident = Incident.objects.get(job=job)
    assert incident.kind == "numerical" and incident.fault_at == went_nan
    disagreed = timezone.now() - timedelta(seconds=2)
    TrainingEvent.objects.create(job=job, generation=1, rank=0, step=9, kind="inconsistency", key="k",
                                 message="ranks disagree", detail={}, reported_at=disagreed, received_at=disagreed)
    assert orchestrator.flagged_fault_time(job, "inconsistency", 1, timezone.now()) == disagreed


@pytest.mark.django_db
def test_a_stamp_that_is_not_a_time_is_ignored(cast, job):
    seen = timezone.now() - timedelta(seconds=1)
    assert orchestrator.exit_fault_time(job, 1, {"rank_exited_at": True, "torchrun_failed_at": "yesterday",
                                                 "ended_at": seen.timestamp()}) == seen


@pytest.mark.django_db
def test_a_critical_xid_dates_the_hardware_incident_from_the_xid_not_from_its_receipt(
        cast, job, eager_celery, django_capture_on_commit_callbacks):
    """Issue 20's honest fault times: the agent's Xid event carries when the GPU failed (its clock);
    the incident that moves the job to a spare dates from then. Clamped to the generation's start
    (a node clock behind ours), but not to the ranks' last step (steps in flight still report)."""
    from agents.protocol import agent as wire
    from agents.protocol import parse
    from nodes.services import ingest as node_ingest

    StepMetric.objects.create(job=job, generation=1, rank=0, step=5, loss=1.0, world_size=2, data_cursor=40,
                              reported_at=timezone.now())

    def xid(key, at):
        batch = parse(wire.EventBatch, {"events": [{"key": key, "kind": "xid", "time": at.timestamp(),
                                                    "detail": {"gpu": 0, "code": 79}}]})
        with django_capture_on_commit_callbacks(execute=True):
            node_ingest.record_agent_events(cast.node1, wire.parse_event_details(batch))

    failed = timezone.now() - timedelta(seconds=0.8)
    xid("x1", failed)
    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision) == ("hardware", "restart_on_spare")
    assert incident.fault_at == failed and incident.detected_at > failed


@pytest.mark.django_db
def test_an_xid_dated_before_the_generation_started_dates_from_its_start(cast, job, eager_celery,
                                                                        django_capture_on_commit_callbacks):
    from nodes.services import set_health

    started = Generation.objects.get(job=job, number=1).started_at
    with django_capture_on_commit_callbacks(execute=True):
        set_health(cast.node1, Health.UNHEALTHY, reason="GPU 0: critical Xid 79",
                   evidence={"reasons": ["GPU 0: critical Xid 79"],
                             "fault_at": (started - timedelta(minutes=5)).timestamp()})
    assert Incident.objects.get(job=job).fault_at == started
