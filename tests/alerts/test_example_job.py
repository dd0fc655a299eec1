"""The example job for real: two 2-rank CPU torchrun runs of examples/train.py report through the
hooks (to the hooks tests' recording server), their batches are ingested by the real control
plane, and the MFU it computes matches a hand computation from the model's parameter count,
tokens per step and step time; the run slowed down with --min-step-time raises the MFU alert."""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest

from agents.protocol import parse
from agents.protocol.hooks import ReportBatch
from alerts.choices import AlertState
from alerts.efficiency import watch_running_jobs
from alerts.models import Alert
from examples.train import TinyLM
from jobs import efficiency, services
from jobs.ingest import record_reports
from jobs.models import EfficiencyTarget, Job
from tests.hooks.conftest import ControlPlaneStub, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]

STEPS = 10
BATCH, SEQ_LEN, WORLD = 4, 32, 2


def run_example(job, tmp_path, *extra: str) -> ControlPlaneStub:
    """One torchrun of the example against a recording server; no database access (it runs in a
    thread beside the other run)."""
    stub = ControlPlaneStub(generation=job.generation)
    stub.up()
    try:
        run = torchrun(["--steps", str(STEPS), "--ckpt-every", "0", "--batch-size", str(BATCH),
                        "--seq-len", str(SEQ_LEN), *extra],
                       nproc=WORLD, timeout=90,
                       env={"NIGHTWATCH_URL": stub.url, "NIGHTWATCH_JOB": str(job.pk),
                            "NIGHTWATCH_GENERATION": str(job.generation),
                            "NIGHTWATCH_SPOOL_DIR": str(tmp_path / f"spool-{job.pk}"),
                            "NIGHTWATCH_CKPT_DIR": str(tmp_path / f"ckpt-{job.pk}")})
    finally:
        stub.down()
    assert run.returncode == 0, run.output[-3000:]
    return stub


def ingest(job, stub: ControlPlaneStub) -> None:
    """What the real control plane does with what the hooks sent."""
    for body in stub.received:
        record_reports(job, parse(ReportBatch, body), actor="node:gpu-01")


def launched_job(name: str) -> Job:
    job = Job.objects.create(name=name, entrypoint="examples/train.py", nproc_per_node=WORLD, accelerator="cpu",
                             created_by="test")
    services.start_job(job, actor="test")
    job.refresh_from_db()
    return job


def test_the_example_jobs_mfu_matches_a_hand_computation_and_a_slowdown_alerts(
        cast, settings, tmp_path, eager_celery, channels, receiver, django_capture_on_commit_callbacks):
    normal, slowed = launched_job("normal"), launched_job("slowed")
    # Both runs at once (half the wall time); the slowed one pads every step to 0.2 s.
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_example, normal, tmp_path),
                pool.submit(run_example, slowed, tmp_path, "--min-step-time", "0.2")]
        stub, slowed_stub = (run.result() for run in runs)
    ingest(normal, stub)
    ingest(slowed, slowed_stub)

    # By hand: the model's parameters, the tokens each step trained, rank 0's step times.
    parameters = sum(p.numel() for p in TinyLM(vocab=64, dim=32, layers=2, heads=2, seq_len=SEQ_LEN,
                                               dropout=0.1).parameters())
    [model] = stub.events_of("model")
    assert model["detail"]["parameters"] == parameters
    reports = stub.reports
    assert {r["tokens"] for r in reports.values()} == {BATCH * SEQ_LEN}
    step_s = statistics.median(sum(r["phases"].values()) for (g, rank, s), r in reports.items() if rank == 0)
    peak = WORLD * settings.NIGHTWATCH["EFFICIENCY"]["CPU_PEAK_TFLOPS"] * 1e12
    by_hand = (WORLD * BATCH * SEQ_LEN / step_s) * 6 * parameters / peak

    figures = efficiency.snapshot(normal)
    assert figures["parameters"] == parameters and figures["tokens_per_step"] == WORLD * BATCH * SEQ_LEN
    assert figures["mfu"] == pytest.approx(by_hand, rel=1e-9)

    # The same model, slowed down: its expected MFU is what the normal run achieved.
    EfficiencyTarget.objects.create(job=slowed, expected_mfu=figures["mfu"])
    assert efficiency.snapshot(slowed)["mfu"] < 0.8 * figures["mfu"]
    with django_capture_on_commit_callbacks(execute=True):
        watch_running_jobs()
    alert = Alert.objects.get(job=slowed, rule="mfu_low")
    assert alert.state == AlertState.FIRING
    assert not Alert.objects.filter(job=normal, rule="mfu_low").exists()
    assert any(r.json["alert"]["rule"] == "mfu_low" for r in receiver.at("/hook"))
