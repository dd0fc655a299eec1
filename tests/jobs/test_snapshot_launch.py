"""The launch carries the job's snapshot settings: every relaunch may restore a snapshot of the
job's lineage branch (a crash loses at most ``snapshot_every`` steps), never one from before a
rollback; a job without them sends an agent exactly what it was sent before they existed."""

from __future__ import annotations

import pytest

from agents.protocol.agent import Command, parse_command_payload
from jobs import orchestrator, services
from jobs.models import Job
from nodes.models import NodeCommand


def start(**checkpoint_policy):
    job = Job.objects.create(name="gpt", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             accelerator="cpu", created_by="test", checkpoint_policy=checkpoint_policy,
                             recovery_policy={"max_restarts": 5, "backoff_seconds": 0})
    services.start_job(job, actor="test")
    job.refresh_from_db()
    return job


def launched(job):
    """The newest launch payload of ``job``, as the agent parses it."""
    command = NodeCommand.objects.filter(job=job, kind="launch").latest("pk")
    return command.payload, parse_command_payload(Command(id="c", kind="launch", idempotency_key="k", job="j",
                                                          generation=command.generation, payload=command.payload))


def relaunch_after_a_crash(job):
    orchestrator.handle_exit(job.pk, job.generation, "gpu-01",
                             {"exit_code": 1, "signature": "signal", "ranks": [{"rank": 1, "signal": 9}]})
    assert orchestrator.advance_recovery(job.pk) and orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()


@pytest.mark.django_db
def test_a_relaunch_carries_snapshot_every_and_the_branch_the_job_is_on(cast):
    job = start(snapshot_every=5)
    _, first = launched(job)
    assert (first.snapshot_every, first.branch_generation) == (5, 0)
    relaunch_after_a_crash(job)
    _, second = launched(job)
    # Generation 2 may restore generation 1's snapshots: the branch began before either.
    assert (job.generation, second.snapshot_every, second.branch_generation) == (2, 5, 0)
    # A rollback started a new branch at generation 3 (``services.rollback_to``): nothing older is restored.
    Job.objects.filter(pk=job.pk).update(branch_since_generation=3)
    job.refresh_from_db()
    relaunch_after_a_crash(job)
    _, third = launched(job)
    assert (job.generation, third.branch_generation) == (3, 3)


@pytest.mark.django_db
def test_without_snapshots_the_launch_has_neither_field_so_older_agents_take_it(cast):
    job = start()
    stored, parsed = launched(job)
    assert not {"snapshot_every", "branch_generation"} & set(stored)
    assert (parsed.snapshot_every, parsed.branch_generation) == (None, None)
