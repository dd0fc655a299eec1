"""The efficiency figures (jobs.efficiency) and the watch (alerts.efficiency) on PostgreSQL: MFU from
step reports (by hand), the slowdown alert, GPU utilisation, and cost that adds up to the goodput
badput breakdown."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from agents.protocol.hooks import ReportBatch, StepReport
from alerts.choices import AlertState
from alerts.efficiency import watch
from alerts.models import Alert
from jobs import efficiency, ingest, orchestrator, services
from jobs.choices import JobState
from jobs.goodput import goodput_of
from jobs.models import EfficiencyTarget, Job, PoolPrice, TrainingEvent

pytestmark = pytest.mark.django_db

PARAMETERS = 1_234_567
TOKENS_PER_RANK = 4 * 32  # batch 4 × sequence 32


@pytest.fixture
def job(cast, eager_celery, django_capture_on_commit_callbacks):
    job = Job.objects.create(name="lm", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             accelerator="cpu", created_by="test", recovery_policy={"max_restarts": 5,
                                                                                    "backoff_seconds": 0})
    with django_capture_on_commit_callbacks(execute=True):
        services.start_job(job, actor="test")
    job.refresh_from_db()
    model_event(job)
    return job


def model_event(job):
    TrainingEvent.objects.create(job=job, generation=job.generation, rank=0, step=0, kind="model",
                                 key=f"0:0:0:model:{job.generation}", message="model",
                                 detail={"parameters": PARAMETERS, "tokens_per_sample": 32},
                                 reported_at=timezone.now())


def report(job, steps, step_s: float) -> None:
    """Both ranks report ``steps``, each taking ``step_s`` by the hooks' phase timings."""
    job.refresh_from_db()
    ingest.record_reports(job, ReportBatch(job=str(job.pk), generation=job.generation, reports=[
        StepReport(job=str(job.pk), generation=job.generation, rank=rank, step=step, loss=2.0, grad_norm=1.0,
                   world_size=2, data_cursor=8 * step, samples=4, tokens=TOKENS_PER_RANK,
                   phases={"input": 0.01, "compute": step_s - 0.03, "optimizer": 0.02, "checkpoint": 0.0},
                   time=time.time()) for step in steps for rank in (0, 1)]), actor="test")


def test_mfu_matches_the_hand_computation_on_a_cpu_node(job, settings):
    report(job, range(1, 11), 0.25)
    figures = efficiency.snapshot(job)
    # By hand: 2 ranks × 128 tokens per 0.25 s step, 6 × parameters FLOPs per token, against
    # 2 processes × the nominal CPU peak.
    peak = 2 * settings.NIGHTWATCH["EFFICIENCY"]["CPU_PEAK_TFLOPS"] * 1e12
    expected = (2 * TOKENS_PER_RANK / 0.25) * 6 * PARAMETERS / peak
    assert figures["tokens_per_step"] == 2 * TOKENS_PER_RANK
    assert figures["step_s"] == pytest.approx(0.25)
    assert figures["flops_per_token"] == 6 * PARAMETERS
    assert figures["mfu"] == pytest.approx(expected)


def test_gpu_peak_comes_from_the_nvml_name_or_the_node_label(job, cast):
    from nodes.models import GPU

    Job.objects.filter(pk=job.pk).update(accelerator="gpu")
    job.refresh_from_db()
    GPU.objects.create(node=cast.node1, index=0, name="NVIDIA H100 80GB HBM3")
    report(job, range(1, 11), 0.5)
    assert efficiency.snapshot(job)["peak_tflops"] == 2 * 989.0
    cast.node1.labels = {"peak_tflops": 500}
    cast.node1.save()
    assert efficiency.snapshot(job)["peak_tflops"] == 2 * 500.0


def test_flops_per_token_can_be_overridden_per_job(job):
    report(job, range(1, 11), 0.25)
    EfficiencyTarget.objects.create(job=job, flops_per_token=1e9)
    assert efficiency.snapshot(job)["flops_per_token"] == 1e9


def test_a_slowdown_raises_the_mfu_alert_and_recovering_resolves_it(job, channels, receiver,
                                                                      django_capture_on_commit_callbacks):
    report(job, range(1, 11), 0.25)
    baseline = efficiency.snapshot(job)["mfu"]
    EfficiencyTarget.objects.create(job=job, expected_mfu=baseline)  # margin: the 20% default
    with django_capture_on_commit_callbacks(execute=True):
        watch(job)
    assert not Alert.objects.filter(job=job, rule="mfu_low").exists()

    report(job, range(11, 71), 0.5)  # twice as slow: MFU halves, more than 20% below
    with django_capture_on_commit_callbacks(execute=True):
        watch(job)
    alert = Alert.objects.get(job=job, rule="mfu_low")
    assert alert.severity == "info" and alert.state == AlertState.FIRING
    assert alert.evidence["mfu"] == pytest.approx(baseline / 2)
    assert [r.json["alert"]["rule"] for r in receiver.at("/hook")] == ["mfu_low"]

    report(job, range(71, 131), 0.25)
    with django_capture_on_commit_callbacks(execute=True):
        watch(job)
    alert.refresh_from_db()
    assert alert.state == AlertState.RESOLVED


def test_low_gpu_utilisation_while_running_alerts(job, cast, django_capture_on_commit_callbacks):
    from nodes.models import NodeGpuSample

    Job.objects.filter(pk=job.pk).update(accelerator="gpu")
    job.refresh_from_db()
    report(job, range(1, 6), 0.25)
    now = timezone.now()
    for seconds, pct in ((5, 20.0), (15, 30.0)):
        NodeGpuSample.objects.create(node=cast.node1, time=now - timedelta(seconds=seconds), gpus=1,
                                     utilization_pct=[pct])
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert efficiency.snapshot(job)["gpu_utilization_pct"] == pytest.approx(25.0)
    with django_capture_on_commit_callbacks(execute=True):
        watch(job)
    assert Alert.objects.get(job=job, rule="gpu_util_low").state == AlertState.FIRING


def test_peak_and_price_of_a_generation_of_mixed_nodes_in_queries_however_many_nodes(
        cast, django_assert_max_num_queries):
    """Nodes of two pools and two GPU models, one with a peak label: peak and hourly rate add up node
    by node, and 24 nodes cost the same queries as 3 (the nodes are grouped by kind in the database)."""
    from jobs.models import Generation
    from nodes.models import GPU, Node

    PoolPrice.objects.create(pool="spot", price_per_gpu_hour="1.5000")

    def generation_of(n: int, name: str):
        job = Job.objects.create(name=name, entrypoint="train.py", nnodes=n, nproc_per_node=8, accelerator="gpu",
                                 created_by="test", generation=1)
        nodes = []
        for i in range(n):
            kind = i % 3  # an H100 on spot, an A100 on spot, an H100 labelled 700 TFLOPS (default price)
            node = Node.objects.create(hostname=f"{name}-{i}", labels={"pool": "spot"} if kind < 2
                                       else {"peak_tflops": 700})
            for index in (1, 0):  # the lowest index names the node's GPU, whatever order they came in
                GPU.objects.create(node=node, index=index, name="NVIDIA A100-SXM4-80GB" if kind == 1 and index == 0
                                   else "NVIDIA H100 80GB HBM3")
            nodes.append(node)
        Generation.objects.create(job=job, number=1, world_size=8 * n).nodes.set(nodes)
        return job

    small, large = generation_of(3, "small"), generation_of(24, "large")
    default_price = float(efficiency.settings_()["DEFAULT_PRICE_PER_GPU_HOUR"])
    with django_assert_max_num_queries(99) as small_queries:
        figures = efficiency.snapshot(small)
    assert figures["peak_tflops"] == 8 * (989.0 + 312.0 + 700.0)
    assert figures["gpu_peak_known"] is True
    assert figures["cost"]["rate_per_hour"] == pytest.approx(8 * (1.5 + 1.5 + default_price))
    with django_assert_max_num_queries(len(small_queries.captured_queries)):
        figures = efficiency.snapshot(large)
    assert figures["peak_tflops"] == 8 * 8 * (989.0 + 312.0 + 700.0)
    assert figures["cost"]["rate_per_hour"] == pytest.approx(8 * 8 * (1.5 + 1.5 + default_price))


def test_cost_and_wasted_cost_add_up_to_the_badput_breakdown(job, cast, settings, time_machine,
                                                              django_capture_on_commit_callbacks):
    cast.node1.labels = {"pool": "a100-spot"}
    cast.node1.save()
    PoolPrice.objects.create(pool="a100-spot", price_per_gpu_hour="1.5000")
    time_machine.move_to(timezone.now() + timedelta(seconds=30), tick=False)
    report(job, range(1, 11), 0.25)
    time_machine.move_to(timezone.now() + timedelta(seconds=600), tick=False)
    with django_capture_on_commit_callbacks(execute=True):  # a crash, its recovery, and lost work
        orchestrator.handle_exit(job.pk, job.generation, "gpu-01", {"exit_code": 1, "signature": "signal"})
        orchestrator.advance_recovery(job.pk)
        orchestrator.advance_recovery(job.pk)
    time_machine.move_to(timezone.now() + timedelta(seconds=45), tick=False)
    report(job, range(1, 3), 0.25)
    time_machine.move_to(timezone.now() + timedelta(seconds=300), tick=False)

    figures = efficiency.snapshot(job)
    goodput = goodput_of(job)
    cost = figures["cost"]
    rate = 2 * 1.5  # two processes on a node of the 1.50/GPU-hour pool
    assert cost["rate_per_hour"] == rate
    assert cost["total"] == pytest.approx(goodput.wall_s * rate / 3600, rel=1e-3)
    for kind, seconds in goodput.badput_s.items():
        assert cost["wasted"][kind] == pytest.approx(seconds * rate / 3600, rel=1e-3, abs=1e-6)
    assert goodput.badput_s["restart"] >= 45 and goodput.badput_s["lost_work"] > 0
    assert cost["productive"] + cost["wasted_total"] == pytest.approx(cost["total"], rel=1e-6)
    # Downtime is the fault part of badput: detection, restart, time paused.
    assert figures["downtime_s"] == pytest.approx(sum(goodput.badput_s[k] for k in ("detection", "restart",
                                                                                     "paused")))
    assert figures["downtime_ratio"] == pytest.approx(figures["downtime_s"] / goodput.wall_s)
    # What a metrics exporter reads: the same numbers, flat.
    gauges = efficiency.gauges(job, figures)
    assert gauges["cost_total"] == cost["total"] and gauges["cost_wasted:restart"] == cost["wasted"]["restart"]
    assert all(isinstance(v, float) for v in gauges.values()) and gauges["peak_tflops"] == 0.2
    assert "mfu" not in gauges  # two steps of the new generation say nothing yet: unknown, left out


def test_downtime_above_the_ceiling_alerts(job, settings, time_machine, django_capture_on_commit_callbacks):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "EFFICIENCY": {**settings.NIGHTWATCH["EFFICIENCY"],
                                                                 "DOWNTIME_MIN_WALL_S": 60}}
    report(job, range(1, 5), 0.25)
    with django_capture_on_commit_callbacks(execute=True):
        orchestrator.handle_exit(job.pk, job.generation, "gpu-01", {"exit_code": 1, "signature": "signal"})
        orchestrator.advance_recovery(job.pk)
        orchestrator.advance_recovery(job.pk)
    time_machine.move_to(timezone.now() + timedelta(seconds=120), tick=False)  # still recovering: all of it is downtime
    job.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=True):
        watch(job)
    alert = Alert.objects.get(job=job, rule="downtime_high")
    assert alert.state == AlertState.FIRING and alert.evidence["downtime_ratio"] > 0.05
