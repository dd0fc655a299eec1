"""Finding 6: checkpoint paths were not confined.

Reproduced before the fix: a commit naming a directory outside the checkpoint root was recorded,
and deleting it through the API removed that directory; a job's ``replica_dir`` made the control
plane copy files into an arbitrary directory; a manifest naming ``/etc/shadow`` told a viewer its
size (in the verification reason), and one naming ``/dev/zero`` hung verification.

Now, against the real server: a commit outside the job's checkpoint directory, through ``..`` or
through a symlinked directory is a 400 naming ``path`` and records nothing; a row recorded outside
(before the fix) is marked corrupt and its directory survives a DELETE; manifest entries outside
the directory are reasons, never reads; nothing is written under a ``replica_dir`` outside the
replica roots.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest

from agents.hooks.manifest import MANIFEST, MARKER
from checkpoints.models import Checkpoint
from jobs.models import Event, Job
from tests.checkpoints.conftest import build_checkpoint, commit_for
from tests.e2e.cluster import api
from tests.security.test_checkpoint_pickle import hooks_token, job_directory, running_job
from tests.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:torch.distributed")]


def checkpoint_at(directory: Path) -> Path:
    return build_checkpoint(directory, step=10, data_cursor=40, config_hash="c0ffee")


def commit(cluster, job: Job, node, path: Path | str, source: Path) -> tuple[int, dict]:
    body = dataclasses.asdict(commit_for(job, source, generation=1))
    return api(cluster, hooks_token(job, 1, node), "POST", f"/api/v1/jobs/{job.pk}/checkpoints",
               {**body, "path": str(path)})


def settled(checkpoint: Checkpoint) -> bool:
    checkpoint.refresh_from_db()
    return checkpoint.state != "committed"


def test_commits_outside_the_job_directory_are_refused_and_nothing_is_recorded(cluster, tmp_path):
    job, node = running_job("confined")
    outside = checkpoint_at(tmp_path / "outside" / "step-00000010-g1-abc")
    inside_root = job_directory(cluster, job)
    inside_root.mkdir(parents=True)
    os.symlink(outside.parent, inside_root / "escape")
    attempts = {
        str(outside): "is outside",
        f"{inside_root}/../../outside/{outside.name}": "without '..'",
        str(inside_root / "escape" / outside.name): "symlink",
        "relative/step-00000010-g1-abc": "must be an absolute path",
    }
    for path, reason in attempts.items():
        status, problem = commit(cluster, job, node, path, outside)
        assert status == 400, (path, problem)
        assert "path" in problem["detail"] and reason in problem["detail"], (path, problem)
    assert not Checkpoint.objects.filter(job=job).exists()
    assert sorted(p.name for p in outside.iterdir()) == sorted([".metadata", "__0_0.distcp", MANIFEST, MARKER])


def test_a_row_recorded_outside_before_the_fix_is_never_read_nor_deleted(cluster, tokens, tmp_path):
    job, _ = running_job("legacy")
    victim = checkpoint_at(tmp_path / "precious" / "step-00000010-g1-abc")
    legacy = Checkpoint.objects.create(job=job, step=10, data_cursor=40, config_hash="c0ffee", location=str(victim))

    status, body = api(cluster, tokens["operator"], "POST", f"/api/v1/checkpoints/{legacy.pk}/verify", {})
    assert status == 200 and body["state"] == "corrupt" and "is outside" in body["state_reason"]
    status, body = api(cluster, tokens["operator"], "DELETE", f"/api/v1/checkpoints/{legacy.pk}",
                       {"reason": "cleanup"})
    assert status == 200 and body["state"] == "deleted"
    assert (victim / MARKER).exists() and (victim / "__0_0.distcp").exists()
    assert "is outside" in Event.objects.get(job=job, kind="checkpoint.delete_failed").reason


def test_manifest_entries_outside_the_directory_are_reasons_never_reads(cluster, tmp_path):
    job, node = running_job("entries")
    for step, name in enumerate(["/etc/shadow", "../../../../etc/shadow", "/dev/zero"], start=10):
        directory = checkpoint_at(job_directory(cluster, job) / f"step-{step:08d}-g1-abc")
        manifest = json.loads((directory / MANIFEST).read_text())
        manifest["files"].append({"name": name, "size": 1, "sha256": "0" * 64})
        raw = json.dumps(manifest).encode()
        (directory / MANIFEST).write_bytes(raw)
        (directory / MARKER).write_text(json.dumps({"manifest_sha256": hashlib.sha256(raw).hexdigest(), "step": 10}))

        status, body = commit(cluster, job, node, directory, directory)
        assert status == 201, body
        checkpoint = Checkpoint.objects.get(pk=body["id"])
        wait_for(lambda c=checkpoint: settled(c), timeout=60, what="the worker to verify the commit")
        assert checkpoint.state == "corrupt", name
        assert f"{name!r}: must be a plain file name" in checkpoint.state_reason
        assert "bytes" not in checkpoint.state_reason  # not even the size of the named file


def test_nothing_is_written_under_a_replica_dir_outside_the_replica_roots(cluster, tmp_path):
    job, node = running_job("replicas")
    target = tmp_path / "anywhere"
    Job.objects.filter(pk=job.pk).update(checkpoint_policy={"replica_dir": str(target)})
    directory = checkpoint_at(job_directory(cluster, job) / "step-00000010-g1-abc")

    status, body = commit(cluster, job, node, directory, directory)
    assert status == 201, body
    checkpoint = Checkpoint.objects.get(pk=body["id"])
    wait_for(lambda: settled(checkpoint), timeout=60, what="the worker to verify the commit")
    assert checkpoint.state == "verified", checkpoint.state_reason
    wait_for(lambda: Checkpoint.objects.get(pk=checkpoint.pk).replica_reason, timeout=30,
             what="the refused replica to be recorded")
    checkpoint.refresh_from_db()
    # The cluster configures no replica root at all: any replica_dir is outside.
    assert f"replica_dir {str(target)!r} is refused" in checkpoint.replica_reason
    assert not target.exists()
