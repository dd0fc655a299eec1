"""A real crash whose error line is longer than the incident's classification column (issue 24,
item 1): a job whose rendezvous port is already taken. torchrun fails with a ~190-character
``DistNetworkError`` line; the incident must be written (it used to fail on the 200-character
column, and the job sat until its start-up timeout), with the full line in its evidence, and the
second identical failure must pause the job as deterministic.
"""

from __future__ import annotations

import socket

import pytest

from tests.e2e.cluster import api, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_a_rendezvous_port_in_use_is_recorded_in_full_and_pauses_on_the_repeat(cluster, tokens, tmp_path):
    from jobs.models import Incident, Job
    from nodes.models import Node

    cluster.start_agent("node-a", bootstrap_token=tokens["bootstrap"]())
    wait_for(lambda: Node.objects.filter(health="healthy").count() == 1, timeout=60, what="a healthy node")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        status, job = api(cluster, tokens["operator"], "POST", "/api/v1/jobs", {
            "name": "port-taken", "entrypoint": "examples/train.py", "nnodes": 1, "nproc_per_node": 2,
            "accelerator": "cpu", "rdzv_port": port, "args": ["--steps", "5"],
            "checkpoint_policy": {"dir": str(tmp_path / "checkpoints" / "ckpt")},
            "recovery_policy": {"backoff_seconds": 0}})
        assert status == 201, job
        paused = wait_for(lambda: (j := Job.objects.get(pk=job["id"])).state == "paused" and j, timeout=120,
                          what="the job to pause on the repeated failure")

    first, second = Incident.objects.filter(job_id=job["id"]).order_by("pk")
    assert (first.kind, first.decision, second.kind, second.decision) == ("crash", "restart", "deterministic", "pause")
    line = first.evidence["error_line"]
    assert "EADDRINUSE" in line and f"port: {port}" in line
    assert len(first.classification) <= 200 and line in first.evidence["reason"]
    assert line in paused.pause_reason and paused.generation == 2
    status, body = api(cluster, tokens["operator"], "GET", f"/api/v1/jobs/{job['id']}/status")
    assert status == 200 and [i["generation"] for i in body["recent_incidents"]] == [2, 1]
