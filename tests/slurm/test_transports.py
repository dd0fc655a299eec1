"""Dispatch on the nodes' transport: one transport per generation, Slurm's kept-out nodes (no Slurm needed)."""

from __future__ import annotations

import pytest


@pytest.fixture
def fleet(db):
    from nodes.models import Node

    def node(name, transport, **fields):
        return Node.objects.create(hostname=name, address=name, transport=transport, **{"health": "healthy", **fields})

    return {n.hostname: n for n in [
        node("agent-1", "agent"), node("agent-2", "agent"),
        node("slurm-1", "slurm"), node("slurm-2", "slurm"), node("slurm-3", "slurm"),
        node("slurm-drained", "slurm", schedulability="drained"), node("slurm-lemon", "slurm", lemon_count=9),
        node("slurm-sick", "slurm", health="unhealthy"),
        node("ssh-1", "ssh"),
    ]}


def test_a_generation_stays_on_one_transport_preferring_the_one_it_ran_on(fleet):
    from jobs.launching import one_transport

    pool = [n for n in fleet.values() if n.schedulability == "active" and n.health == "healthy" and not n.lemon_count]
    names = lambda nodes: sorted(n.hostname for n in nodes)  # noqa: E731
    assert names(one_transport(pool, previous=set(), nnodes=2)) == ["agent-1", "agent-2"]
    assert names(one_transport(pool, previous=set(), nnodes=3)) == ["slurm-1", "slurm-2", "slurm-3"]
    assert names(one_transport(pool, previous={"slurm-2"}, nnodes=1)) == ["slurm-1", "slurm-2", "slurm-3"]
    assert one_transport([], previous=set(), nnodes=1) == []


def test_ssh_nodes_are_never_candidates_and_mixed_nodes_are_refused(fleet):
    from jobs.launching import candidates
    from jobs.models import Job
    from nodes.transports import MixedTransports, for_nodes

    job = Job.objects.create(name="j", entrypoint="examples/train.py", created_by="test")
    assert "ssh-1" not in {n.hostname for n in candidates(job)}
    with pytest.raises(MixedTransports, match="2 transports"):
        for_nodes([fleet["agent-1"], fleet["slurm-1"]])
    assert for_nodes([fleet["slurm-1"]]).name == "slurm"


def test_slurm_launch_records_the_allocation_once_and_submits_after_the_commit(
        fleet, django_capture_on_commit_callbacks):
    from jobs.models import Job
    from nodes.models import SlurmAllocation
    from nodes.transports import Launch, for_nodes
    from nodes.transports.slurm.launch import excluded_nodes

    assert excluded_nodes(exclude=["slurm-1"]) == ["slurm-drained", "slurm-lemon", "slurm-sick"]
    job = Job.objects.create(name="j", entrypoint="examples/train.py", created_by="test", generation=1)
    payload = {"script": "examples/train.py", "nnodes": 1, "nproc_per_node": 2, "node_rank": 0,
               "rdzv_endpoint": "slurm-1:29400", "rdzv_id": "nw-1-g1"}
    launch = Launch(job=job, generation=1, nodes=[fleet["slurm-1"]], payloads=[payload])
    with django_capture_on_commit_callbacks() as callbacks:
        for_nodes(launch.nodes).launch(launch)
        for_nodes(launch.nodes).launch(launch)  # a retried start_generation step: still one allocation
    allocation = SlurmAllocation.objects.get(job=job)
    assert (allocation.state, allocation.hostnames, allocation.excluded) == (
        "submitting", ["slurm-1"], ["slurm-drained", "slurm-lemon", "slurm-sick"])
    assert allocation.payload["rdzv_id"] == "nw-1-g1" and len(callbacks) == 1


@pytest.mark.parametrize(("slurm_state", "kind"), [("FAILED", "exited"), ("CANCELLED", "stopped")])
def test_a_job_that_failed_before_the_stop_nightwatch_asked_for_took_is_an_exit_not_a_stop(
        fleet, tmp_path, slurm_state, kind):
    """A rank that died stalls the others; the hang sweep may ask for the stop (``scancel``) before
    the controller's next poll shows the failure. Slurm's state says which ended the job: FAILED is
    the exit, with its evidence and torchrun's own time of it; only CANCELLED is the stop."""
    from django.utils import timezone

    from jobs.models import Job
    from nodes.models import AgentEventRecord, SlurmAllocation
    from nodes.transports.slurm.ended import report_ended

    output = tmp_path / "out.log"
    output.write_text("E1203 17:53:15.988000 6773 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
                      "(exitcode: -9) local_rank: 1 (pid: 6779) of binary: /usr/bin/python3\n")
    job = Job.objects.create(name="j", entrypoint="examples/train.py", created_by="test", generation=1)
    row = SlurmAllocation.objects.create(job=job, generation=1, state="queued", hostnames=["slurm-1"],
                                         slurm_job_id=41, output_path=str(output),
                                         cancel_requested_at=timezone.now())
    assert report_ended(row, state=slurm_state, exit_status=None, exit_signal=9, requested_stop=True) == 1
    record = AgentEventRecord.objects.get(job_id=job.pk)
    assert record.kind == kind and record.detail["requested_stop"] is (kind == "stopped")
    assert isinstance(record.detail["torchrun_failed_at"], float)
    assert (record.detail["signature"] is None) is (kind == "stopped")
