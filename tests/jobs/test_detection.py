"""The control plane acting on the hooks' per-step verdicts (jobs.detection through jobs.ingest) and
judging stragglers over the node windows it stores (jobs.stragglers): real database, Celery eager."""

from __future__ import annotations

import time

import pytest

from agents.protocol import hooks as wire
from core.models import Event
from jobs import ingest
from jobs.choices import IncidentKind, JobState
from jobs.models import Incident

pytestmark = pytest.mark.django_db


def event(job, step, kind, rank=0, **detail):
    return wire.Event(job=str(job.pk), generation=1, rank=rank, step=step, kind=kind, key=f"0:{rank}:{step}:{kind}:0",
                      message=kind, detail=detail, time=time.time())


def report(job, step, rank=0, **flags):
    return wire.StepReport(job=str(job.pk), generation=1, rank=rank, step=step, loss=2.0, grad_norm=1.0,
                           world_size=4, data_cursor=8 * step, samples=4, phases={"compute": 0.1}, time=time.time(),
                           **flags)


def send(job, capture, reports=(), events=(), windows=()):
    job.refresh_from_db()
    with capture(execute=True):
        ingest.record_reports(job, wire.ReportBatch(job=str(job.pk), generation=1, reports=list(reports),
                                                    events=list(events), windows=list(windows)), actor="test")
    job.refresh_from_db()


def test_a_spike_the_hooks_said_pauses_pauses_at_once_and_a_marker_does_not(
        running, eager_celery, django_capture_on_commit_callbacks):
    send(running, django_capture_on_commit_callbacks, [report(running, 40, spike=True, skipped=True)],
         [event(running, 40, "spike", action="marker", consecutive=1, score=30.0, baseline=2.0, threshold=2.2)])
    assert not Incident.objects.filter(job=running).exists()
    send(running, django_capture_on_commit_callbacks, [report(running, 41, spike=True)],
         [event(running, 41, "spike", action="pause", consecutive=1, score=9.0, baseline=2.0, threshold=2.2)])
    incident = Incident.objects.get(job=running)
    assert incident.kind == IncidentKind.NUMERICAL and incident.evidence["propose_rollback"]
    assert incident.evidence["detail"]["score"] == 9.0 and running.state == JobState.PAUSED


def test_a_divergence_pauses_proposing_a_rollback_to_before_the_rise(
        running, eager_celery, django_capture_on_commit_callbacks):
    send(running, django_capture_on_commit_callbacks, [report(running, 900)],
         [event(running, 900, "divergence", action="pause", since_step=650, rise=0.07)])
    incident = Incident.objects.get(job=running)
    assert incident.evidence["since_step"] == 650 and incident.evidence["propose_rollback"]
    assert "since step 650" in incident.classification


def test_a_disagreeing_rank_takes_precedence_over_the_spike_it_caused(
        running, eager_celery, django_capture_on_commit_callbacks):
    send(running, django_capture_on_commit_callbacks, [report(running, 55, spike=True)],
         [event(running, 55, "spike", action="pause", consecutive=2)])
    send(running, django_capture_on_commit_callbacks, [report(running, 60, inconsistent=True)],
         [event(running, 60, "inconsistency", suspect_rank=3, suspect_node=1, drift=0.04,
                losses=[2.0, 2.0, 2.0, 2.1], grad_norms=[1.0] * 4, loss_spread=0.05, grad_norm_spread=0.0)])
    incident = Incident.objects.get(job=running)
    assert incident.kind == IncidentKind.CORRUPTION and incident.evidence["reclassified_from"] == "spike"
    assert "rank 3 (node 1)" in incident.classification and incident.evidence["detail"]["suspect_rank"] == 3


def node_window(job, node, last_step, *, slow_input=0.0, stall=False):
    phases = {"input": 0.01, "compute": 0.3, "optimizer": 0.05, "checkpoint": 4.0 if stall else 0.0}
    slowest = {**phases, "input": phases["input"] + slow_input}
    return wire.NodeWindow(job=str(job.pk), generation=1, node=node, first_step=last_step - 9, last_step=last_step,
                           ranks=1, step_median_s=sum(slowest.values()), step_max_s=sum(slowest.values()) + 0.1,
                           slowest_rank=node, slowest_s=sum(slowest.values()), slowest_phases=slowest,
                           phases=slowest, time=time.time())


def test_a_straggler_is_named_with_rank_host_and_cost_once_and_never_for_a_checkpoint(
        running, eager_celery, django_capture_on_commit_callbacks):
    Event.objects.create(kind="job.state", actor="test", job=running, generation=1, new_state=JobState.INITIALIZING,
                         evidence={"nodes": ["gpu-01", "gpu-02"]})
    # Every third window a checkpoint stalls the whole job: never a straggler.
    for i in range(1, 13):
        stall = i % 3 == 0
        send(running, django_capture_on_commit_callbacks, [report(running, 10 * i)],
             windows=[node_window(running, 0, 10 * i, stall=stall), node_window(running, 1, 10 * i, stall=stall)])
    assert not Incident.objects.filter(job=running).exists()
    # Rank 1 (node 1, gpu-02) waits for its data: +0.05 s a step, 14 % of the step, held.
    for i in range(13, 25):
        send(running, django_capture_on_commit_callbacks, [report(running, 10 * i)],
             windows=[node_window(running, 0, 10 * i), node_window(running, 1, 10 * i, slow_input=0.05)])
    incident = Incident.objects.get(job=running)
    detail = incident.evidence["detail"]
    assert incident.kind == IncidentKind.STRAGGLER and incident.decision == "alert"
    assert (detail["rank"], detail["node"], detail["hostname"], detail["phase"]) == (1, 1, "gpu-02", "input")
    assert detail["ratio"] == pytest.approx(1.14, abs=0.01)
    assert detail["lost_throughput"] == pytest.approx(0.12, abs=0.01)
    assert "gpu-02" in incident.classification and "alert only" in incident.classification
    assert detail["last_step"] <= 13 * 10 + 8 * 10  # within the 8 windows it takes to see 5
    assert running.state == JobState.RUNNING  # an alert, nothing to recover


def test_the_chart_explains_each_marker_with_what_the_detector_saw(
        running, eager_celery, django_capture_on_commit_callbacks):
    from dashboard.queries import chart

    send(running, django_capture_on_commit_callbacks, [report(running, 40, spike=True, skipped=True)],
         [event(running, 40, "spike", action="marker", consecutive=1, score=31.5, baseline=2.0, threshold=2.3,
                reason="loss spike; the guard skipped the update"),
          event(running, 41, "level_shift", action="marker", rise=0.04, reason="re-baselined")])
    assert chart(running)["detections"] == [
        {"step": 40, "rank": 0, "kind": "spike", "action": "marker", "score": 31.5, "baseline": 2.0,
         "threshold": 2.3, "rise": None, "since_step": None, "reason": "loss spike; the guard skipped the update"},
        {"step": 41, "rank": 0, "kind": "level_shift", "action": "marker", "score": None, "baseline": None,
         "threshold": None, "rise": 0.04, "since_step": None, "reason": "re-baselined"}]
