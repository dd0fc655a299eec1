"""The ``nightwatch`` commands against a live control plane (Django's live server thread on the test
database): what they print, what they change, and their exit codes."""

from __future__ import annotations

import pytest

from agents.cli.__main__ import EXIT_ERROR, EXIT_OK, EXIT_USAGE, main

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def run(live_server, world, capsys, monkeypatch):
    monkeypatch.delenv("NIGHTWATCH_TOKEN", raising=False)
    for name in ("GITHUB_RUN_ID", "CI_PIPELINE_ID", "BUILD_ID", "BUILDKITE_BUILD_ID", "NIGHTWATCH_RUN_ID"):
        monkeypatch.delenv(name, raising=False)

    def invoke(caller: str | None, *args: str):
        token = ["--token", world.cast.tokens[caller]] if caller else []
        code = main(["--url", live_server.url, *token, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def test_reading_commands(run, world):
    job = world.cast.job.pk
    code, out, _ = run("viewer", "status")
    assert code == EXIT_OK and "llama-tiny" in out and "stuck" in out and out.startswith("ID")
    code, out, _ = run("viewer", "status", str(world.paused_job.pk))
    assert code == EXIT_OK and " paused · " in out and "circuit breaker open" in out
    code, out, _ = run("viewer", "incidents", str(job))
    assert code == EXIT_OK and "crash" in out and "  | Killed" in out and "gpu-01" in out
    code, out, _ = run("viewer", "checkpoints", str(job))
    assert code == EXIT_OK and "verified" in out and str(world.checkpoint.pk) in out
    code, out, _ = run("viewer", "status", str(job), "--json")
    assert code == EXIT_OK and '"recent_incidents"' in out


def test_drain_and_undrain_by_hostname_are_audited(run, world):
    from jobs.models import Event

    code, out, _ = run("operator", "drain", "gpu-01", "--reason", "fan noise")
    assert code == EXIT_OK and "gpu-01: drain" in out
    world.cast.node1.refresh_from_db()
    assert world.cast.node1.schedulability in ("draining", "drained")
    code, out, _ = run("operator", "undrain", str(world.cast.node1.pk), "--reason", "fan replaced")
    assert code == EXIT_OK and "gpu-01: active" in out
    assert Event.objects.filter(node=world.cast.node1, reason="fan noise").exists()
    code, _, err = run("viewer", "drain", "gpu-01", "--reason", "no")
    assert code == EXIT_ERROR and "403" in err and "'drain' capability" in err


def test_refusals_name_the_field_and_the_line(run, world, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("name: tiny\nentrypoint: examples/train.py\nrecovery_policy:\n  max_restarts: 5000\n")
    code, _, err = run("ci", "launch", str(spec))
    assert code == EXIT_USAGE
    assert f"{spec}:4: recovery_policy.max_restarts: Ensure this value is less than or equal to 1000." in err
    code, _, err = run("ci", "rollback", str(world.paused_job.pk), "--to", str(world.checkpoint.pk),
                       "--reason", "r", "--skip-data", "10:20")
    assert code == EXIT_ERROR and "403" in err  # a CI token launches and reads; it does not roll back
    code, _, err = run("operator", "rollback", str(world.paused_job.pk), "--to", str(world.checkpoint.pk),
                       "--reason", "r")
    assert code == EXIT_ERROR and f"has no checkpoint {world.checkpoint.pk}" in err
    code, _, err = run("operator", "checkpoint", str(world.paused_job.pk), "--reason", "r")
    assert code == EXIT_ERROR and "only a running job can checkpoint now" in err
    with pytest.raises(SystemExit) as usage:
        run("operator", "rollback", "1", "--to", "2", "--reason", "r", "--skip-data", "20:10")
    assert usage.value.code == EXIT_USAGE


def test_launch_once_per_ci_run(run, world, tmp_path, monkeypatch):
    from jobs.models import Job

    spec = tmp_path / "job.yaml"
    spec.write_text("name: from-ci\nentrypoint: examples/train.py\nargs: [--steps, 4]\n")
    monkeypatch.setenv("GITHUB_RUN_ID", "981")
    first = run("ci", "launch", str(spec))
    again = run("ci", "launch", str(spec))
    assert first[0] == again[0] == EXIT_OK and "launched job" in first[1]
    assert first[1] == again[1]
    assert Job.objects.filter(name="from-ci").count() == 1


def test_credentials(run, monkeypatch, live_server):
    code, _, err = run(None, "status")
    assert code == EXIT_USAGE and "NIGHTWATCH_TOKEN" in err
    monkeypatch.setenv("NIGHTWATCH_TOKEN", "nw_wrong-token-value")
    code, _, err = run(None, "status")
    assert code == EXIT_ERROR and "401" in err and "nw_wrong" not in err


def test_waiting_gives_up_at_the_timeout(run, tmp_path):
    """No agent runs here, so the job stays pending: ``--timeout`` ends the wait with exit code 6."""
    from agents.cli.__main__ import EXIT_TIMEOUT

    spec = tmp_path / "job.yaml"
    spec.write_text("name: never-placed\nentrypoint: examples/train.py\n")
    code, out, err = run("ci", "launch", str(spec), "--wait", "--timeout", "0.5", "--poll", "0.2")
    assert code == EXIT_TIMEOUT, out + err
    assert " pending · generation 0 · step - " in out and "still pending after 0.5 s" in err


def test_undrain_of_a_lemon_warns_and_clear_lemon_is_separate(run, world):
    from jobs.models import Event
    from nodes.models import Node

    Node.objects.filter(pk=world.cast.node1.pk).update(lemon_count=4, schedulability="drained")
    code, out, _ = run("operator", "undrain", "gpu-01", "--reason", "rebooted")
    assert code == EXIT_OK and "gpu-01: active" in out and "warning: gpu-01 is a lemon (blamed in 4 incidents" in out
    code, out, _ = run("operator", "clear-lemon", "gpu-01", "--reason", "GPU swapped")
    assert code == EXIT_OK and "lemon count 4 cleared" in out and "warning" not in out
    assert Event.objects.filter(kind="node.lemon_cleared", node=world.cast.node1, reason="GPU swapped").exists()


def test_status_shows_each_incidents_generation(run, world):
    code, out, _ = run("viewer", "status", str(world.cast.job.pk))
    assert code == EXIT_OK and f"incident {world.incident.pk} gen 1: crash" in out


def test_a_spec_the_fleet_cannot_hold_is_refused_with_its_line_and_a_pending_job_says_why(run, world, tmp_path):
    from jobs.models import Job

    spec = tmp_path / "huge.yaml"
    spec.write_text("name: huge\nentrypoint: examples/train.py\nnnodes: 4096\n")
    code, _, err = run("ci", "launch", str(spec))
    assert code == EXIT_USAGE and "huge.yaml:3: nnodes: 4096 nodes needed, but 2 node(s) are registered" in err
    spec.write_text("name: huge\nentrypoint: examples/train.py\nnnodes: 4096\nqueue: true\n")
    code, out, _ = run("ci", "launch", str(spec))
    assert code == EXIT_OK
    job = Job.objects.get(name="huge")
    code, out, _ = run("viewer", "status", str(job.pk))
    assert code == EXIT_OK and "waiting: not enough healthy nodes: have " in out and "need 4096" in out


def test_nodes_shows_health_drain_state_gpus_and_the_job(run, world):
    from nodes.models import GPU, Node

    Node.objects.filter(pk=world.cast.node1.pk).update(
        running=[{"job": str(world.cast.job.pk), "generation": 1, "started_at": 0.0, "pids": [10]}])
    Node.objects.filter(pk=world.cast.node2.pk).update(schedulability="drained", drain_reason="fan noise",
                                                        health="unhealthy")
    GPU.objects.create(node=world.cast.node1, index=0, uuid="GPU-a", name="NVIDIA H100", health="healthy")
    GPU.objects.create(node=world.cast.node1, index=1, uuid="GPU-b", name="NVIDIA H100", health="unhealthy")
    code, out, _ = run("viewer", "nodes")
    assert code == EXIT_OK, out
    lines = {line.split()[1]: line for line in out.splitlines()[1:]}
    assert out.startswith("ID") and set(lines) == {"gpu-01", "gpu-02"}
    assert "healthy" in lines["gpu-01"] and "1/2 NVIDIA H100" in lines["gpu-01"]
    assert f"job {world.cast.job.pk} gen 1" in lines["gpu-01"]
    assert "unhealthy" in lines["gpu-02"] and "drained (spare)" in lines["gpu-02"] and "fan noise" in lines["gpu-02"]
    code, out, _ = run("viewer", "nodes", "--health", "unhealthy")
    assert code == EXIT_OK and "gpu-02" in out and "gpu-01" not in out


def test_output_into_a_closed_pipe_ends_quietly(world, live_server):
    """``nightwatch status | head -1``: the reader leaves after one line; no BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    from jobs.models import Job

    # Far more than a pipe's buffer (64 KiB) holds, so that writing really fails once the reader left.
    Job.objects.bulk_create([Job(name=f"filler-{n}", entrypoint="examples/train.py", created_by="test")
                             for n in range(450)])
    env = {**os.environ, "NIGHTWATCH_TOKEN": world.cast.tokens["viewer"], "NIGHTWATCH_URL": live_server.url}
    cli = subprocess.Popen([sys.executable, "-m", "agents.cli", "status", "--json", "--limit", "500"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert cli.stdout is not None and cli.stderr is not None
    first = cli.stdout.readline()
    cli.stdout.close()  # what `head -1` does after its line
    err = cli.stderr.read().decode()
    code = cli.wait(timeout=60)
    assert first.startswith(b"[")
    assert "Traceback" not in err and "BrokenPipeError" not in err and err == "", err
    assert code == EXIT_OK


def test_logs_shows_the_training_output_by_generation_and_rank_and_resize_asks_for_a_new_size(run, world):
    from jobs.models import Event, Job, LogLine, LogStream

    job = world.cast.job
    stream = LogStream.objects.create(job=job, generation=1, hostname="gpu-01", next_line=3)
    for n, text in enumerate(["step 1 loss 2.5", "[rank1]: RuntimeError: boom", "step 2 loss 2.4"]):
        LogLine.objects.create(job=job, generation=1, stream=stream, line=n, text=text,
                               rank=1 if text.startswith("[rank1]") else None)
    code, out, _ = run("viewer", "logs", str(job.pk))
    assert code == EXIT_OK
    assert out.splitlines() == ["=== generation 1 on gpu-01 ===", "step 1 loss 2.5", "[rank1]: RuntimeError: boom",
                                "step 2 loss 2.4"]
    code, out, _ = run("viewer", "logs", str(job.pk), "--rank", "1", "--generation", "1")
    assert code == EXIT_OK and out.splitlines()[1:] == ["[rank1]: RuntimeError: boom"]
    code, out, err = run("viewer", "logs", str(job.pk), "--generation", "2")
    assert code == EXIT_OK and out == "" and "no training output yet" in err
    Job.objects.filter(pk=job.pk).update(state="completed")
    code, out, _ = run("viewer", "logs", str(job.pk), "--follow", "--tail", "1", "--poll", "0.05")
    assert code == EXIT_OK and out.splitlines() == ["=== generation 1 on gpu-01 ===", "step 2 loss 2.4"]

    paused = world.paused_job
    code, _, err = run("viewer", "resize", str(paused.pk), "--nnodes", "2")
    assert code == EXIT_ERROR and "403" in err
    code, _, err = run("operator", "resize", str(paused.pk), "--nproc-per-node", "0")
    assert code == EXIT_ERROR and "nproc_per_node" in err and "greater than or equal to 1" in err
    code, out, _ = run("operator", "resize", str(paused.pk), "--nnodes", "2", "--reason", "more nodes")
    assert code == EXIT_OK and "resize to 2 node(s) × 1 process(es); paused: the next resume" in out
    assert Job.objects.get(pk=paused.pk).resize_to == {"nnodes": 2, "nproc_per_node": 1}
    assert Event.objects.filter(job=paused, kind="job.resize", reason__contains="more nodes").exists()
