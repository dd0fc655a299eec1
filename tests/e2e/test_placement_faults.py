"""Placement against real agents (issue 24, items 2 and 7): a spec the fleet can never hold is refused
(or, queued, says why it waits), a lemon takes no job even when active, and an operator's clear-lemon
puts it back. On the way, the running job's own hooks token posts an absurd step report to the real
server (item 6): refused, nothing stored."""

from __future__ import annotations

import time

import pytest

from tests.e2e.cluster import api, wait_for
from tests.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def spec(tmp_path, name: str, **extra) -> dict:
    return {"name": name, "entrypoint": "examples/train.py", "nnodes": 1, "nproc_per_node": 2, "accelerator": "cpu",
            "rdzv_port": free_port(), "args": ["--steps", "400", "--min-step-time", "0.05"],
            "checkpoint_policy": {"dir": str(tmp_path / "checkpoints" / name)}, **extra}


def test_unplaceable_specs_are_refused_or_explained_and_a_lemon_is_kept_out_until_cleared(cluster, tokens, tmp_path):
    from jobs.models import Generation, Job
    from nodes.models import Node

    for hostname in ("node-a", "node-b"):
        cluster.start_agent(hostname, bootstrap_token=tokens["bootstrap"]())
    wait_for(lambda: Node.objects.filter(health="healthy").count() == 2, timeout=60, what="two healthy nodes")
    operator = tokens["operator"]

    status, refused = api(cluster, operator, "POST", "/api/v1/jobs", spec(tmp_path, "wide", nnodes=3))
    assert status == 422 and refused["errors"][0]["field"] == "nnodes", refused
    status, queued = api(cluster, operator, "POST", "/api/v1/jobs", spec(tmp_path, "wide", nnodes=3, queue=True))
    assert status == 201, queued
    status, body = api(cluster, operator, "GET", f"/api/v1/jobs/{queued['id']}/status")
    assert body["state"] == "pending"
    assert body["waiting"]["reason"].startswith("not enough healthy nodes: have 2, need 3 (of 2 registered)")
    api(cluster, operator, "POST", f"/api/v1/jobs/{queued['id']}/cancel", {"reason": "too wide"})

    # node-a blamed three times: a lemon. Drained and undrained, it is active again, but takes no job.
    Node.objects.filter(hostname="node-a").update(lemon_count=3)
    node_a = Node.objects.get(hostname="node-a").pk
    api(cluster, operator, "POST", f"/api/v1/nodes/{node_a}/drain", {"reason": "lemon"})
    status, undrained = api(cluster, operator, "POST", f"/api/v1/nodes/{node_a}/undrain", {"reason": "try again"})
    assert status == 200 and undrained["schedulability"] == "active" and "is a lemon" in undrained["warning"]
    status, first = api(cluster, operator, "POST", "/api/v1/jobs", spec(tmp_path, "first"))
    assert status == 201, first
    wait_for(lambda: (Job.objects.get(pk=first["id"]).last_step or 0) >= 1, timeout=90, what="the first job's step 1")
    assert list(Generation.objects.get(job_id=first["id"], number=1).nodes.values_list("hostname", flat=True)) == [
        "node-b"]
    _an_absurd_step_from_the_jobs_own_token_is_refused(cluster, Job.objects.get(pk=first["id"]),
                                                       Node.objects.get(hostname="node-b"))

    status, cleared = api(cluster, operator, "POST", f"/api/v1/nodes/{node_a}/clear-lemon", {"reason": "PSU swapped"})
    assert status == 200 and cleared["lemon_cleared"] == 3
    status, second = api(cluster, operator, "POST", "/api/v1/jobs", spec(tmp_path, "second"))
    assert status == 201, second
    placed = wait_for(lambda: Generation.objects.filter(job_id=second["id"], number=1).first(), timeout=30,
                      what="the second job's placement")
    assert list(placed.nodes.values_list("hostname", flat=True)) == ["node-a"]


def _an_absurd_step_from_the_jobs_own_token_is_refused(cluster, job, node) -> None:
    """Issue 24's probe: a current-generation report with step +100,000 left ``last_step`` at 100,154."""
    from core.events import EventKind
    from core.models import Event
    from core.tokens import job_token_for
    from jobs.models import StepMetric

    step = (job.last_step or 0) + 100_000
    report = {"job": str(job.pk), "generation": 1, "rank": 0, "step": step, "loss": 2.0, "grad_norm": 1.0,
              "world_size": 2, "data_cursor": step * 16, "samples": 8, "phases": {"compute": 0.1},
              "time": time.time()}
    status, body = api(cluster, job_token_for(job, 1, node), "POST", f"/api/v1/jobs/{job.pk}/reports",
                       {"job": str(job.pk), "generation": 1, "reports": [report], "events": []})
    assert status == 422, body
    assert not StepMetric.objects.filter(job=job, step=step).exists()
    assert (type(job).objects.get(pk=job.pk).last_step or 0) < 100_000
    assert Event.objects.filter(job=job, kind=EventKind.JOB_REPORTS_REFUSED).exists()
