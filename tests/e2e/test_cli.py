"""``nightwatch launch --wait`` against a running control plane (daphne, a Celery worker, two node
agents, real torchrun): progress while it waits, and the exit code a CI pipeline acts on — 0 for a
job that completes, 3 for one that pauses for a human (a NaN loss). Both jobs run at once, one per
node, to keep the test short.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.e2e.cluster import ROOT, wait_for
from tests.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def write_spec(tmp_path, name: str, extra_args: list[str]):
    spec = {
        "name": name,
        "entrypoint": "examples/train.py",
        "args": ["--steps", "16", "--ckpt-every", "4", "--dataset-size", "128", "--check-every", "4",
                 "--min-step-time", "0.1", *extra_args],
        "nnodes": 1,
        "nproc_per_node": 2,
        "accelerator": "cpu",
        "rdzv_port": free_port(),
        "checkpoint_policy": {"dir": str(tmp_path / "checkpoints" / f"ckpt-{name}")},
        "recovery_policy": {"backoff_seconds": 0},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def cli(cluster, token: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIGHTWATCH", "DATABASE_URL", "REDIS_URL"))}
    env.update({"NIGHTWATCH_URL": cluster.url, "NIGHTWATCH_TOKEN": token})
    return subprocess.run([sys.executable, "-m", "agents.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def start_cli(cluster, token: str, *args: str, log) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIGHTWATCH", "DATABASE_URL", "REDIS_URL"))}
    env.update({"NIGHTWATCH_URL": cluster.url, "NIGHTWATCH_TOKEN": token, "PYTHONUNBUFFERED": "1"})
    return subprocess.Popen([sys.executable, "-m", "agents.cli", *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, text=True)


def history() -> str:
    """Every job's audit trail, for a failure message."""
    from jobs.models import Event

    return "\n".join(f"job {e.job_id} {e.created_at:%H:%M:%S.%f} {e.kind} {e.old_state}->{e.new_state} {e.reason}"
                     for e in Event.objects.filter(job__isnull=False).order_by("created_at"))


def test_launch_waits_with_progress_and_exits_with_the_outcome(cluster, tokens, tmp_path):
    from checkpoints.models import Checkpoint
    from nodes.models import Node

    cluster.start_agent("node-a", bootstrap_token=tokens["bootstrap"]())
    cluster.start_agent("node-b", bootstrap_token=tokens["bootstrap"]())
    wait_for(lambda: Node.objects.filter(health="healthy").count() == 2, timeout=60, what="two healthy nodes")

    good = write_spec(tmp_path, "tiny-ok", [])
    bad = write_spec(tmp_path, "tiny-nan", ["--inject-nan-at", "6"])
    token = tokens["operator"]
    with open(tmp_path / "ok.out", "w+") as ok_log, open(tmp_path / "nan.out", "w+") as nan_log:
        procs = [start_cli(cluster, token, "launch", str(good), "--wait", "--poll", "0.5", "--timeout", "200",
                           log=ok_log),
                 start_cli(cluster, token, "launch", str(bad), "--wait", "--poll", "0.5", "--timeout", "200",
                           log=nan_log)]
        try:
            codes = [proc.wait(timeout=240) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
        ok_out, nan_out = (tmp_path / "ok.out").read_text(), (tmp_path / "nan.out").read_text()

    assert codes[0] == 0, ok_out + history() + cluster.dump_logs()
    assert "launched job" in ok_out and " completed · " in ok_out and " running · " in ok_out, ok_out
    assert "step 16" in ok_out, ok_out

    assert codes[1] == 3, nan_out + history() + cluster.dump_logs()
    assert "paused and needs a human" in nan_out and "incident" in nan_out and "numerical" in nan_out, nan_out
    paused_job = int(nan_out.split("launched job ", 1)[1].split()[0])

    # The paused job's evidence, status and checkpoints, from the same CLI.
    logs = cli(cluster, token, "incidents", str(paused_job))  # `logs` is the training output now
    assert logs.returncode == 0 and "numerical" in logs.stdout, logs.stdout + logs.stderr
    status = cli(cluster, token, "status", str(paused_job))
    assert status.returncode == 0 and " paused · " in status.stdout, status.stdout + status.stderr
    ok_job = int(ok_out.split("launched job ", 1)[1].split()[0])
    wait_for(lambda: Checkpoint.objects.filter(job_id=ok_job, state="verified").exists(), timeout=60,
             what="a verified checkpoint of the completed job")
    listed = cli(cluster, token, "checkpoints", str(ok_job))
    assert listed.returncode == 0 and "verified" in listed.stdout, listed.stdout + listed.stderr
    # An operator may not approve (on-call only): a clear refusal and exit code 5, nothing changed.
    refused = cli(cluster, token, "approve", str(paused_job), "--reason", "try")
    assert refused.returncode == 5 and "403" in refused.stderr, refused.stderr
    cancelled = cli(cluster, token, "cancel", str(paused_job), "--reason", "end of test")
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr
