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


def test_rank_skew_flags_the_straggler_and_splits_the_phases(cast):
    from dashboard.queries import STRAGGLER_RATIO, rank_skew

    job = _started(cast.job)
    _reports(job, range(1, 6), slow_rank=3)
    skew = rank_skew(job)
    assert skew["steps"] == [1, 2, 3, 4, 5]
    assert skew["stragglers"] == [3]
    slow = next(r for r in skew["ranks"] if r["rank"] == 3)
    assert all(cell["slow"] and cell["ratio"] >= STRAGGLER_RATIO for cell in slow["cells"])
    assert all(not cell["slow"] for r in skew["ranks"] if r["rank"] != 3 for cell in r["cells"])
    for row in skew["phases"]:
        assert sum(part["share"] for part in row["parts"]) == pytest.approx(1.0)
    compute = {row["rank"]: next(p["seconds"] for p in row["parts"] if p["name"] == "compute")
               for row in skew["phases"]}
    assert compute[3] == pytest.approx(0.2) and compute[0] == pytest.approx(0.1)


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
