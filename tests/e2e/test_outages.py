"""The control plane goes away and comes back: nothing the hooks or the agent sent is lost or doubled."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.cluster import ROOT, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_hooks_train_through_an_outage_and_deliver_every_report_exactly_once(cluster_down, tmp_path):
    """Issue 3's outage: the control plane is down for the first half of a run."""
    from core.models import ApiToken
    from jobs import state
    from jobs.models import Generation, Job, NodeWindow, StepMetric
    from nodes.models import Node

    cluster = cluster_down
    node = Node.objects.create(hostname="trainer", address="127.0.0.1", health="healthy")
    _, token = ApiToken.issue(name="trainer", scope="agent", node=node)
    job = Job.objects.create(name="outage", entrypoint="examples/train.py", nproc_per_node=2, accelerator="cpu",
                             created_by="test")
    state.transition(job, "initializing", actor="test")
    Generation.objects.create(job=job, number=1, world_size=2).nodes.add(node)

    steps = 60
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NIGHTWATCH")},
           "NIGHTWATCH_URL": cluster.url, "NIGHTWATCH_TOKEN": token, "NIGHTWATCH_JOB": str(job.pk),
           "NIGHTWATCH_GENERATION": "1", "NIGHTWATCH_SPOOL_DIR": str(tmp_path / "spool"),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    samples = tmp_path / "samples"
    # Where the control plane expects the job's checkpoints (it refuses commits anywhere else).
    checkpoints = Path(cluster.env["NIGHTWATCH_CHECKPOINT_ROOT"]) / f"job-{job.pk}"
    started = time.monotonic()
    run = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", "examples/train.py",
         "--steps", str(steps), "--ckpt-every", "10", "--min-step-time", "0.15", "--ckpt-dir", str(checkpoints),
         "--log-samples", str(samples)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def trained() -> int:
            log = samples / "rank0.jsonl"
            return len(log.read_text().splitlines()) if log.exists() else 0

        wait_for(lambda: trained() >= steps // 2, timeout=90, what="half of the run, trained with nobody listening")
        assert not StepMetric.objects.filter(job=job).exists()
        cluster.start_web()
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, 9)
    assert run.returncode == 0, output.decode(errors="replace")[-3000:]
    assert time.monotonic() - started < 90

    # Rank 0 speaks for the job every step; both ranks' timings arrive in its node windows, one per
    # exchange (every 10 steps), each covering the steps since the previous one.
    expected = {(0, step) for step in range(1, steps + 1)}
    wait_for(lambda: StepMetric.objects.filter(job=job).count() >= len(expected), timeout=30,
             what="every spooled report to arrive")
    got = list(StepMetric.objects.filter(job=job).values_list("rank", "step"))
    assert len(got) == len(got and set(got)) and set(got) == expected  # each exactly once, none missing
    windows = list(NodeWindow.objects.filter(job=job).values_list("first_step", "last_step", "ranks"))
    assert sorted(windows) == [(max(1, s - 10), s - 1, 2) for s in range(10, steps + 1, 10)]
    assert job.checkpoints.count() == steps // 10
    assert Job.objects.get(pk=job.pk).last_step == steps


def test_agent_loses_no_telemetry_and_no_event_while_the_control_plane_is_down(cluster, tokens):
    """Issue 4's outage: the control plane stops for 30 s while the agent keeps sampling."""
    from nodes.models import AgentEventRecord, Node, NodeGpuSample

    outage_s = 30
    # Xid 13 (a graphics engine exception) is not critical: the node stays healthy, the event must arrive.
    scenario = {"gpus": 2, "events": [{"at": "15s", "gpu": 1, "xid": 13}]}
    cluster.start_agent("node-a", bootstrap_token=tokens["bootstrap"](), scenario=scenario)
    node = wait_for(lambda: Node.objects.filter(hostname="node-a", health="healthy").first(), timeout=60,
                    what="node-a to register")
    wait_for(lambda: NodeGpuSample.objects.filter(node=node).count() >= 2, timeout=30, what="telemetry to flow")
    cluster.procs["web"].stop()
    down_at = time.time()
    time.sleep(outage_s)  # the outage itself is the condition under test, not a wait for one
    cluster.start_web()
    up_at = time.time()
    wait_for(lambda: NodeGpuSample.objects.filter(node=node, time__gte=_utc(up_at)).count() >= 2, timeout=60,
             what="telemetry after the outage")

    def largest_hole(gpu: int) -> float:
        times = sorted(row.time.timestamp() for row in NodeGpuSample.objects.filter(node=node)
                       if row.gpus >> gpu & 1)
        assert times[0] < down_at and times[-1] > up_at
        return max(b - a for a, b in zip(times, times[1:], strict=False))

    # The spool replays in order, oldest first: wait until the outage is filled in, sample by sample.
    wait_for(lambda: largest_hole(0) < 3 and largest_hole(1) < 3, timeout=90,
             what="the spooled telemetry of the outage to be replayed without a hole")
    assert Node.objects.get(pk=node.pk).telemetry_dropped == 0
    [xid] = wait_for(lambda: list(AgentEventRecord.objects.filter(node=node, kind="xid")), timeout=30,
                     what="the Xid raised during the outage")
    assert down_at < xid.time.timestamp() < up_at, "the event happened while nobody was listening"


def _utc(epoch: float):
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch, tz=UTC)


@pytest.fixture
def cluster_down(transactional_db, tmp_path):
    """A cluster whose web server is not started yet (the test starts it)."""
    from django.db import connection

    from tests.e2e.cluster import Cluster
    from tests.e2e.conftest import REDIS_DB

    c = Cluster(tmp_path, database_name=connection.settings_dict["NAME"], redis_db=REDIS_DB)
    try:
        yield c
    finally:
        c.close()
