"""Query-count guards on the hot paths: the step-report ingest, the telemetry ingest and the list
endpoints cost a bounded number of queries that does not grow with the batch or with the rows.

Each test runs the same request at a small and a large size under one bound, so an N+1 (a query per
report, per sample or per row) fails here rather than in production at fleet scale.
"""

from __future__ import annotations

import time

import pytest

from jobs import state
from jobs.choices import JobState
from jobs.models import Generation
from tests.nodes.conftest import batch_of

# Measured when written: a report batch 20 queries (2 reports or 40), a telemetry batch 7 (1 sample
# or 128), a list 6 or 7 (3 rows or 30). The slack lets a path gain a query or two; one query per
# item would add dozens at the large size. The report batches here are a generation's first: since
# issue 20 that batch also reads the step the hooks resumed from (``record_first_step``, once per
# generation), 25 queries in all (2026-12-02), whatever the batch's size.
REPORTS_MAX_QUERIES = 28
TELEMETRY_MAX_QUERIES = 9
LIST_MAX_QUERIES = 9


def _report(job, rank, step, **flags):
    return {"job": str(job.pk), "generation": 1, "rank": rank, "step": step, "loss": 2.5, "grad_norm": 1.0,
            "world_size": 2, "data_cursor": step * 8, "samples": 4,
            "phases": {"input": 0.01, "compute": 0.1, "optimizer": 0.02}, "time": time.time(), **flags}


def _window(job, node, last_step):
    return {"job": str(job.pk), "generation": 1, "node": node, "first_step": max(1, last_step - 9),
            "last_step": last_step, "ranks": 8, "step_median_s": 0.1, "step_max_s": 0.2, "slowest_rank": 8 * node,
            "slowest_s": 0.15, "phases": {"compute": 0.1}, "slowest_phases": {"compute": 0.14}, "time": time.time()}


@pytest.fixture
def running(cast):
    """cast.job in generation 1 on node1, 2 ranks, initializing."""
    state.transition(cast.job, JobState.INITIALIZING, actor="test")
    generation = Generation.objects.create(job=cast.job, number=1, world_size=2)
    generation.nodes.add(cast.node1)
    return cast


@pytest.mark.django_db
@pytest.mark.parametrize(("first", "steps"), [(1, 1), (1, 20)], ids=["1-step", "20-steps"])
def test_a_report_batch_costs_the_same_queries_whatever_its_size(running, api, django_assert_max_num_queries,
                                                                  first, steps):
    # Every step from rank 0, each step flagged by rank 1 (skipped), a window from each of up to 64 nodes.
    reports = [_report(running.job, rank, step, skipped=rank == 1)
               for step in range(first, first + steps) for rank in (0, 1)]
    windows = [_window(running.job, node, first + steps - 1) for node in range(min(64, 4 * steps))]
    body = {"job": str(running.job.pk), "generation": 1, "reports": reports, "events": [], "windows": windows}
    client = api(running.tokens["agent"])
    with django_assert_max_num_queries(REPORTS_MAX_QUERIES):
        response = client.post(f"/api/v1/jobs/{running.job.pk}/reports", body, format="json")
    assert response.status_code == 202, response.content
    assert response.json()["accepted"] == len(reports)


@pytest.mark.django_db
@pytest.mark.parametrize(("gpus", "per_gpu"), [(1, 1), (8, 16)], ids=["1-sample", "128-samples"])
def test_a_telemetry_batch_costs_the_same_queries_whatever_its_size(cast, api, django_assert_max_num_queries,
                                                                     gpus, per_gpu):
    client = api(cast.tokens["agent"])
    with django_assert_max_num_queries(TELEMETRY_MAX_QUERIES):
        response = client.post(f"/api/v1/nodes/{cast.node1.pk}/telemetry", batch_of(cast.node1, gpus, per_gpu),
                               format="json")
    assert response.status_code == 202, response.content


def _jobs(cast, n):
    from jobs.models import Job

    Job.objects.bulk_create(Job(name=f"job-{i}", entrypoint="examples/train.py", created_by="test")
                            for i in range(n))


def _nodes(cast, n):
    from nodes.models import GPU, Node

    for i in range(n):
        node = Node.objects.create(hostname=f"extra-{i:02d}", address=f"10.1.0.{i + 1}")
        GPU.objects.bulk_create(GPU(node=node, index=g, uuid=f"GPU-{i}-{g}") for g in range(2))


def _incidents(cast, n):
    from jobs.models import Incident

    generation = Generation.objects.create(job=cast.job, number=1, world_size=2)
    for i in range(n):
        incident = Incident.objects.create(job=cast.job, generation=generation, kind="crash",
                                           classification=f"rank exited {i}", decision="restart")
        incident.nodes.add(cast.node1)


def _checkpoints(cast, n):
    from checkpoints.models import Checkpoint

    generation = Generation.objects.create(job=cast.job, number=1, world_size=2)
    Checkpoint.objects.bulk_create(Checkpoint(job=cast.job, generation=generation, step=10 * (i + 1),
                                              state="verified", location=f"/ckpt/step-{10 * (i + 1)}")
                                   for i in range(n))


LISTS = {"jobs": _jobs, "nodes": _nodes, "incidents": _incidents, "checkpoints": _checkpoints, "gpus": _nodes}


@pytest.mark.django_db
@pytest.mark.parametrize("rows", [3, 30])
@pytest.mark.parametrize("endpoint", list(LISTS))
def test_a_list_costs_the_same_queries_whatever_its_length(cast, api, django_assert_max_num_queries, endpoint,
                                                           rows):
    LISTS[endpoint](cast, rows)
    client = api(cast.tokens["viewer"])
    with django_assert_max_num_queries(LIST_MAX_QUERIES):
        response = client.get(f"/api/v1/{endpoint}")
    assert response.status_code == 200, response.content
