"""The jobs sweep looks at what expired or waits, never at every job or node: the hang sweep's query
is served by the partial index on live deadlines, and placing pending jobs on a full fleet costs two
queries however many jobs wait."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import orchestrator, progress
from jobs.choices import JobState
from jobs.models import Job


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
