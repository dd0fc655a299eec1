"""Specs that can never run are found by the agent's pre-flight, before the first restart (issue 24,
items 3 and 7), end to end with a real agent: a missing entrypoint pauses the job with "file not
found" and its path (it used to pause with reason "unknown"), and a checkpoint directory that takes
no write (a read-only tmpfs mounted by the test; root, as CI runs) pauses it with the reason,
instead of burning the restart budget. No restart is spent, the node is not drained."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.e2e.cluster import ROOT, api, wait_for
from tests.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def read_only_dir(tmp_path):
    where = tmp_path / "checkpoints" / "read-only"
    where.mkdir(parents=True)
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the pre-flight test mounts a read-only tmpfs and needs root (CI runs as root)")
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "nightwatch-ro", str(where)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.fail(f"cannot mount a read-only tmpfs at {where}: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=False, capture_output=True)


def submit(cluster, tokens, tmp_path, *, entrypoint: str, ckpt_dir) -> int:
    body = {"name": "never-runs", "entrypoint": entrypoint, "nnodes": 1, "nproc_per_node": 2, "accelerator": "cpu",
            "rdzv_port": free_port(), "args": ["--steps", "20"], "checkpoint_policy": {"dir": str(ckpt_dir)},
            "recovery_policy": {"backoff_seconds": 0, "max_restarts": 3}}
    status, job = api(cluster, tokens["operator"], "POST", "/api/v1/jobs", body)
    assert status == 201, job
    return job["id"]


def test_a_missing_entrypoint_and_an_unwritable_checkpoint_dir_pause_before_any_restart(cluster, tokens, tmp_path,
                                                                                        read_only_dir):
    from jobs.models import Incident, Job
    from nodes.models import Node

    cluster.start_agent("node-a", bootstrap_token=tokens["bootstrap"]())
    wait_for(lambda: Node.objects.filter(health="healthy").exists(), timeout=60, what="a healthy node")

    cases = [("examples/no_such_train.py", tmp_path / "checkpoints" / "ok", "deterministic",
              f"file not found: {ROOT}/examples/no_such_train.py"),
             ("examples/train.py", read_only_dir, "checkpoint",
              f"checkpoint directory {read_only_dir} is not writable: read-only file system")]
    for entrypoint, ckpt_dir, kind, reason in cases:
        job_id = submit(cluster, tokens, tmp_path, entrypoint=entrypoint, ckpt_dir=ckpt_dir)
        job = wait_for(lambda j=job_id: (row := Job.objects.get(pk=j)).state == "paused" and row, timeout=60,
                       what=f"job {job_id} to pause")
        assert reason in job.pause_reason, job.pause_reason
        assert (job.generation, job.restart_count) == (1, 0)  # refused before any restart
        incident = Incident.objects.get(job_id=job_id)
        assert (incident.kind, incident.decision) == (kind, "pause") and reason in incident.classification
        status, body = api(cluster, tokens["operator"], "GET", f"/api/v1/jobs/{job_id}/status")
        assert status == 200 and body["needs_human"] and reason in body["pause_reason"]
        assert Node.objects.get(hostname="node-a").schedulability == "active"
