"""jobs.ingest: a run of loss spikes is judged from the count the hooks send with each ``spike``
event (``detail.consecutive``, one rank's run), once, by the policy's limit."""

from __future__ import annotations

import time

import pytest

from agents.protocol import hooks as hooks_protocol
from jobs import ingest, policy
from jobs.choices import IncidentKind, JobState
from jobs.models import Incident


def batch(job, steps, *, spiking=(), counts=None, rank=0):
    """Rank ``rank``'s reports of ``steps``; a ``spike`` event for each step of ``spiking``, carrying
    the run the hooks counted (``counts[step]``; no count sent when ``counts`` is None)."""
    reports = [hooks_protocol.StepReport(job=str(job.pk), generation=1, rank=rank, step=s, loss=9.0 if s in spiking
                                         else 2.0, grad_norm=1.0, world_size=2, data_cursor=8 * s, samples=4,
                                         phases={"compute": 0.1}, spike=s in spiking, time=time.time())
               for s in steps]
    events = [hooks_protocol.Event(job=str(job.pk), generation=1, rank=rank, step=s, kind="spike",
                                   key=f"0:{rank}:{s}:spike:0", message=f"loss spike at step {s}",
                                   detail={} if counts is None else {"consecutive": counts[s]}, time=time.time())
              for s in spiking]
    return hooks_protocol.ReportBatch(job=str(job.pk), generation=1, reports=reports, events=events)


def record(job, b, capture):
    job.refresh_from_db()
    with capture(execute=True):
        ingest.record_reports(job, b, actor="test")
    job.refresh_from_db()


@pytest.mark.django_db
def test_the_hooks_count_reaching_the_limit_pauses_the_job(running, eager_celery,
                                                            django_capture_on_commit_callbacks):
    record(running, batch(running, [1, 2]), django_capture_on_commit_callbacks)
    # The hooks counted a run of three on rank 1 (its earlier spikes came in an earlier batch, or
    # their reports were dropped under backpressure: the count still says three).
    record(running, batch(running, [3], spiking={3}, counts={3: 3}, rank=1), django_capture_on_commit_callbacks)
    incident = Incident.objects.get(job=running)
    assert incident.kind == IncidentKind.NUMERICAL and incident.evidence["consecutive_spikes"] == 3
    assert running.state == JobState.PAUSED  # no generation row here: nothing to wait for
    assert "3 consecutive loss spikes (limit 3)" in incident.classification


@pytest.mark.django_db
def test_a_run_below_the_limit_or_across_ranks_is_not_acted_on(running, eager_celery,
                                                              django_capture_on_commit_callbacks):
    # Each of three steps spiked, but on a different rank each time: no rank's run is longer than one.
    for step, rank in ((1, 0), (2, 1), (3, 0)):
        record(running, batch(running, [step], spiking={step}, counts={step: 1}, rank=rank),
               django_capture_on_commit_callbacks)
    # Hooks that send no count: each spike event is a run of one.
    record(running, batch(running, [4, 5, 6], spiking={4, 5, 6}), django_capture_on_commit_callbacks)
    record(running, batch(running, [7, 8], spiking={7, 8}, counts={7: 1, 8: 2}), django_capture_on_commit_callbacks)
    assert not Incident.objects.filter(job=running).exists()
    assert running.state == JobState.RUNNING


def test_the_limit_is_judged_in_one_place():
    assert not policy.spike_run_pauses(2, 3)
    assert policy.spike_run_pauses(3, 3)
    assert policy.decide(policy.Evidence(policy.SPIKE, consecutive_spikes=3, spike_limit=3)).action == "pause"
