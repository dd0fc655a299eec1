"""The example job through real Slurm: sbatch → srun torchrun trains and checkpoints; a SIGKILLed
rank is detected from Slurm's job state, and the job is resubmitted as a new generation that
resumes from the latest verified checkpoint."""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.cluster import api, rank_pids
from tests.ports import free_port
from tests.slurm.slurmcluster import NODE
from tests.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TRAIN_ARGS = ["--steps", "40", "--ckpt-every", "10", "--dataset-size", "256", "--check-every", "5",
              "--min-step-time", "0.15"]


def launch(cluster, token, tmp_path) -> int:
    body = {"name": "tiny-lm-slurm", "entrypoint": "examples/train.py", "nnodes": 1, "nproc_per_node": 2,
            "accelerator": "cpu", "rdzv_port": free_port(), "args": TRAIN_ARGS,
            "nccl_profile": {"GLOO_SOCKET_IFNAME": "lo"},
            "checkpoint_policy": {"dir": str(tmp_path / "checkpoints" / "ckpt")},  # inside the cluster's root
            "recovery_policy": {"backoff_seconds": 0}}
    status, job = api(cluster, token, "POST", "/api/v1/jobs", body)
    assert status == 201, job
    return job["id"]


def test_a_job_runs_through_slurm_and_a_killed_rank_is_resubmitted_from_the_latest_verified_checkpoint(
        slurm, control_plane, operator_token, tmp_path):
    from checkpoints.models import Checkpoint
    from jobs.models import Event, Generation, Incident, Job, StepMetric
    from nodes.models import AgentEventRecord, NodeCommand, SlurmAllocation
    from nodes.transports.slurm.mirror import mirror_nodes

    mirror_nodes()  # the Slurm node becomes a Nightwatch node (beat would, a few seconds later)
    job_id = launch(control_plane, operator_token, tmp_path)

    first = wait_for(lambda: SlurmAllocation.objects.filter(job_id=job_id, generation=1, slurm_job_id__isnull=False)
                     .first(), timeout=30, what="generation 1 to be submitted to Slurm")
    assert first.hostnames == [NODE]
    shown = slurm.command("scontrol", "show", "job", str(first.slurm_job_id))
    assert "Requeue=0" in shown and f"JobName=nw-{job_id}-g1" in shown  # Slurm's own requeue is off
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in first.script and "NIGHTWATCH_TOKEN" not in first.script
    assert "export GLOO_SOCKET_IFNAME=lo" in first.script
    assert slurm.job_state(first.slurm_job_id) in ("PENDING", "RUNNING")
    assert not NodeCommand.objects.exists(), "no agent command for a Slurm node"

    verified = wait_for(lambda: Checkpoint.objects.filter(job_id=job_id, state="verified", step__gte=10)
                        .order_by("-step").first(), timeout=90, what="a verified checkpoint from the Slurm job")
    assert slurm.job_state(first.slurm_job_id) == "RUNNING"
    victim = wait_for(lambda: rank_pids(job_id, 1, tmp_path).get(1), timeout=10, what="rank 1 under slurmd")
    latest = Checkpoint.objects.filter(job_id=job_id, state="verified").order_by("-step").first()
    os.kill(victim, signal.SIGKILL)

    second = wait_for(lambda: SlurmAllocation.objects.filter(job_id=job_id, generation=2, slurm_job_id__isnull=False)
                      .first(), timeout=60, what="generation 2 to be resubmitted to Slurm")
    first.refresh_from_db()
    assert (first.state, first.slurm_state) == ("ended", "FAILED") and first.exit_code not in (0, None)
    assert second.slurm_job_id != first.slurm_job_id
    assert first.token.revoked_at is not None, "the dead generation's hooks token is revoked"
    # The hooks held a job token of that generation, never the node's agent token.
    assert (first.token.scope, first.token.job_id, first.token.generation) == ("job", job_id, 1)

    incident = Incident.objects.get(job_id=job_id)
    assert (incident.kind, incident.decision) == ("crash", "restart")
    exit_record = AgentEventRecord.objects.get(job_id=job_id, generation=1)
    assert exit_record.kind == "exited" and exit_record.detail["slurm"]["state"] == "FAILED"
    assert exit_record.detail["signature"] == "signal"
    assert any(r["signal"] == signal.SIGKILL for r in exit_record.detail["ranks"]), exit_record.detail

    generation = Generation.objects.get(job_id=job_id, number=2)
    assert generation.resumed_from.state == "verified" and generation.resumed_from.step >= latest.step >= verified.step
    resumed_step = generation.resumed_from.step
    assert f"export NIGHTWATCH_RESUME_FROM={generation.resumed_from.location}\n" in second.script
    first_step = wait_for(lambda: StepMetric.objects.filter(job_id=job_id, generation=2).order_by("step").first(),
                          timeout=60, what="generation 2 to train a step")
    assert first_step.step == resumed_step + 1
    assert Event.objects.filter(job_id=job_id, kind="slurm.submit").count() == 2

    # An operator cancels: Nightwatch asks Slurm (scancel), and Slurm's answer confirms the stop.
    status, body = api(control_plane, operator_token, "POST", f"/api/v1/jobs/{job_id}/cancel", {"reason": "done here"})
    assert status == 200, body
    wait_for(lambda: NODE in Generation.objects.get(job_id=job_id, number=2).stopped_nodes, timeout=30,
             what="the cancelled Slurm job to be confirmed stopped")
    second.refresh_from_db()
    assert (second.state, second.slurm_state) == ("ended", "CANCELLED") and second.cancel_sent_at
    assert slurm.job_state(second.slurm_job_id) == "CANCELLED"
    assert AgentEventRecord.objects.get(job_id=job_id, generation=2).kind == "stopped"
    assert Job.objects.get(pk=job_id).state == "cancelled"
    assert Incident.objects.filter(job_id=job_id).count() == 1, "a requested stop is no fault"
    wait_for(lambda: not rank_pids(job_id, 2, tmp_path), timeout=15, what="the ranks to be gone")
