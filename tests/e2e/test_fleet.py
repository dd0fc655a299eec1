"""The fleet simulator against the real control plane, small: the data path and the sweeps end to end.

Sixteen simulated nodes (``bench._fleet_sim``, the same code ``bench.fleet`` runs at 1,024) register
with bootstrap tokens, heartbeat, send telemetry and run an 8-node job launched through the API; its
ranks report steps with the generation's job token. One node then dies: the heartbeat sweep must
mark it unreachable within the heartbeat timeout plus slack, and no request may have failed on the
server's side. Figures (latencies, rows per hour) are the benchmark's business, not this test's.
"""

from __future__ import annotations

import time

import pytest

from bench.fleet import Simulators, address
from tests.e2e.cluster import api, wait_for

pytestmark = pytest.mark.e2e

NODES = 16
HEARTBEAT_TIMEOUT_S = 3  # the cluster fixture: heartbeats every 1 s, 3 misses
SLACK_S = 3.0  # the sweep's period, the worker's latency and the event's commit, on a loaded machine


def test_sixteen_simulated_nodes_train_report_and_one_death_is_noticed(cluster, tokens, tmp_path):
    from jobs.models import Event, Job, StepMetric
    from nodes.models import Node

    fleet = [{"hostname": f"sim-{i:02d}", "bootstrap": tokens["bootstrap"](), "address": address(i)}
             for i in range(NODES)]
    sims = Simulators(tmp_path / "sim", [cluster.port], fleet, 1, templates={}, seed=1, checkpoint_every=0)
    try:
        wait_for(lambda: Node.objects.filter(health="healthy").count() == NODES, timeout=60,
                 what=f"{NODES} healthy nodes")
        body = {"name": "fleet-test", "entrypoint": "examples/train.py", "nnodes": 8, "nproc_per_node": 8,
                "accelerator": "gpu", "rdzv_port": 29400, "recovery_policy": {"backoff_seconds": 0}}
        status, job = api(cluster, tokens["operator"], "POST", "/api/v1/jobs", body)
        assert status == 201, job
        wait_for(lambda: (Job.objects.get(pk=job["id"]).last_step or 0) >= 3, timeout=60, what="step 3")
        assert StepMetric.objects.filter(job_id=job["id"], step__gte=3).exists()
        # The launches reached the agents through their long polls (``agents.agent.wake``), not an
        # interval later with a heartbeat: at least one woke its agent.
        assert wait_for(lambda: sims.total("wakeups"), timeout=10, what="a command wait's wake-up")

        # The benchmark's per-request cost bursts: each kind sent on top of the fleet, every one answered.
        for order, kind in enumerate(("heartbeat", "telemetry", "report")):
            sims.send({"kind": "calibrate", "id": order, "what": kind, "count": 12, "concurrency": 4})
            burst = wait_for(lambda o=order: (sims.status[0].get("calibration") or {}) if
                             (sims.status[0].get("calibration") or {}).get("id") == o else None,
                             timeout=30, what=f"the {kind} burst")
            assert (burst["what"], burst["answered"]) == (kind, 12), burst
        assert StepMetric.objects.filter(job_id=job["id"], step__gte=15).exists()  # the report burst's steps

        victim = Job.objects.get(pk=job["id"]).generations.get(number=1).nodes.order_by("hostname").last()
        sims.send({"id": 1, "kind": "node_death", "hostname": victim.hostname}, victim.hostname)
        died = wait_for(lambda: next((f["at"] for f in sims.landed() if f["id"] == 1), None), timeout=10,
                        what="the node's death")
        noticed = wait_for(lambda: Event.objects.filter(node=victim, kind="node.health", new_state="unreachable")
                           .first(), timeout=30, what=f"{victim.hostname} unreachable")
        assert noticed.created_at.timestamp() - died <= HEARTBEAT_TIMEOUT_S + SLACK_S
        assert Node.objects.filter(health="unreachable").count() == 1

        time.sleep(1.5)  # one more status line, with every answer so far in its book
        # 503 + Retry-After is admission control shedding load, which the simulator waits out; any
        # other 5xx, or no answer at all, is a failure.
        failed = {endpoint: {code: n for code, n in codes.items() if code == 0 or (code >= 500 and code != 503)}
                  for endpoint, codes in sims.book()["status"].items()}
        assert not any(failed.values()), failed
    finally:
        sims.close()
