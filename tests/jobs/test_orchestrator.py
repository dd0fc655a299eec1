"""The orchestrator on a real database: faults, quiesce confirmation, relaunch, approvals.

Agents are not running here: the test plays their part by calling what their messages call
(``handle_exit``, stop acknowledgements), and reads the command queue they would pull.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import orchestrator, policy, services, tasks
from jobs.choices import IncidentState, JobState
from jobs.goodput import goodput_of
from jobs.models import Event, Generation, Incident, Job
from nodes.models import NodeCommand


@pytest.fixture
def job(cast):
    job = Job.objects.create(name="gpt", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             accelerator="cpu", created_by="test",
                             recovery_policy={"max_restarts": 2, "window_minutes": 60, "backoff_seconds": 0,
                                              "allow_shrink": False, "progress_timeout_s": None,
                                              "loss_spike_limit": 3})
    services.start_job(job, actor="test")
    job.refresh_from_db()
    return job


def commands(node, kind):
    return list(NodeCommand.objects.filter(node=node, kind=kind).order_by("pk"))


def crash(job, hostname="gpu-01", **detail):
    orchestrator.handle_exit(job.pk, job.generation, hostname,
                             {"exit_code": 1, "signature": "signal", "ranks": [{"rank": 1, "signal": 9}], **detail})


@pytest.mark.django_db
def test_first_launch_places_the_job_on_a_regular_node_and_queues_launch(cast, job):
    assert (job.state, job.generation) == (JobState.INITIALIZING, 1)
    generation = Generation.objects.get(job=job, number=1)
    assert list(generation.nodes.values_list("hostname", flat=True)) == ["gpu-01"]  # the spare is kept back
    [launch] = commands(cast.node1, "launch")
    assert launch.generation == 1
    assert launch.payload["rdzv_id"] == f"nw-{job.pk}-g1" and launch.payload["require_gpu"] is False
    assert launch.payload["hooks_url"] and launch.payload["ckpt_dir"].endswith(f"job-{job.pk}")


@pytest.mark.django_db
def test_a_crash_quiesces_then_relaunches_once_every_node_confirmed(cast, job):
    crash(job)
    job.refresh_from_db()
    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision, job.state) == ("crash", "restart", JobState.QUIESCING)
    # The crashed node's exit report is its confirmation: the recovery goes on by itself.
    assert orchestrator.advance_recovery(job.pk)  # quiescing -> recovering
    assert orchestrator.advance_recovery(job.pk)  # recovering -> initializing, generation 2
    job.refresh_from_db()
    assert (job.state, job.generation, job.restart_count) == (JobState.INITIALIZING, 2, 1)
    assert not orchestrator.advance_recovery(job.pk)  # nothing left to do: idempotent
    assert Generation.objects.filter(job=job).count() == 2
    incident.refresh_from_db()
    assert incident.quiesced_at and incident.relaunched_at and incident.state == IncidentState.OPEN


@pytest.mark.django_db
def test_an_exit_of_an_old_generation_is_fenced_off(cast, job):
    crash(job)
    orchestrator.advance_recovery(job.pk)
    orchestrator.advance_recovery(job.pk)
    orchestrator.handle_exit(job.pk, 1, "gpu-01", {"exit_code": 1, "signature": "signal"})
    assert Incident.objects.filter(job=job).count() == 1
    assert Job.objects.get(pk=job.pk).state == JobState.INITIALIZING


@pytest.mark.django_db
def test_relaunch_waits_for_a_node_that_has_not_confirmed(cast, job):
    """Two nodes; one crashes. No relaunch until the other acknowledges its stop."""
    Job.objects.filter(pk=job.pk).update(nnodes=2)
    generation = Generation.objects.get(job=job, number=1)
    generation.nodes.add(cast.node2)
    crash(job, "gpu-01")
    [stop] = commands(cast.node2, "stop")
    assert stop.generation == 1
    assert not orchestrator.advance_recovery(job.pk)
    assert Job.objects.get(pk=job.pk).state == JobState.QUIESCING
    orchestrator.confirm_stopped(job.pk, 1, "gpu-02")
    assert orchestrator.advance_recovery(job.pk)
    assert Job.objects.get(pk=job.pk).state == JobState.RECOVERING


@pytest.mark.django_db
def test_only_the_confirmation_that_completes_the_set_moves_the_recovery_on(
        cast, job, django_capture_on_commit_callbacks):
    """A quiescing job waits for every node: a confirmation before the last one queues no
    ``advance_job`` (a 512-node job's recovery queued over 500, each finding it still waiting)."""
    from nodes.models import Node

    third = Node.objects.create(hostname="gpu-03", address="10.0.0.3", health="healthy")
    Job.objects.filter(pk=job.pk).update(nnodes=3)
    Generation.objects.get(job=job, number=1).nodes.add(cast.node2, third)
    crash(job, "gpu-01")  # its exit report confirms gpu-01
    with django_capture_on_commit_callbacks() as callbacks:
        orchestrator.confirm_stopped(job.pk, 1, "gpu-02")
        orchestrator.confirm_stopped(job.pk, 1, "gpu-02")  # the ack after the exit report: known
    assert callbacks == []
    assert Generation.objects.get(job=job, number=1).ended_at is None
    with django_capture_on_commit_callbacks() as callbacks:
        orchestrator.confirm_stopped(job.pk, 1, "gpu-03")
    assert len(callbacks) == 1  # the advance: the recovery goes on
    assert Generation.objects.get(job=job, number=1).ended_at is not None
    assert orchestrator.advance_recovery(job.pk)
    assert Job.objects.get(pk=job.pk).state == JobState.RECOVERING


@pytest.mark.django_db
def test_an_unconfirmed_stop_past_the_deadline_pauses_and_escalates(cast, job):
    Generation.objects.get(job=job, number=1).nodes.add(cast.node2)
    crash(job, "gpu-01")
    Job.objects.filter(pk=job.pk).update(quiesce_deadline=timezone.now() - timezone.timedelta(seconds=1))
    assert orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.PAUSED and "gpu-02" in job.pause_reason
    assert Incident.objects.get(job=job).decision == "escalate"


@pytest.mark.django_db
def test_the_same_exception_twice_pauses_after_the_second(cast, job):
    failure = {"signature": "traceback", "error_line": "RuntimeError: bad batch 7"}
    Job.objects.filter(pk=job.pk).update(last_step=7)
    crash(job, **failure)
    orchestrator.advance_recovery(job.pk)
    orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()
    crash(job, **failure)
    orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.PAUSED
    assert Incident.objects.filter(job=job).order_by("-pk").first().kind == "deterministic"
    assert job.generation == 2  # not restarted again


@pytest.mark.django_db
def test_the_restart_budget_opens_the_breaker_and_oncall_approval_resumes(cast, job):
    for _ in range(2):  # max_restarts is 2
        crash(job)
        orchestrator.advance_recovery(job.pk)
        orchestrator.advance_recovery(job.pk)
        job.refresh_from_db()
    crash(job)
    orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.PAUSED and "circuit breaker" in job.pause_reason
    generation = services.approve_resume(job, actor="user:olga", reason="checked the node")
    job.refresh_from_db()
    assert (job.state, job.generation, generation.number) == (JobState.INITIALIZING, 4, 4)
    assert job.breaker_reset_at is not None
    assert job.events.filter(reason__startswith="resume approved", actor="user:olga").exists()


@pytest.mark.django_db
def test_approval_is_refused_while_a_node_has_not_confirmed_its_ranks_stopped(cast, job):
    from jobs import state

    Generation.objects.get(job=job, number=1).nodes.add(cast.node2)
    orchestrator.report_fault(job.pk, "node_unreachable", generation=1, nodes=("gpu-02",))
    Job.objects.filter(pk=job.pk).update(quiesce_deadline=timezone.now())
    orchestrator.confirm_stopped(job.pk, 1, "gpu-01")
    orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.PAUSED
    with pytest.raises(state.TransitionConflict, match="split brain"):
        services.approve_resume(job, actor="user:olga", reason="link is back")
    orchestrator.confirm_stopped(job.pk, 1, "gpu-02")
    services.approve_resume(job, actor="user:olga", reason="link is back")
    assert Job.objects.get(pk=job.pk).generation == 2


@pytest.mark.django_db
def test_an_unhealthy_node_is_drained_and_the_job_moves_to_the_spare(cast, job):
    from nodes.services import set_health

    set_health(cast.node1, "unhealthy", reason="Xid 79 on GPU 0")
    orchestrator.handle_node_health("gpu-01", "unhealthy", ["Xid 79 on GPU 0"])
    cast.node1.refresh_from_db()
    assert cast.node1.schedulability in ("draining", "drained")
    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision) == ("hardware", "restart_on_spare")
    orchestrator.confirm_stopped(job.pk, 1, "gpu-01")
    orchestrator.advance_recovery(job.pk)
    orchestrator.advance_recovery(job.pk)
    generation = Generation.objects.get(job=job, number=2)
    assert list(generation.nodes.values_list("hostname", flat=True)) == ["gpu-02"]
    assert commands(cast.node2, "launch")[0].generation == 2


@pytest.mark.django_db
def test_a_clean_exit_of_every_node_completes_the_job(cast, job):
    orchestrator.handle_exit(job.pk, 1, "gpu-01", {"exit_code": 0, "ranks": []})
    assert Job.objects.get(pk=job.pk).state == JobState.COMPLETED


@pytest.mark.django_db
def test_a_job_launched_before_any_node_is_healthy_waits_pending_and_starts_when_one_is(cast):
    from nodes.models import Node

    Node.objects.update(health="unknown")
    job = cast.job  # pending, never launched
    services.start_job(job, actor="test")
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    assert not orchestrator.start_one_pending()
    Node.objects.filter(hostname="gpu-01").update(health="healthy")
    assert orchestrator.start_one_pending()
    assert Job.objects.get(pk=job.pk).state == JobState.INITIALIZING


@pytest.mark.django_db
def test_cancelling_a_running_job_stops_its_generation(cast, job):
    services.cancel_job(job, actor="user:otto", reason="wrong data set")
    [stop] = commands(cast.node1, "stop")
    assert (stop.generation, stop.payload["reason"]) == (1, "cancelled: wrong data set")
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED


@pytest.mark.django_db
def test_each_node_of_a_multi_node_launch_probes_the_others_first(cast):
    from nodes.models import Node

    Node.objects.update(probe_port=29510, is_spare=False)
    job = Job.objects.create(name="wide", entrypoint="t.py", nnodes=2, accelerator="cpu", created_by="test")
    services.start_job(job, actor="test")
    launches = {c.node.hostname: c.payload for c in NodeCommand.objects.filter(kind="launch", job=job)}
    assert [p["address"] for p in launches["gpu-01"]["probe_peers"]] == ["10.0.0.2"]
    assert [p["address"] for p in launches["gpu-02"]["probe_peers"]] == ["10.0.0.1"]
    assert launches["gpu-01"]["rdzv_is_host"] and not launches["gpu-02"]["rdzv_is_host"]


@pytest.mark.django_db
def test_the_resumed_first_step_records_lost_work_and_goodput_adds_up(cast, job, api):
    from datetime import timedelta

    from jobs.models import StepMetric

    t0 = timezone.now()
    Generation.objects.filter(job=job, number=1).update(first_step=1, first_step_at=t0)
    StepMetric.objects.bulk_create([
        StepMetric(job=job, generation=1, rank=0, step=s, loss=1.0, world_size=2, data_cursor=8 * s,
                   phases={"compute": 0.08, "optimizer": 0.02}, reported_at=t0, received_at=t0)
        for s in range(1, 31)])
    crash(job)
    orchestrator.advance_recovery(job.pk)
    orchestrator.advance_recovery(job.pk)
    orchestrator.record_first_step(job, 2)  # resumed from scratch (no checkpoint): all 30 steps are redone
    incident = Incident.objects.get(job=job)
    assert (incident.state, incident.lost_steps) == (IncidentState.RESOLVED, 30)

    resolved = Event.objects.get(kind="incident.resolved")
    assert (resolved.job_id, resolved.generation, resolved.evidence) == (
        job.pk, 1, {"incident": incident.pk, "decision": incident.decision, "lost_steps": 30, "restored_step": 0})
    orchestrator.record_first_step(job, 2)  # a later batch of the same generation: resolved once, logged once
    assert Event.objects.filter(kind="incident.resolved").count() == 1

    g = goodput_of(Job.objects.get(pk=job.pk), now=timezone.now() + timedelta(seconds=60))
    assert g.badput_s["lost_work"] == pytest.approx(30 * 0.1)
    assert sum(g.badput_s.values()) + g.productive_s == pytest.approx(g.wall_s)
    assert 0 < g.ettr < 1
    body = api(cast.tokens["viewer"]).get(f"/api/v1/jobs/{job.pk}/goodput").json()
    assert set(body["badput_s"]) == {"startup", "detection", "restart", "paused", "lost_work", "checkpoint_stall"}


@pytest.mark.django_db
def test_an_alert_only_incident_is_resolved_at_once_and_logged(cast, job):
    from jobs import policy

    incident = orchestrator.report_fault(job.pk, policy.SPIKE, generation=job.generation, consecutive_spikes=2,
                                         actor="node:gpu-01")
    assert (incident.decision, incident.state) == ("alert", IncidentState.RESOLVED)
    resolved = Event.objects.get(kind="incident.resolved")
    assert (resolved.actor, resolved.evidence["incident"]) == ("node:gpu-01", incident.pk)


@pytest.mark.django_db
def test_lost_work_counts_from_the_snapshot_the_hooks_restored_not_the_checkpoint_named(cast, job):
    """Issue 20's snapshots: the relaunch names the newest verified disk checkpoint (step 20), the
    hooks restore a newer in-memory snapshot (step 28) and say so in their ``resumed`` event."""
    from checkpoints.models import Checkpoint
    from jobs.models import StepMetric, TrainingEvent

    t0 = timezone.now()
    StepMetric.objects.bulk_create([
        StepMetric(job=job, generation=1, rank=0, step=s, loss=1.0, world_size=2, data_cursor=8 * s,
                   phases={"compute": 0.1}, reported_at=t0, received_at=t0) for s in range(1, 31)])
    crash(job)
    orchestrator.advance_recovery(job.pk)
    orchestrator.advance_recovery(job.pk)
    disk = Checkpoint.objects.create(job=job, step=20, location=f"/ckpt/{job.pk}/20")
    Generation.objects.filter(job=job, number=2).update(resumed_from=disk)
    assert orchestrator.restored_step_of(job, 2) == 20  # before the hooks have said anything
    TrainingEvent.objects.create(job=job, generation=2, rank=0, step=28, kind="resumed", key="resumed-28",
                                 detail={"step": 28, "checkpoint": disk.location, "snapshot": "step-28"},
                                 reported_at=t0)
    orchestrator.record_first_step(job, 2)
    incident = Incident.objects.get(job=job)
    assert incident.lost_steps == 30 - 28
    assert Event.objects.get(kind="incident.resolved").evidence["restored_step"] == 28


def hang(job):
    from jobs import policy

    Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING, last_step=16)
    return orchestrator.report_fault(job.pk, policy.HANG, generation=job.generation, step=16,
                                     detail={"last_step": 16})


@pytest.mark.django_db
def test_a_hang_whose_node_then_turns_unreachable_is_a_partition_that_pauses_for_a_human(cast, job):
    """A cut-off node stalls the collectives, so the hang sweep speaks first; once the heartbeat sweep
    finds the node lost before it confirmed its stop, the same incident is the partition (no restart
    beside a rank that may still run), and the job pauses at the quiesce deadline."""
    Generation.objects.get(job=job, number=1).nodes.add(cast.node2)
    first = hang(job)
    assert (first.kind, first.decision) == ("hang", "restart")
    orchestrator.confirm_stopped(job.pk, 1, "gpu-01")
    tasks.handle_nodes_health("unreachable", {"gpu-02": ["no heartbeat"]})  # the heartbeat sweeper's batch
    incident = Incident.objects.get(job=job)
    assert incident.pk == first.pk
    assert (incident.kind, incident.decision) == ("partition", "escalate")
    assert incident.evidence["signal"] == "node_unreachable" and incident.evidence["nodes"] == ["gpu-02"]
    assert incident.evidence["reclassified_from"] == "hang" and incident.evidence["hang"]["detail"]["last_step"] == 16
    assert incident.evidence["page"] and "first taken for a hang" in incident.classification
    assert not orchestrator.advance_recovery(job.pk)  # gpu-02 has not confirmed: no restart
    Job.objects.filter(pk=job.pk).update(quiesce_deadline=timezone.now() - timezone.timedelta(seconds=1))
    assert orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.PAUSED and "gpu-02" in job.pause_reason and "escalating" in job.pause_reason
    assert Event.objects.filter(job=job, kind="incident.open", reason__startswith="re-classified").count() == 1


@pytest.mark.django_db
def test_a_hang_whose_exit_report_then_shows_a_rank_died_first_is_that_crash(cast, job):
    """A dead rank stalls the others, and the hang sweep may speak before the exit report arrives
    (a Slurm job's end is read at the controller's next poll). The exit, dated before the verdict,
    is the cause: the same incident becomes the crash, decided as though it had come first (the
    hang is not a second restart of the budget: one restart allowed, and it restarts)."""
    import time

    Job.objects.filter(pk=job.pk).update(recovery_policy={**job.recovery_policy, "max_restarts": 1})
    first = hang(job)
    assert (first.kind, first.decision) == ("hang", "restart")
    crash(job, rank_exited_at=time.time() - 0.5, error_line="killed")
    incident = Incident.objects.get(job=job)
    assert incident.pk == first.pk
    assert (incident.kind, incident.decision) == ("crash", "restart"), incident.classification
    assert incident.evidence["signal"] == "exit" and incident.evidence["signature"] == "signal"
    assert incident.evidence["reclassified_from"] == "hang" and incident.evidence["hang"]["detail"]["last_step"] == 16
    assert incident.fault_at <= first.fault_at and "first taken for a hang" in incident.classification
    assert Event.objects.filter(job=job, kind="incident.open", reason__startswith="re-classified").count() == 1
    assert orchestrator.advance_recovery(job.pk)  # every node confirmed (the exit): recovering
    assert orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()
    assert (job.state, job.generation) == (JobState.INITIALIZING, 2)


@pytest.mark.django_db
def test_a_rank_that_exits_after_the_hang_was_declared_leaves_the_hang_a_hang(cast, job):
    """A rank ended after the verdict (by our stop, or by the stall's own timeout) is the hang's
    consequence: further evidence, not a new cause."""
    import time

    hang(job)
    crash(job, rank_exited_at=time.time() + 0.5)
    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision) == ("hang", "restart")
    assert incident.evidence["further"][0]["signal"] == "exit"


@pytest.mark.django_db
def test_a_node_lost_after_it_confirmed_its_stop_leaves_the_hang_a_hang(cast, job):
    """Nothing of the generation runs on a node that confirmed: its loss cannot make a split brain,
    and the restart goes on (the loss is further evidence on the incident)."""
    Generation.objects.get(job=job, number=1).nodes.add(cast.node2)
    hang(job)
    orchestrator.confirm_stopped(job.pk, 1, "gpu-02")
    orchestrator.handle_node_health("gpu-02", "unreachable", ["no heartbeat"])
    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision) == ("hang", "restart")
    assert incident.evidence["further"][0]["signal"] == "node_unreachable"


@pytest.mark.django_db
def test_unhealthy_nodes_going_silent_are_no_partition_for_the_next_node_lost(cast, job):
    """Two nodes already drained for an Xid whose agents then stop (taken away for repair) do not
    make the next unhealthy node a partition that pauses its job: it still moves to the spare. Two
    healthy nodes lost in the window do."""
    from nodes.models import Node
    from nodes.services import set_health

    def lose(hostname, before):
        node = Node.objects.create(hostname=hostname, address="10.0.1.1", health=before)
        Event.objects.create(kind="node.health", node=node, old_state=before, new_state="unreachable",
                             reason="no heartbeat", created_at=timezone.now())

    lose("repaired-1", "unhealthy")
    lose("repaired-2", "unhealthy")
    set_health(cast.node1, "unhealthy", reason="Xid 79 on GPU 0")
    orchestrator.handle_node_health("gpu-01", "unhealthy", ["Xid 79 on GPU 0"])
    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision) == ("hardware", "restart_on_spare")

    lose("cut-1", "healthy")
    lose("cut-2", "healthy")
    assert orchestrator._evidence(job, "node_unhealthy", nodes=("gpu-01",)).nodes_lost_in_window == 2


@pytest.mark.django_db
def test_the_partition_threshold_grows_with_the_fleet(cast, job, settings):
    """Two nodes lost in the window are a partition on a small cluster; on a fleet of 400 that
    heartbeat they are two ordinary deaths (PARTITION_FRACTION 1 %: 4 needed), so an Xid'd node's
    job still moves to the spare; four lost are a partition there too."""
    from nodes.models import Node
    from nodes.services import set_health

    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "PARTITION_NODES": 2, "PARTITION_FRACTION": 0.01}
    assert orchestrator.partition_threshold() == 2
    deadline = timezone.now() + timedelta(seconds=30)
    Node.objects.bulk_create([Node(hostname=f"fleet-{i:03d}", address="10.0.2.1", health="healthy",
                                   heartbeat_deadline=deadline) for i in range(400)])
    assert orchestrator.partition_threshold() == 4

    def lose(hostname):
        node = Node.objects.get(hostname=hostname)
        Event.objects.create(kind="node.health", node=node, old_state="healthy", new_state="unreachable",
                             reason="no heartbeat", created_at=timezone.now())

    lose("fleet-000")
    lose("fleet-001")
    set_health(cast.node1, "unhealthy", reason="Xid 79 on GPU 0")
    orchestrator.handle_node_health("gpu-01", "unhealthy", ["Xid 79 on GPU 0"])
    assert Incident.objects.get(job=job).decision == "restart_on_spare"

    lose("fleet-002")
    lose("fleet-003")
    assert policy.decide(orchestrator._evidence(job, "node_unhealthy", nodes=("gpu-01",))).classification == \
        "partition"
