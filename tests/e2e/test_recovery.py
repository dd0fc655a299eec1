"""Recovery end to end: PostgreSQL, Redis, a Celery worker, two node agents (one a spare), and a
real 2-rank torchrun of the example job on CPU. Faults are injected from outside, as on a cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port
from tests.e2e.cluster import ROOT, api, rank_pids, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STEPS = 80
TRAIN_ARGS = ["--steps", str(STEPS), "--ckpt-every", "10", "--dataset-size", "256", "--check-every", "5"]


def start_nodes(cluster, tokens, *, spare_scenario=None, node_scenario=None):
    from nodes.models import Node

    cluster.start_agent("node-a", bootstrap_token=tokens["bootstrap"](), scenario=node_scenario)
    cluster.start_agent("node-b", bootstrap_token=tokens["bootstrap"](), scenario=spare_scenario)
    wait_for(lambda: Node.objects.filter(health="healthy").count() == 2, timeout=60, what="two healthy nodes")
    Node.objects.filter(hostname="node-b").update(is_spare=True)


def launch(cluster, tokens, tmp_path: Path, *, extra_args=(), recovery_policy=None) -> int:
    body = {"name": "tiny-lm", "entrypoint": "examples/train.py", "nnodes": 1, "nproc_per_node": 2,
            "accelerator": "cpu", "rdzv_port": free_port(),
            "args": [*TRAIN_ARGS, "--min-step-time", "0.15", "--final-state", str(tmp_path / "final"),
                     *extra_args],
            "checkpoint_policy": {"dir": str(tmp_path / "ckpt")},
            "recovery_policy": {"backoff_seconds": 0, **(recovery_policy or {})}}
    status, job = api(cluster, tokens["operator"], "POST", "/api/v1/jobs", body)
    assert status == 201, job
    return job["id"]


def job_row(job_id):
    from jobs.models import Job

    return Job.objects.get(pk=job_id)


def wait_for_step(job_id, step, timeout=90):
    return wait_for(lambda: (job_row(job_id).last_step or 0) >= step, timeout=timeout, what=f"step {step}")


def wait_for_verified(job_id, step):
    from checkpoints.models import Checkpoint

    return wait_for(lambda: Checkpoint.objects.filter(job_id=job_id, state="verified", step__gte=step)
                    .order_by("-step").first(), timeout=60, what=f"a verified checkpoint at step {step} or later")


def rank_pid(job_id: int, generation: int, rank: int) -> int:
    return wait_for(lambda: rank_pids(job_id, generation).get(rank), timeout=10,
                    what=f"rank {rank} of generation {generation} to be running")


def reference_run(tmp_path: Path) -> Path:
    """The same job without faults and without a control plane: plain torchrun."""
    out = tmp_path / "reference"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTWATCH")}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
                    "examples/train.py", *TRAIN_ARGS, "--ckpt-dir", str(out / "ckpt"), "--final-state",
                    str(out / "final")], cwd=ROOT, env=env, check=True, capture_output=True, timeout=180)
    return out / "final"


def assert_same_final_state(ours: Path, reference: Path) -> None:
    for rank in (0, 1):
        a = torch.load(ours / f"rank{rank}.pt", weights_only=False)
        b = torch.load(reference / f"rank{rank}.pt", weights_only=False)
        assert a["step"] == b["step"] == STEPS
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), f"rank {rank}: model {key} differs"
        for index, values in b["optim"]["state"].items():
            for name, tensor in values.items():
                assert torch.equal(a["optim"]["state"][index][name], tensor), f"rank {rank}: optim {name} differs"


def test_sigkilled_rank_resumes_from_the_last_good_checkpoint_and_ends_bit_identical(cluster, tokens, tmp_path):
    """Scenarios 1 and 8: a rank is SIGKILLed after its newest checkpoint was corrupted on disk;
    Nightwatch detects the exit, skips the corrupt checkpoint, restores the one before it, and the
    run ends with exactly the weights and optimizer state of an uninterrupted run."""
    from checkpoints.models import Checkpoint
    from jobs.models import Generation, Incident

    start_nodes(cluster, tokens)
    job_id = launch(cluster, tokens, tmp_path)
    wait_for_verified(job_id, 10)
    newest = wait_for(lambda: Checkpoint.objects.filter(job_id=job_id, step__gte=20).order_by("-step").first(),
                      timeout=60, what="a second committed checkpoint")
    shard = next(p for p in Path(newest.location).iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))  # the newest checkpoint rots on disk...
    os.kill(rank_pid(job_id, 1, 1), signal.SIGKILL)  # ...and a rank dies before the next one is committed
    wait_for(lambda: job_row(job_id).state == "completed", timeout=150, what="the job to complete")

    incident = Incident.objects.get(job_id=job_id)
    assert (incident.kind, incident.decision, incident.state) == ("crash", "restart", "resolved")
    assert incident.quiesced_at and incident.relaunched_at and incident.first_step_at
    resumed = Generation.objects.get(job_id=job_id, number=2).resumed_from
    newest.refresh_from_db()
    assert newest.state == "corrupt" and newest.state_reason
    assert resumed.step < newest.step and resumed.state == "verified"
    assert Checkpoint.objects.filter(job_id=job_id, state="corrupt").count() == 1
    assert_same_final_state(tmp_path / "final", reference_run(tmp_path))


def test_a_stopped_rank_is_detected_as_a_hang_and_the_group_restarted(cluster, tokens, tmp_path):
    """Scenario 2: SIGSTOP freezes a rank; no step arrives past the progress timeout."""
    import time

    from jobs.models import Incident

    start_nodes(cluster, tokens)
    job_id = launch(cluster, tokens, tmp_path, recovery_policy={"progress_timeout_s": 8})
    wait_for_step(job_id, 5)
    frozen = rank_pid(job_id, 1, 1)
    stopped_at = time.time()
    os.kill(frozen, signal.SIGSTOP)
    incident = wait_for(lambda: Incident.objects.filter(job_id=job_id, kind="hang").first(), timeout=60,
                        what="a hang incident")
    assert incident.detected_at.timestamp() - stopped_at <= 8 + 5
    wait_for(lambda: job_row(job_id).state == "completed", timeout=150, what="the job to complete")
    assert not Path(f"/proc/{frozen}").exists(), "the frozen rank was left behind"
    assert job_row(job_id).generation == 2
