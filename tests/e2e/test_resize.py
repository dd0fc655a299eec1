"""Resizing a running job end to end (issue 21): a real 2-rank torchrun of the example job is resized
with ``nightwatch resize`` to 1 rank; it pauses at a verified checkpoint, resumes on one rank by
itself, and the samples it trains continue the exact global sample stream of an uninterrupted run:
none twice, none skipped. The global batch halves (4 samples per rank per step), so the weights are
not those of a 2-rank run; the sample stream is what continues exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agents.cli.__main__ import EXIT_OK
from agents.cli.__main__ import main as cli
from tests.e2e.cluster import ROOT, api, wait_for
from tests.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STEPS = 40
COMMON = ["--batch-size", "4", "--dataset-size", "256", "--ckpt-every", "10", "--check-every", "5"]


def records(directory: Path) -> list[dict]:
    """Each (step, rank)'s samples; a step trained again after a resume replaces the lost one."""
    rows: dict[tuple[int, int], dict] = {}
    for path in sorted(directory.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                rows[(record["step"], record["rank"])] = record
    return list(rows.values())


def global_sequence(rows: list[dict]) -> list[int]:
    """Sample ids in (step, rank) order: the order of the global stream."""
    return [i for row in sorted(rows, key=lambda r: (r["step"], r["rank"])) for i in row["ids"]]


def reference_stream(tmp_path: Path, steps: int) -> list[int]:
    """What an uninterrupted one-rank run trains on, from plain torchrun without a control plane."""
    out = tmp_path / "reference"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTWATCH")}
    env.update({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"})
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone",
                    "examples/train.py", *COMMON, "--steps", str(steps), "--ckpt-dir", str(out / "ckpt"),
                    "--log-samples", str(out / "samples")], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=180)
    return global_sequence(records(out / "samples"))


def test_resize_from_two_ranks_to_one_continues_the_exact_global_sample_stream(cluster, tokens, tmp_path, capsys):
    from checkpoints.models import Checkpoint
    from core.models import Event
    from jobs.models import Generation, Job
    from nodes.models import Node

    cluster.start_agent("node-a", bootstrap_token=tokens["bootstrap"]())
    wait_for(lambda: Node.objects.filter(health="healthy").count() == 1, timeout=60, what="a healthy node")
    samples = tmp_path / "samples"
    body = {"name": "resized", "entrypoint": "examples/train.py", "nnodes": 1, "nproc_per_node": 2,
            "accelerator": "cpu", "rdzv_port": free_port(),
            "args": [*COMMON, "--steps", str(STEPS), "--min-step-time", "0.15", "--log-samples", str(samples)],
            "checkpoint_policy": {"dir": str(tmp_path / "checkpoints" / "ckpt")},
            # The machine is shared: a start slowed past the default allowance (60 s) would be a hang,
            # and so would a step stalled past the derived timeout's 2 s floor (CI, 2026-12-03: a third
            # generation after the resize). This test is about the resize, not about hang detection.
            "recovery_policy": {"backoff_seconds": 0, "startup_timeout_s": 240, "progress_timeout_s": 30}}
    status, job = api(cluster, tokens["operator"], "POST", "/api/v1/jobs", body)
    assert status == 201, job
    job_id = job["id"]
    wait_for(lambda: (Job.objects.get(pk=job_id).last_step or 0) >= 12, timeout=120, what="step 12")

    code = cli(["--url", cluster.url, "--token", tokens["operator"], "resize", str(job_id), "--nnodes", "1",
                "--nproc-per-node", "1", "--reason", "give a rank back"])
    assert code == EXIT_OK
    wait_for(lambda: Job.objects.get(pk=job_id).state == "completed", timeout=180, what="the resized job to complete")

    job_row = Job.objects.get(pk=job_id)
    assert (job_row.nnodes, job_row.nproc_per_node, job_row.resize_to, job_row.generation) == (1, 1, None, 2)
    first, second = Generation.objects.filter(job_id=job_id).order_by("number")
    assert (first.world_size, second.world_size) == (2, 1)
    resumed = second.resumed_from
    assert resumed is not None and resumed.generation_id == first.pk and resumed.step >= 12
    assert Checkpoint.objects.get(pk=resumed.pk).state == "verified"
    assert Event.objects.filter(job_id=job_id, kind="job.resize", reason__contains="give a rank back").exists()
    assert not Event.objects.filter(job_id=job_id, kind="incident.open").exists()  # a resize is no incident

    rows = records(samples)
    before = [r for r in rows if r["world_size"] == 2]
    after = [r for r in rows if r["world_size"] == 1]
    k = resumed.step
    assert {r["step"] for r in after} == set(range(k + 1, STEPS + 1)), "the resumed run starts after the checkpoint"
    assert max(r["step"] for r in before) in (k - 1, k)  # the pause's own step raises StopTraining before the log
    assert all(r["step"] <= k for r in before)
    cursor = 8 * k  # two ranks × 4 samples for each of the k steps the checkpoint holds
    reference = reference_stream(tmp_path, steps=2 * k + (STEPS - k))
    trained_before, trained_after = global_sequence(before), global_sequence(after)
    assert trained_before == reference[:len(trained_before)] and len(trained_before) >= cursor - 8
    assert trained_after == reference[cursor:cursor + len(trained_after)]  # continues exactly at the cursor
    assert len(trained_after) == 4 * (STEPS - k)

    # The training output of both generations was shipped by the real agent as it ran, and reads back
    # through the API and `nightwatch logs` (issue 21, item 1).
    def output(generation: int) -> list[str]:
        status, page = api(cluster, tokens["operator"], "GET",
                           f"/api/v1/jobs/{job_id}/logs?generation={generation}&tail=5000")
        assert status == 200, page
        return [line["text"] for line in page["lines"]]

    wait_for(lambda: any("world size changed from 2 to 1" in text for text in output(2)), timeout=30,
             what="generation 2's output, with the hooks' resume line, to be shipped")
    assert any(f"resumed from step {k}" in text for text in output(2))
    assert output(1) and not any("world size changed" in text for text in output(1))
    capsys.readouterr()
    assert cli(["--url", cluster.url, "--token", tokens["operator"], "logs", str(job_id), "--generation", "2",
                "--tail", "5000", "--follow", "--poll", "0.2"]) == EXIT_OK  # an ended job: follow stops
    shown = capsys.readouterr().out
    assert shown.startswith("=== generation 2 on node-a ===") and "world size changed from 2 to 1" in shown
