"""Slurm being down: a clear error, a degraded state, a back-off — never a crash loop."""

from __future__ import annotations

import time

import pytest

from tests.slurm.slurmcluster import NODE
from tests.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_a_stopped_slurmctld_degrades_the_nodes_with_a_clear_error_and_backs_off_until_it_returns(slurm, db):
    from django.utils import timezone

    from jobs.models import Event, Job
    from nodes.models import Node, SlurmAllocation, SlurmController
    from nodes.transports.slurm.mirror import mirror_nodes
    from nodes.transports.slurm.watch import poll_jobs

    mirror_nodes()
    assert Node.objects.get(hostname=NODE).health == "healthy"
    job = Job.objects.create(name="waiting", entrypoint="examples/train.py", created_by="test", generation=1)
    SlurmAllocation.objects.create(job=job, generation=1, hostnames=[NODE], state="queued", slurm_job_id=999999)

    slurm.stop_controller()
    try:
        assert mirror_nodes() == 0  # returns, does not raise
        controller = SlurmController.objects.get()
        assert not controller.reachable and controller.consecutive_failures == 1
        assert "sinfo" in controller.last_error and "Slurm controller did not answer" in controller.last_error
        assert controller.retry_after > timezone.now()
        node = Node.objects.get(hostname=NODE)
        assert node.health == "degraded" and node.health_reason.startswith("Slurm controller unreachable: sinfo")
        assert node.schedulability == "active", "a controller outage drains nothing"
        down = Event.objects.get(kind="slurm.unreachable")
        assert down.reason == controller.last_error

        started = time.monotonic()  # backing off: no Slurm call, no new failure, no new event
        assert mirror_nodes() == 0 and poll_jobs() == 0
        assert time.monotonic() - started < 1.0
        assert SlurmController.objects.get().consecutive_failures == 1
        assert Event.objects.filter(kind="slurm.unreachable").count() == 1
        assert SlurmAllocation.objects.get(job=job).state == "queued", "an unseen job is not declared dead"

        SlurmController.objects.update(retry_after=timezone.now())  # the back-off has run out
        assert poll_jobs() == 0
        controller = SlurmController.objects.get()
        assert controller.consecutive_failures == 2 and "squeue" in controller.last_error
        assert (controller.retry_after - timezone.now()).total_seconds() > 2, "the back-off grows"
    finally:
        slurm.start_controller()

    SlurmController.objects.update(retry_after=timezone.now())
    mirror_nodes()
    controller = SlurmController.objects.get()
    assert controller.reachable and controller.consecutive_failures == 0 and not controller.last_error
    assert Event.objects.filter(kind="slurm.reachable").count() == 1
    # A restarted slurmctld knows the node as "unknown" until slurmd registers again: degraded, not lost.
    assert Node.objects.get(hostname=NODE).health in ("healthy", "degraded")
    wait_for(lambda: mirror_nodes() >= 0 and Node.objects.get(hostname=NODE).health == "healthy", timeout=40,
             what="the node to be healthy again once slurmd re-registered", interval=1.0)
