"""A full checkpoint disk does not end training (issue 24, item 3), end to end: a small tmpfs
mounted by the test holds the job's checkpoints; once the first checkpoint is verified, the disk is
filled to the last few kilobytes. The next saves fail (DCP's ``CheckpointException``, from ENOSPC,
on both ranks); the 2-rank torchrun trains on, the control plane raises a ``checkpoint`` incident
that says "no space left on device" (``/status`` shows it), retention runs for the full disk at once
(a ``storage.pressure`` event), and once space is freed checkpoints commit again and the job
completes.

Mounting needs root: CI runs as root on this kind of machine. Elsewhere the test is skipped,
never under CI (``CI=1``), where not being able to mount is a failure.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.cluster import api, wait_for
from tests.e2e.test_recovery import job_row, launch, wait_for_verified

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 MiB tmpfs at the job's checkpoint directory, always unmounted afterwards."""
    where = tmp_path / "checkpoints" / "ckpt"
    where.mkdir(parents=True)
    if os.geteuid() != 0:
        message = "the disk-full test mounts a tmpfs and needs root (CI runs as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "nightwatch-disk-full", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs at {where} (root without CAP_SYS_ADMIN?): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        # Lazy: a straggler still holding a file must not leave the mount behind.
        subprocess.run(["umount", "--lazy", str(where)], check=False, capture_output=True)


def fill(where: Path, leave_bytes: int = 8192) -> Path:
    """Fill the file system at ``where`` up to its last ``leave_bytes``; returns the filler file."""
    filler = where / "filler.bin"
    stats = os.statvfs(where)
    size = stats.f_bavail * stats.f_frsize - leave_bytes
    with open(filler, "wb") as handle:
        handle.truncate(0)
        chunk = b"\0" * (1 << 20)
        while size > 0:
            size -= handle.write(chunk[:min(len(chunk), size)])
    return filler


def test_a_full_disk_fails_saves_without_ending_training_and_says_why(cluster, tokens, tmp_path, small_tmpfs):
    from checkpoints.models import Checkpoint
    from core.models import Event
    from jobs.models import Incident
    from nodes.models import Node

    cluster.start_agent("node-a", bootstrap_token=tokens["bootstrap"]())
    wait_for(lambda: Node.objects.filter(health="healthy").exists(), timeout=60, what="a healthy node")
    job_id = launch(cluster, tokens, tmp_path, extra_args=["--steps", "90"])
    wait_for_verified(job_id, 10)
    filler = fill(small_tmpfs)

    incident = wait_for(lambda: Incident.objects.filter(job_id=job_id, kind="checkpoint").first(), timeout=60,
                        what="a checkpoint incident")
    assert "no space left on device" in incident.classification, incident.classification
    assert incident.evidence["detail"]["reason"] == "no space left on device"
    failed_step = incident.evidence["detail"]["step"]
    # Training goes on past the failed save, in the same generation, with no crash.
    wait_for(lambda: (job_row(job_id).last_step or 0) >= failed_step + 10, timeout=60,
             what="training past the failed save")
    job = job_row(job_id)
    assert (job.state, job.generation) == ("running", 1)
    assert not Incident.objects.filter(job_id=job_id).exclude(kind="checkpoint").exists()
    status, body = api(cluster, tokens["operator"], "GET", f"/api/v1/jobs/{job_id}/status")
    assert status == 200 and any("no space left on device" in i["classification"]
                                 for i in body["recent_incidents"]), body
    # Retention ran at once for the full disk, and said so.
    pressure = wait_for(lambda: Event.objects.filter(job_id=job_id, kind="storage.pressure").first(), timeout=30,
                        what="retention's disk-pressure event")
    assert pressure.evidence["out_of_space"] is True
    # Rank 0 removed the failed saves' partial shards: only committed checkpoints lie on the disk.
    leftovers = [p.name for p in small_tmpfs.glob("step-*") if not (p / "COMMITTED").exists()]
    assert not leftovers, leftovers

    filler.unlink()  # space again: checkpoints commit again and the job completes
    wait_for(lambda: job_row(job_id).state == "completed", timeout=120, what="the job to complete")
    assert Checkpoint.objects.filter(job_id=job_id, step__gt=failed_step).exists()
    assert not Incident.objects.filter(job_id=job_id).exclude(kind="checkpoint").exists()
