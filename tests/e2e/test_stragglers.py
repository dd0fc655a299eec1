"""A straggler end to end: a real 2-rank torchrun of the example job on CPU under a node agent, one
rank made slow (it busy-computes 50 ms more per step before its backward pass, from step 100 on),
checkpoints every 20 steps before and after. The control plane must name that rank and its node,
and only once it is slow: never for the checkpoints before."""

from __future__ import annotations

import pytest

from tests.e2e.cluster import api, wait_for
from tests.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
#: Two CPU ranks beside the whole control plane on a shared 2-core machine: their compute varies by
#: tens of per cent from window to window, so the test raises the bar from the default 2.5 % to 25 %
#: (the slow rank costs about 50 %).
NOISY_MACHINE = {"NIGHTWATCH_STRAGGLER_RATIO": "1.25"}

SLOW_FROM = 100


@pytest.mark.parametrize("cluster", [NOISY_MACHINE], indirect=True)
def test_a_slow_rank_is_named_with_its_node_and_not_during_checkpoints(cluster, tokens, tmp_path):
    from jobs.models import Incident, Job
    from nodes.models import Node

    cluster.start_agent("node-a", bootstrap_token=tokens["bootstrap"]())
    wait_for(lambda: Node.objects.filter(hostname="node-a", health="healthy").exists(), timeout=60,
             what="a healthy node")
    body = {"name": "straggler", "entrypoint": "examples/train.py", "nnodes": 1, "nproc_per_node": 2,
            "accelerator": "cpu", "rdzv_port": free_port(),
            "args": ["--steps", "220", "--ckpt-every", "20", "--dataset-size", "256", "--check-every", "5",
                     "--min-step-time", "0.1", "--slow-rank", "1", "--slow-ms", "50",
                     "--slow-from", str(SLOW_FROM)],
            "checkpoint_policy": {"dir": str(tmp_path / "checkpoints" / "ckpt")},
            "recovery_policy": {"backoff_seconds": 0}}
    status, job = api(cluster, tokens["operator"], "POST", "/api/v1/jobs", body)
    assert status == 201, job
    incident = wait_for(lambda: Incident.objects.filter(job_id=job["id"], kind="straggler").first(), timeout=120,
                        what="a straggler incident")
    detail = incident.evidence["detail"]
    assert (detail["rank"], detail["node"], detail["hostname"], detail["phase"]) == (1, 0, "node-a", "compute")
    assert detail["last_step"] > SLOW_FROM, "raised before the rank was slow (during the checkpoints)"
    assert detail["ratio"] > 1.25 and incident.decision == "alert"
    assert [n.hostname for n in incident.nodes.all()] in ([], ["node-a"])
    wait_for(lambda: Job.objects.get(pk=job["id"]).state == "completed", timeout=90, what="the job to complete")
    assert Incident.objects.filter(job_id=job["id"]).count() == 1  # raised once, and nothing else
