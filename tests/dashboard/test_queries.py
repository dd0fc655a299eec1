"""``dashboard.queries``: the rank-skew grid, the chart's markers, and the overview's figures."""

from __future__ import annotations

import time

import pytest

from agents.protocol import hooks as wire

pytestmark = pytest.mark.django_db


def _started(job):
    from jobs import services

    services.start_job(job, actor="test")
    job.refresh_from_db()
    return job


def _reports(job, steps, *, slow_rank=None, world=4, **flags):
    from jobs import ingest

    batch = wire.ReportBatch(job=str(job.pk), generation=job.generation, reports=[
        wire.StepReport(job=str(job.pk), generation=job.generation, rank=rank, step=step, loss=2.0, grad_norm=1.0,
                        world_size=world, data_cursor=step * 8, samples=2,
                        phases={"input": 0.02, "compute": 0.2 if rank == slow_rank else 0.1, "optimizer": 0.01},
                        spike=step in flags.get("spikes", ()), skipped=step in flags.get("skipped", ()),
                        time=time.time())
        for step in steps for rank in range(world)])
    ingest.record_reports(job, batch, actor="node:gpu-01")


def _windows(job, last_steps, *, nodes=4, ranks_per_node=8, slow_rank=None):
    """What rank 0 reports after each exchange: one window per node, built by the hooks' own code
    from every rank's figures; ``slow_rank``'s compute phase takes twice as long."""
    from agents.hooks.windows import RankTimings, node_windows
    from jobs import ingest

    windows = []
    for last in last_steps:
        rows = []
        for rank in range(nodes * ranks_per_node):
            timings = RankTimings()
            for step in range(last - 9, last + 1):
                timings.add(step, {"input": 0.02, "compute": 0.2 if rank == slow_rank else 0.1, "optimizer": 0.01,
                                   "checkpoint": 0.0})
            rows.append(timings.row(rank // ranks_per_node))
        windows += node_windows(rows, job=str(job.pk), generation=job.generation, time=time.time())
    ingest.record_reports(job, wire.ReportBatch(job=str(job.pk), generation=job.generation, windows=windows),
                          actor="node:gpu-01")


def test_rank_skew_finds_the_straggler_node_and_its_rank_and_splits_the_phases(cast):
    from dashboard.queries import STRAGGLER_RATIO, rank_skew

    job = _started(cast.job)
    _windows(job, [10, 20, 30], slow_rank=19)
    skew = rank_skew(job)
    assert skew["steps"] == [10, 20, 30] and skew["node_count"] == 4
    assert skew["stragglers"] == [2]
    slow = next(r for r in skew["nodes"] if r["node"] == 2)
    assert slow["rank"] == 19
    assert all(cell["slow"] and cell["ratio"] >= STRAGGLER_RATIO and cell["rank"] == 19 for cell in slow["cells"])
    assert all(not cell["slow"] for r in skew["nodes"] if r["node"] != 2 for cell in r["cells"])
    for row in skew["phases"]:
        assert sum(part["share"] for part in row["parts"]) == pytest.approx(1.0)
    compute = {row["label"]: next(p["seconds"] for p in row["parts"] if p["name"] == "compute")
               for row in skew["phases"]}
    assert compute["node 2: rank 19"] == pytest.approx(0.2) and compute["node 0: rank 0"] == pytest.approx(0.1)
    assert compute["job (mean rank, steps to 30)"] == pytest.approx(0.1 + 0.1 / 32)


def test_rank_skew_shows_the_slowest_nodes_of_a_large_job(cast, django_assert_max_num_queries):
    from dashboard import queries

    job = _started(cast.job)
    _windows(job, [10, 20], nodes=queries.SKEW_NODES + 8, ranks_per_node=1, slow_rank=37)
    with django_assert_max_num_queries(4):
        skew = queries.rank_skew(job)
    assert len(skew["nodes"]) == queries.SKEW_NODES and skew["node_count"] == queries.SKEW_NODES + 8
    assert 37 in [row["node"] for row in skew["nodes"]] and skew["stragglers"] == [37]


def test_the_skew_view_s_cells_say_rank_time_and_ratio_and_a_missing_window_says_so(cast):
    """The cells are built as HTML in Python (not by the template engine): a straggler's cell names its
    rank, its step time and its ratio; a node without a window at a step says that, not "rank None"."""
    from core import roles
    from dashboard import sections
    job = _started(cast.job)
    _windows(job, [10, 30], slow_rank=19)
    _windows(job, [20], nodes=3, slow_rank=19)  # node 3 sent no window ending at step 20
    html = sections.render("job", ["skew"], frozenset(roles.CAPABILITY_PERMISSIONS), sections.Subject(job=job))["skew"]
    straggler = html[html.index('data-node="2"'):].split("</tr>")[0]
    assert straggler.count('<td class="heat heat-4 slow" title="window ending at step ') == 3
    assert 'title="window ending at step 30: rank 19 230 ms per step (1.77×)">1.77</td>' in straggler
    gap = html[html.index('data-node="3"'):].split("</tr>")[0]
    assert '<td class="heat heat-0" title="window ending at step 20: no timings from this node"></td>' in gap
    assert "None" not in html


def test_the_chart_carries_spikes_skips_checkpoints_and_restarts(cast):
    from dashboard.queries import chart
    from jobs.models import Generation

    job = _started(cast.job)
    _reports(job, range(1, 5), world=2, spikes={2}, skipped={3})
    Generation.objects.create(job=job, number=2, world_size=2, first_step=3)
    data = chart(job)
    assert [(p["step"], p["spike"], p["skipped"]) for p in data["points"]] == [
        (1, False, False), (2, True, False), (3, False, True), (4, False, False)]
    assert data["restarts"] == [{"step": 3, "generation": 2}]


def test_the_overview_shows_goodput_and_open_incidents(cast):
    from dashboard.queries import overview_jobs
    from jobs.models import Incident

    job = _started(cast.job)
    _reports(job, [1, 2], world=2)
    Incident.objects.create(job=job, kind="crash", classification="rank exited")
    row = next(r for r in overview_jobs() if r["job"].pk == job.pk)
    assert row["job"].open_incidents == 1
    assert row["ettr"] is not None and 0.0 <= row["ettr"] <= 1.0


def _job_with_history(name: str, *, paused: bool, incident: bool, blocking_s: float):
    """A running job with a minute of history: steps, and as asked a pause (left), an incident and
    checkpoints that blocked training."""
    from datetime import timedelta

    from django.utils import timezone

    from checkpoints.models import Checkpoint
    from core.models import Event
    from jobs.models import Generation, Incident, Job, StepMetric

    now = timezone.now()
    job = Job.objects.create(name=name, entrypoint="examples/train.py", nnodes=1, nproc_per_node=2, created_by="test",
                             state="running", generation=1, last_step_at=now - timedelta(seconds=2))
    Generation.objects.create(job=job, number=1, world_size=2, state="running", started_at=now - timedelta(seconds=60),
                              first_step_at=now - timedelta(seconds=55))
    StepMetric.objects.bulk_create(StepMetric(job=job, generation=1, rank=0, step=s, loss=1.0, world_size=2,
                                              data_cursor=s, reported_at=now, phases={"compute": 0.1 * (1 + s % 3)})
                                   for s in range(1, 40))
    if paused:
        for old, new, ago in (("running", "paused", 40), ("paused", "running", 30)):
            Event.objects.create(kind="job.state", actor="test", job=job, old_state=old, new_state=new,
                                 created_at=now - timedelta(seconds=ago))
    if incident:
        Incident.objects.create(job=job, kind="crash", decision="restart", fault_at=now - timedelta(seconds=42),
                                detected_at=now - timedelta(seconds=41), first_step_at=now - timedelta(seconds=25),
                                lost_steps=4)
    for step in (10, 20):
        Checkpoint.objects.create(job=job, step=step, location=f"/ckpt/{job.pk}/{step}", blocking_s=blocking_s)
    return job


def test_the_overview_computes_every_job_s_goodput_as_its_own_page_does_in_queries_that_do_not_grow_with_jobs(
        cast, django_assert_max_num_queries):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from dashboard.queries import overview_jobs
    from jobs.goodput import goodput_of
    from jobs.models import Job

    for i in range(2):
        _job_with_history(f"first-{i}", paused=bool(i), incident=True, blocking_s=0.5 * i)
    with CaptureQueriesContext(connection) as two:
        overview_jobs()
    for i in range(6):
        _job_with_history(f"then-{i}", paused=i % 2 == 0, incident=i % 3 == 0, blocking_s=0.25 * i)
    # SQLite (the embedded demo) cannot union the jobs' newest steps: one query a job there.
    with django_assert_max_num_queries(len(two) + (0 if connection.features.supports_slicing_ordering_in_compound
                                                   else 6)):
        rows = overview_jobs(now=(now := timezone.now()))

    assert len(rows) == 9  # the cast's job has no generation yet: no figure
    for row in rows:
        alone = goodput_of(Job.objects.get(pk=row["job"].pk), now=now)  # running jobs' wall time grows
        expected = alone.ettr if alone.wall_s > 0 else None
        assert row["ettr"] == pytest.approx(expected, abs=1e-3), row["job"].name
    assert {row["ettr"] is None for row in rows} == {True, False}
    assert len({round(row["ettr"], 3) for row in rows if row["ettr"] is not None}) > 3, "the facts differ by job"
