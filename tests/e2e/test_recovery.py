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

from tests.e2e.cluster import ROOT, api, rank_pids, wait_for
from tests.ports import free_port

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
            "checkpoint_policy": {"dir": str(tmp_path / "checkpoints" / "ckpt")},
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


def rank_pid(cluster, job_id: int, generation: int, rank: int) -> int:
    return wait_for(lambda: rank_pids(job_id, generation, cluster.tmp).get(rank), timeout=10,
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
    os.kill(rank_pid(cluster, job_id, 1, 1), signal.SIGKILL)  # ...and a rank dies before the next one is committed
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
    """Scenario 2: SIGSTOP freezes a rank; no step arrives past the progress timeout, which the job's
    own rhythm sets (issue 20: no policy override), and the hang dates from the last step."""
    import time

    from jobs import progress
    from jobs.models import Incident
    from jobs.steps import recent_step_seconds

    start_nodes(cluster, tokens)
    job_id = launch(cluster, tokens, tmp_path)
    wait_for_verified(job_id, 10)  # a save measured: the rhythm knows what a checkpoint step costs
    wait_for_step(job_id, 15)
    frozen = rank_pid(cluster, job_id, 1, 1)
    stopped_at = time.time()
    os.kill(frozen, signal.SIGSTOP)
    incident = wait_for(lambda: Incident.objects.filter(job_id=job_id, kind="hang").first(), timeout=60,
                        what="a hang incident")
    job = job_row(job_id)  # the hung generation's rhythm (the next one may have stepped by now)
    timeout = progress.progress_timeout_s(job, recent_step_seconds(job, generation=1), progress.checkpoint_blocks(job))
    assert timeout < progress.UNMEASURED_SAVE_FLOOR_S  # 0.15 s steps: seconds, not a fixed allowance
    # The last step came before the stop, at most a slow step and a report earlier...
    assert stopped_at - 3 <= incident.fault_at.timestamp() <= stopped_at + 0.5
    # ...and the verdict a timeout after it (plus the 0.5 s sweep and a shared machine's delays).
    assert incident.detected_at.timestamp() - stopped_at <= timeout + 0.5 + 3
    assert (incident.detected_at - incident.fault_at).total_seconds() >= timeout - progress.ANCHOR_LAG_MAX_S
    wait_for(lambda: job_row(job_id).state == "completed", timeout=150, what="the job to complete")
    assert not Path(f"/proc/{frozen}").exists(), "the frozen rank was left behind"
    assert job_row(job_id).generation == 2


def test_the_same_exception_at_the_same_step_twice_pauses_after_the_second(cluster, tokens, tmp_path):
    """Scenario 3: a deterministic bug. One automatic retry, then a pause — not a restart loop."""
    from jobs.models import Incident

    start_nodes(cluster, tokens)
    job_id = launch(cluster, tokens, tmp_path, extra_args=["--raise-at", "15"])
    wait_for(lambda: job_row(job_id).state == "paused", timeout=120, what="the job to pause")
    job = job_row(job_id)
    assert job.generation == 2, "restarted exactly once"
    kinds = list(Incident.objects.filter(job_id=job_id).order_by("detected_at").values_list("kind", flat=True))
    assert kinds == ["crash", "deterministic"]
    last = Incident.objects.filter(job_id=job_id).latest("detected_at")
    assert "injected deterministic failure at step 15" in last.evidence["error_line"]
    assert "retrying cannot help" in job.pause_reason


def test_nan_pauses_with_evidence_then_rollback_skips_the_bad_data_on_a_new_branch(cluster, tokens, tmp_path):
    """Scenario 4 (rollback): NaN loss → paused with the evidence and a proposed rollback; rolling
    back to an earlier checkpoint and skipping the data around the NaN starts a new lineage
    branch that trains past it."""
    from agents.hooks.data import epoch_permutation
    from checkpoints.models import Checkpoint
    from jobs.models import Generation, Incident, StepMetric, TrainingEvent

    # A poisoned sample at global position 195: step 25, rank 0 (8 positions a step, 4 a rank).
    # A data set larger than the run (80 steps x 8 = 640 positions), so it comes up only once.
    poisoned = epoch_permutation(1024, 0, seed=0)[195]
    start_nodes(cluster, tokens)
    job_id = launch(cluster, tokens, tmp_path,
                    extra_args=["--dataset-size", "1024", "--poison-sample", str(poisoned)])
    wait_for(lambda: job_row(job_id).state == "paused", timeout=120, what="the NaN pause")
    incident = Incident.objects.get(job_id=job_id)
    assert (incident.kind, incident.decision) == ("numerical", "pause")
    assert incident.evidence["propose_rollback"] is True and incident.evidence["signal"] == "nan"
    assert "NaN" in job_row(job_id).pause_reason

    early = wait_for(lambda: Checkpoint.objects.filter(job_id=job_id, state="verified", step=10).first(),
                     timeout=30, what="the step-10 checkpoint to be verified")
    # Skip the global samples of steps 21-25 (2 ranks x 4 samples a step): the data around the NaN.
    skip = [early.data_cursor + 10 * 8, early.data_cursor + 15 * 8]
    status, body = api(cluster, tokens["operator"], "POST", f"/api/v1/jobs/{job_id}/rollback",
                       {"checkpoint": early.pk, "reason": "back to before the spike", "skip_data": skip})
    assert status == 200, body
    assert body["generation"] == 2
    generation = Generation.objects.get(job_id=job_id, number=2)
    assert generation.resumed_from_id == early.pk
    branch = wait_for(lambda: Checkpoint.objects.filter(job_id=job_id, generation=generation).order_by("step")
                      .first(), timeout=90, what="a checkpoint on the new branch")
    assert branch.parent_id == early.pk  # the branch grows from the rollback point; history is kept
    assert job_row(job_id).branch_root_id == early.pk
    # With the poisoned sample's range skipped, the branch trains on past it. The skipped
    # samples never reach a rank: the cursor jumps over them, and the hooks say so.
    wait_for(lambda: job_row(job_id).state == "completed", timeout=120, what="the new branch to finish")
    cursors = list(StepMetric.objects.filter(job_id=job_id, generation=2, rank=0).order_by("step")
                   .values_list("data_cursor", flat=True))
    trained_from = [c - 8 for c in cursors]
    assert not any(skip[0] <= c < skip[1] for c in trained_from)
    assert skip[1] in trained_from
    assert TrainingEvent.objects.filter(job_id=job_id, generation=2, kind="data_skipped").exists()
    assert not Incident.objects.filter(job_id=job_id, generation__number=2).exists()



def test_an_xid_on_the_node_drains_it_and_the_job_moves_to_the_spare(cluster, tokens, tmp_path):
    """Scenario 5: the scripted GPU of node-a raises Xid 79 while the job runs there."""
    from jobs.models import Generation, Incident
    from nodes.models import Node

    xid_scenario = {"gpus": 1, "events": [{"at": "25s", "gpu": 0, "xid": 79}]}
    start_nodes(cluster, tokens, node_scenario=xid_scenario)
    job_id = launch(cluster, tokens, tmp_path, extra_args=["--min-step-time", "0.5"])
    wait_for_step(job_id, 3)
    wait_for(lambda: Node.objects.get(hostname="node-a").schedulability != "active", timeout=60,
             what="node-a to be drained")
    wait_for(lambda: job_row(job_id).state == "completed", timeout=150, what="the job to complete on the spare")
    incident = Incident.objects.get(job_id=job_id)
    assert (incident.kind, incident.decision) == ("hardware", "restart_on_spare")
    assert list(incident.nodes.values_list("hostname", flat=True)) == ["node-a"]
    last = Generation.objects.filter(job_id=job_id).latest("number")
    assert list(last.nodes.values_list("hostname", flat=True)) == ["node-b"]
    assert Node.objects.get(hostname="node-a").health == "unhealthy"


def test_failures_beyond_the_budget_open_the_breaker_and_oncall_approval_resumes(cluster, tokens, tmp_path):
    """Scenario 6: a budget of two automatic restarts; the third failure opens the breaker. Approved
    while the storm goes on, the job gets half the budget (issue 24 item 4): the breaker opens again
    after one more restart, not two."""
    from jobs.models import Incident

    def kill_each(generations):
        for generation in generations:
            wait_for(lambda g=generation: (job_row(job_id).generation == g and (job_row(job_id).last_step or 0) >= 12
                                           and job_row(job_id).state == "running"), timeout=90,
                     what=f"generation {generation} to make progress")
            os.kill(rank_pid(cluster, job_id, generation, 0), signal.SIGKILL)
        wait_for(lambda: job_row(job_id).state == "paused", timeout=90, what="the breaker to open")

    start_nodes(cluster, tokens)
    job_id = launch(cluster, tokens, tmp_path, recovery_policy={"max_restarts": 2})
    kill_each((1, 2, 3))
    assert "circuit breaker" in job_row(job_id).pause_reason
    assert Incident.objects.filter(job_id=job_id, kind="retry_storm").count() == 1

    status, body = api(cluster, tokens["operator"], "POST", f"/api/v1/jobs/{job_id}/approve", {"reason": "x"})
    assert status == 403, "only on-call approves"
    status, body = api(cluster, tokens["oncall"], "POST", f"/api/v1/jobs/{job_id}/approve",
                       {"reason": "replaced the cable"})
    assert status == 200, body
    kill_each((4, 5))  # one restart (4 -> 5) is the halved allowance; the second failure pages again
    assert job_row(job_id).generation == 5
    assert Incident.objects.filter(job_id=job_id, kind="retry_storm").count() == 2

    status, body = api(cluster, tokens["oncall"], "POST", f"/api/v1/jobs/{job_id}/approve",
                       {"reason": "the switch this time"})
    assert status == 200, body
    wait_for(lambda: job_row(job_id).state == "completed", timeout=150, what="the job to complete")
    assert job_row(job_id).generation == 6


def test_a_worker_killed_in_the_middle_of_a_recovery_is_finished_by_the_next(cluster, tokens, tmp_path):
    """Scenario 7: the worker dies right after the fault was handled; another worker's sweeper
    completes the recovery and exactly one new generation results."""
    from jobs.models import Generation, Incident
    from nodes.models import AgentEventRecord

    start_nodes(cluster, tokens)
    job_id = launch(cluster, tokens, tmp_path)
    wait_for_step(job_id, 12)
    cluster.procs["worker"].kill(signal.SIGSTOP)  # freeze it so the fault stays queued...
    os.kill(rank_pid(cluster, job_id, 1, 1), signal.SIGKILL)
    wait_for(lambda: AgentEventRecord.objects.filter(job_id=job_id, kind="exited").exists(), timeout=30,
             what="the exit report to reach the control plane")
    cluster.procs["worker"].kill(signal.SIGCONT)
    wait_for(lambda: Incident.objects.filter(job_id=job_id).exists(), timeout=30, what="the incident")
    cluster.procs["worker"].kill(signal.SIGKILL)  # ...and kill it in the middle of the recovery
    state_at_death = job_row(job_id).state
    cluster.start_worker("worker2")
    wait_for(lambda: job_row(job_id).state == "completed", timeout=150, what="the job to complete")
    assert Generation.objects.filter(job_id=job_id).count() == 2, f"died while {state_at_death}"
    assert Incident.objects.get(job_id=job_id).state == "resolved"


def test_nan_pause_then_oncall_approval_resumes_from_the_newest_checkpoint(cluster, tokens, tmp_path):
    """Scenario 4 (approve): the NaN step was skipped by the guard, so on-call may simply resume."""
    from jobs.models import Generation, Incident

    start_nodes(cluster, tokens)
    job_id = launch(cluster, tokens, tmp_path, extra_args=["--inject-nan-at", "25"])
    wait_for(lambda: job_row(job_id).state == "paused", timeout=120, what="the NaN pause")
    assert Incident.objects.get(job_id=job_id).kind == "numerical"
    status, body = api(cluster, tokens["oncall"], "POST", f"/api/v1/jobs/{job_id}/approve",
                       {"reason": "the guard skipped the bad step; carry on"})
    assert status == 200, body
    wait_for(lambda: Generation.objects.filter(job_id=job_id, number=2, first_step_at__isnull=False).exists(),
             timeout=90, what="the approved generation's first step")
    resumed = Generation.objects.get(job_id=job_id, number=2).resumed_from
    assert resumed is not None and resumed.state == "verified"
    assert job_row(job_id).events.filter(actor__startswith="token:pager", reason__startswith="resume approved").exists()
