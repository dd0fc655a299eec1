"""``/metrics``: Prometheus text that ``promtool check metrics`` accepts, with bounded labels, read
from the database at scrape time, and only for callers holding ``view`` or scraping from an
allowed network."""

from __future__ import annotations

import subprocess
from datetime import timedelta

import pytest
from django.utils import timezone

pytestmark = pytest.mark.django_db


@pytest.fixture
def scraped(world, api):
    from nodes.models import GPU

    now = timezone.now()
    incident = world.incident
    incident.fault_at, incident.detected_at = now - timedelta(seconds=4), now - timedelta(seconds=3)
    incident.first_step_at = now - timedelta(seconds=1)
    incident.save()
    GPU.objects.create(node=world.cast.node1, index=0, health="healthy",
                       last_sample={"temperature_c": 71.5, "xid_recent": 2, "ecc_uncorrected_recent": 0,
                                    "ecc_corrected_recent": 3, "utilization_pct": 97.0})
    response = api(world.cast.tokens["viewer"]).get("/metrics")
    assert response.status_code == 200, response.content
    return response.content.decode()


def samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_promtool_accepts_the_output(scraped):
    done = subprocess.run(["/usr/bin/promtool", "check", "metrics"], input=scraped, capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_numbers_come_from_the_database(world, scraped):
    values = samples(scraped)
    job, node = world.cast.job.pk, world.cast.node1.hostname
    assert values['nightwatch_jobs{state="pending"}'] == 1
    assert values['nightwatch_jobs{state="paused"}'] == 1
    assert f'nightwatch_job_ettr_ratio{{job="{job}"}}' in values
    assert values['nightwatch_incidents_total{decision="restart",kind="crash"}'] == 1
    assert values['nightwatch_incident_detection_seconds_bucket{kind="crash",le="1.0"}'] == 1
    assert values['nightwatch_incident_detection_seconds_bucket{kind="crash",le="0.5"}'] == 0
    assert values['nightwatch_incident_recovery_seconds_count{kind="crash"}'] == 1
    assert values[f'nightwatch_node_health{{health="healthy",node="{node}"}}'] == 1
    assert values[f'nightwatch_gpu_temperature_celsius{{gpu="0",node="{node}"}}'] == 71.5
    assert values[f'nightwatch_gpu_xid_recent{{gpu="0",node="{node}"}}'] == 2
    assert values[f'nightwatch_checkpoint_verification_failures_total{{job="{job}"}}'] == 0
    assert f'nightwatch_checkpoint_age_seconds{{job="{job}"}}' in values
    assert values['nightwatch_checkpoints{state="verified"}'] == 1


def test_labels_are_bounded_and_carry_no_free_text(world, scraped):
    import re

    label_values = set(re.findall(r'="([^"]*)"', scraped))
    for text in (world.incident.classification, world.paused_job.pause_reason, world.cast.job.name):
        assert text not in label_values
    label_names = set(re.findall(r'[{,]([a-z_]+)="', scraped))
    assert label_names <= {"job", "state", "kind", "decision", "node", "gpu", "health", "le", "queue",
                           "class"}, label_names


def test_who_may_scrape(world, api, settings):
    anonymous = api().get("/metrics")
    assert anonymous.status_code == 401
    assert anonymous["Content-Type"] == "application/problem+json"
    for caller in ("agent", "bootstrap"):
        refused = api(world.cast.tokens[caller]).get("/metrics")
        assert refused.status_code == 403, caller
        assert refused.json()["status"] == 403
    assert api("nw_not-a-real-token-at-all").get("/metrics").status_code == 401
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "METRICS_NETWORKS": ["127.0.0.0/8"]}
    allowed = api().get("/metrics")
    assert allowed.status_code == 200
    assert allowed["Content-Type"].startswith("text/plain")
    assert "default-src 'none'" in allowed["Content-Security-Policy"]


def test_the_grafana_dashboard_only_queries_metrics_that_exist(scraped):
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"nightwatch_[a-z_]+", target["expr"])}
    exposed = set(re.findall(r"^(nightwatch_[a-z_]+)", scraped, re.MULTILINE))
    # queue metrics exist only with Redis (REDIS_URL), as in the test runs
    assert queried <= exposed, sorted(queried - exposed)


def test_efficiency_and_cost_of_running_jobs_are_exported(world, api):
    """MFU, throughput and cost per badput kind come from ``jobs.efficiency`` (issue 10), for
    jobs that still run; a finished job's figures stay in the API only."""
    from jobs import efficiency
    from jobs.models import StepMetric, TrainingEvent

    job = world.cast.job
    job.accelerator, job.generation, job.state = "cpu", 1, "running"
    job.save()
    now = timezone.now()
    TrainingEvent.objects.create(job=job, generation=1, rank=0, step=0, kind="model", key="0:0:0:model:1",
                                 message="model", detail={"parameters": 1_000_000}, reported_at=now)
    StepMetric.objects.bulk_create([
        StepMetric(job=job, generation=1, rank=rank, step=step, loss=2.0, world_size=2, data_cursor=8 * step,
                   samples=4, tokens=128, phases={"compute": 0.2, "input": 0.05}, reported_at=now)
        for step in range(1, 21) for rank in (0, 1)])

    values = samples(api(world.cast.tokens["viewer"]).get("/metrics").content.decode())
    figures = efficiency.snapshot(job)

    assert figures["mfu"] is not None
    assert values[f'nightwatch_job_mfu_ratio{{job="{job.pk}"}}'] == pytest.approx(figures["mfu"])
    assert values[f'nightwatch_job_tokens_per_second{{job="{job.pk}"}}'] == pytest.approx(256 / 0.25)
    assert f'nightwatch_job_cost{{job="{job.pk}"}}' in values
    assert {k for k in values if k.startswith(f'nightwatch_job_cost_wasted{{job="{job.pk}"')} == {
        f'nightwatch_job_cost_wasted{{job="{job.pk}",kind="{kind}"}}' for kind in figures["cost"]["wasted"]}
    # A paused job is not finished: its figures are exported too.
    assert f'nightwatch_job_cost{{job="{world.paused_job.pk}"}}' in values
