"""The jobs sweep looks at what expired or waits, never at every job or node: the hang sweep's query
is served by the partial index on live deadlines, placing pending jobs on a full fleet costs two
queries however many jobs wait, and launching or stopping a generation costs the same queries
however many nodes it has."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import orchestrator, progress, services
from jobs.choices import JobState
from jobs.models import Job
from nodes.models import Node, NodeCommand


def jobs(n: int, **fields) -> list[Job]:
    return Job.objects.bulk_create(Job(name=f"j{i}", entrypoint="examples/train.py", accelerator="cpu",
                                       created_by="test", **fields) for i in range(n))


@pytest.mark.django_db
def test_the_hang_sweep_reads_only_live_deadlines_through_their_index(cast):
    stale = timezone.now() - timedelta(hours=1)
    jobs(50, state=JobState.COMPLETED, progress_deadline=stale)  # finished jobs keep their last deadline
    [hung] = jobs(1, state=JobState.RUNNING, progress_deadline=timezone.now() - timedelta(seconds=1))
    query = (Job.objects.filter(state__in=progress.PROGRESS_WATCHED, progress_deadline__lt=timezone.now())
             .order_by("progress_deadline"))
    assert query.first() == hung
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a table this small would be scanned anyway
        plan = query[:1].explain()
    assert "job_watched_progress_deadline" in plan, plan


@pytest.mark.django_db
def test_pending_jobs_on_a_full_fleet_cost_two_queries(cast):
    Job.objects.filter(pk=cast.job.pk).update(nnodes=3)
    jobs(20, nnodes=3)  # two nodes in the fleet: none of them fits
    with CaptureQueriesContext(connection) as queries:
        assert orchestrator.start_one_pending() is False
    assert len(queries) == 2, [q["sql"] for q in queries]
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.PENDING}


@pytest.mark.django_db
def test_a_pending_job_that_fits_is_still_placed_behind_those_that_do_not(cast):
    Job.objects.filter(pk=cast.job.pk).update(nnodes=3)
    jobs(3, nnodes=3)
    [fits] = jobs(1, nnodes=1)
    assert orchestrator.start_one_pending() is True
    assert Job.objects.get(pk=fits.pk).state == JobState.INITIALIZING


def _hang_of_a_generation_on(nodes: int) -> tuple[int, int]:
    """Queries to launch a job on ``nodes`` nodes, and to declare it hung (which stops every node)."""
    Node.objects.bulk_create(Node(hostname=f"sim-{nodes}-{i:03d}", address=f"10.{nodes}.0.{i}", health="healthy")
                             for i in range(nodes))
    job = Job.objects.create(name=f"on-{nodes}", entrypoint="examples/train.py", nnodes=nodes, accelerator="cpu",
                             created_by="test", recovery_policy={"backoff_seconds": 0})
    with CaptureQueriesContext(connection) as launch:
        services.start_job(job, actor="test")
    assert NodeCommand.objects.filter(job=job, kind="launch").count() == nodes
    Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING, last_step=10,
                                         progress_deadline=timezone.now() - timedelta(seconds=1))
    with CaptureQueriesContext(connection) as verdict:
        assert progress.expire_one_progress_deadline()
    assert NodeCommand.objects.filter(job=job, kind="stop").count() == nodes
    Node.objects.filter(hostname__startswith=f"sim-{nodes}-").delete()  # the next size gets a fleet of its own
    return len(launch), len(verdict)


@pytest.mark.django_db
def test_launching_and_stopping_a_generation_cost_no_more_queries_on_32_nodes_than_on_2(cast):
    """A command per node was a savepoint, an insert and a token lookup each: a hang verdict on a
    64-node job was 290 queries, and 2.5 s of the one worker's time under load (bench.fleet run Q)."""
    Node.objects.filter(pk__in=[cast.node1.pk, cast.node2.pk]).update(health="unreachable")  # not placed
    (launch_2, verdict_2), (launch_32, verdict_32) = _hang_of_a_generation_on(2), _hang_of_a_generation_on(32)
    # No more on 32 (the hang checks of a small fleet may ask one thing more: nodes.services.silence).
    assert launch_32 <= launch_2 and verdict_32 <= verdict_2


@pytest.mark.django_db
def test_a_node_deleted_from_a_live_generation_leaves_the_rest_of_the_fleet_free(cast):
    """The busy nodes' subquery held a NULL for it, and ``NOT IN`` a list with a NULL is never true."""
    services.start_job(cast.job, actor="test")
    assert Job.objects.get(pk=cast.job.pk).state == JobState.INITIALIZING
    Node.objects.filter(pk=cast.node1.pk).delete()
    [other] = jobs(1, nnodes=1)
    assert orchestrator.start_one_pending() is True
    assert Job.objects.get(pk=other.pk).state == JobState.INITIALIZING  # placed on the other node
