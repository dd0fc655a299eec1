"""The control plane's straggler check over stored node windows: the incident, and the job's remaining
time that lets the policy choose between an alert and a restart on a spare (issue 23)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import stragglers
from jobs.choices import IncidentKind
from jobs.models import Generation, Incident, Job, NodeWindow

STEP_S = 1.0


def store_windows(job, *, count=10, slow_rank=1, slow_by=0.5, every=10):
    """``count`` exchange windows of one node with two ranks; ``slow_rank`` computes ``slow_by`` longer."""
    now = timezone.now()
    for i in range(count):
        last = (i + 1) * every
        fast = {"input": 0.01, "compute": 0.7, "optimizer": 0.29, "checkpoint": 0.0}
        slow = {**fast, "compute": 0.7 + slow_by}
        # The fast rank waits for the slow one in the all-reduce (its communication).
        waiting = {**fast, "optimizer": 0.29 + slow_by}
        NodeWindow.objects.create(
            job=job, generation=1, node=0, first_step=last - every + 1, last_step=last, ranks=2,
            step_median_s=STEP_S + slow_by, step_max_s=STEP_S + slow_by, slowest_rank=slow_rank,
            slowest_s=STEP_S + slow_by, slowest_phases=slow,
            phases={k: (slow[k] + waiting[k]) / 2 for k in slow}, reported_at=now + timedelta(seconds=last))


@pytest.fixture
def straggling(running, cast):
    generation = Generation.objects.create(job=running, number=1, world_size=2)
    generation.nodes.set([cast.node1])
    store_windows(running)
    return running


def set_policy(job, **fields):
    Job.objects.filter(pk=job.pk).update(recovery_policy={**job.recovery_policy, **fields}, last_step=100)
    job.refresh_from_db()


def test_a_job_without_an_end_alerts_and_says_why(straggling):
    set_policy(straggling)
    incident = stragglers.check_stragglers(straggling, 1)
    assert incident is not None and incident.kind == IncidentKind.STRAGGLER
    assert incident.decision == "alert"
    remaining = incident.evidence["detail"]["remaining"]
    assert remaining["remaining_s"] is None and "no max_steps" in remaining["basis"]
    assert "remaining time is unknown" in incident.evidence["reason"]
    assert incident.evidence["detail"]["rank"] == 1 and incident.evidence["detail"]["hostname"] == "gpu-01"
    assert stragglers.check_stragglers(straggling, 1) is None  # once per rank and generation


def test_a_long_way_to_go_replaces_the_node_on_a_spare(straggling, cast):
    # 100,000 steps left at 1.5 s: a third of that time lost to the straggler, far more than a restart.
    set_policy(straggling, max_steps=100_100)
    incident = stragglers.check_stragglers(straggling, 1)
    assert incident.decision == "restart_on_spare", incident.evidence["reason"]
    assert incident.evidence["remaining_s"] == pytest.approx(100_000 * (STEP_S + 0.5))
    assert "100000 steps left" in incident.evidence["detail"]["remaining"]["basis"]
    assert list(incident.nodes.values_list("hostname", flat=True)) == ["gpu-01"]


def test_near_the_end_a_restart_does_not_pay(straggling):
    # 200 steps left at 1.5 s: a third of 300 s saved is less than the 300 s a restart costs.
    set_policy(straggling, max_steps=300)
    incident = stragglers.check_stragglers(straggling, 1)
    assert incident.decision == "alert"
    assert incident.evidence["remaining_s"] == pytest.approx(300.0)
    assert "would cost more than it saves" in incident.evidence["reason"]
    assert Incident.objects.filter(job=straggling).count() == 1


def test_a_cpu_job_is_judged_against_the_noisy_machine_bar(running, cast):
    # A rank 10 % slower: a straggler on a GPU job, noise for CPU ranks that share their cores.
    generation = Generation.objects.create(job=running, number=1, world_size=2)
    generation.nodes.set([cast.node1])
    store_windows(running, slow_by=0.1)
    Job.objects.filter(pk=running.pk).update(accelerator="cpu")
    running.refresh_from_db()
    assert stragglers.check_stragglers(running, 1) is None
    Job.objects.filter(pk=running.pk).update(accelerator="gpu")
    running.refresh_from_db()
    incident = stragglers.check_stragglers(running, 1)
    assert incident is not None and incident.kind == IncidentKind.STRAGGLER
