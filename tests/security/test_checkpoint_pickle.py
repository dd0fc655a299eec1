"""Finding 1: a crafted DCP ``.metadata`` ran a shell command in the control plane.

Reproduced before the fix: a training process committed a checkpoint whose ``.metadata`` was a
pickle calling ``os.system`` (with a manifest and commit marker consistent with it); the Celery
checkpoint worker unpickled it while verifying, and daphne did again on
``POST /checkpoints/{id}/verify``.

Now, against the real server (daphne + Celery + PostgreSQL + Redis): the commit is reported through
the hooks' endpoint with the generation's job token, as the hooks would; the worker's verification
and the on-demand one both mark the checkpoint corrupt with the restricted unpickler's reason, and
the file the command would create never exists. A load test (which would unpickle) is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest

from agents.hooks.manifest import DCP_METADATA, MANIFEST, MARKER
from checkpoints.models import Checkpoint
from jobs import state
from jobs.choices import JobState
from jobs.models import Generation, Job
from nodes.models import Node
from tests.checkpoints.conftest import build_checkpoint, commit_for
from tests.e2e.cluster import api
from tests.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:torch.distributed")]


def hooks_token(job: Job, generation: int, node: Node) -> str:
    """The credential a training process holds for the hooks endpoints (one place, to switch easily)."""
    from core.tokens import job_token_for

    return job_token_for(job, generation, node)


def running_job(name: str) -> tuple[Job, Node]:
    """A job whose generation 1 is placed on one node, as a launch leaves it."""
    node = Node.objects.create(hostname=f"{name}-node", address="10.0.0.9", health="healthy")
    job = Job.objects.create(name=name, entrypoint="examples/train.py", nnodes=1, nproc_per_node=1,
                             accelerator="cpu", created_by="test")
    state.transition(job, JobState.INITIALIZING, actor="test")
    Generation.objects.create(job=job, number=1, world_size=1).nodes.add(node)
    job.refresh_from_db()
    return job, node


def job_directory(cluster, job: Job) -> Path:
    """The job's checkpoint directory as the server sees it (its CHECKPOINT_ROOT, not this process's)."""
    return Path(cluster.env["NIGHTWATCH_CHECKPOINT_ROOT"]) / f"job-{job.pk}"


def reseal(directory: Path, replace: dict[str, bytes]) -> None:
    """Swap files for ``replace``'s bytes and commit a consistent manifest and marker, as an attacker can."""
    manifest = json.loads((directory / MANIFEST).read_text())
    for name, data in replace.items():
        (directory / name).write_bytes(data)
        for entry in manifest["files"]:
            if entry["name"] == name:
                entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    raw = json.dumps(manifest).encode()
    (directory / MANIFEST).write_bytes(raw)
    (directory / MARKER).write_text(json.dumps({"manifest_sha256": hashlib.sha256(raw).hexdigest(),
                                                "step": manifest["step"]}))


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def commit_body(job: Job, path: Path) -> dict:
    return dataclasses.asdict(commit_for(job, path, generation=1))


def test_a_crafted_metadata_pickle_never_runs_in_the_worker_or_in_daphne(cluster, tokens, tmp_path):
    job, node = running_job("pickle")
    marker = tmp_path / "pwned"
    directory = build_checkpoint(job_directory(cluster, job) / "step-00000010-g1-abc", step=10, data_cursor=40,
                                 config_hash="c0ffee")
    reseal(directory, {DCP_METADATA: pickle.dumps(Payload(marker))})

    status, body = api(cluster, hooks_token(job, 1, node), "POST", f"/api/v1/jobs/{job.pk}/checkpoints",
                       commit_body(job, directory))
    assert status == 201, body
    checkpoint = Checkpoint.objects.get(pk=body["id"])

    def verified_by_the_worker():
        checkpoint.refresh_from_db()
        return checkpoint.state != "committed"

    wait_for(verified_by_the_worker, timeout=60, what="the Celery worker to verify the commit")
    assert checkpoint.state == "corrupt"
    assert "DCP metadata unreadable" in checkpoint.state_reason
    assert "not a DCP metadata type" in checkpoint.state_reason
    assert not marker.exists()

    status, body = api(cluster, tokens["operator"], "POST", f"/api/v1/checkpoints/{checkpoint.pk}/verify", {})
    assert status == 200 and body["state"] == "corrupt" and "not a DCP metadata type" in body["state_reason"]
    status, body = api(cluster, tokens["operator"], "POST", f"/api/v1/checkpoints/{checkpoint.pk}/verify",
                       {"load_test": True})
    assert status == 400 and "load_test" in json.dumps(body)
    assert not marker.exists()
