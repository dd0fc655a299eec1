"""Finding 3: any agent token could crash any job. An ``exited`` event from node B naming job 1
(which runs only on node A) opened a crash incident and restarted job 1; repeated, it tripped the
breaker. Nothing checked that the reporting node belonged to that generation.

Against the real server, with two real agents and a job training on node A: node B's agent, with
its own token, reports job 1's generation as exited, five times, to its own node's URL and to node
A's. Every try is a 403 and nothing is acted on: the job keeps its state, generation and restart
count, no incident opens, node A's generation is not marked stopped, and the job keeps training.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.cluster import api, wait_for
from tests.security.training import long_training_spec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def agent_token(cluster, hostname: str) -> str:
    return json.loads((cluster.tmp / "agents" / hostname / "node-token.json").read_text())["node_token"]


def test_an_exit_from_another_nodes_agent_changes_no_job(cluster, tokens, tmp_path):
    from jobs.models import Generation, Incident, Job
    from nodes.models import AgentEventRecord, Node

    cluster.start_agent("node-a", bootstrap_token=tokens["bootstrap"]())
    cluster.start_agent("node-b", bootstrap_token=tokens["bootstrap"]())
    wait_for(lambda: Node.objects.filter(health="healthy").count() == 2, timeout=60, what="two healthy nodes")
    Node.objects.filter(hostname="node-b").update(is_spare=True)  # the job goes to node A
    body = long_training_spec("victim", tmp_path)
    status, job = api(cluster, tokens["operator"], "POST", "/api/v1/jobs", body)
    assert status == 201, job
    job_id = job["id"]
    wait_for(lambda: (Job.objects.get(pk=job_id).last_step or 0) >= 3, timeout=120, what="job 1 training on node A")
    victim = Job.objects.get(pk=job_id)
    generation = Generation.objects.get(job_id=job_id, number=victim.generation)
    assert list(generation.nodes.values_list("hostname", flat=True)) == ["node-a"]

    node_a, node_b = Node.objects.get(hostname="node-a"), Node.objects.get(hostname="node-b")
    forger = agent_token(cluster, "node-b")
    before = Job.objects.values("state", "generation", "restart_count").get(pk=job_id)
    records = AgentEventRecord.objects.filter(node=node_b).count()
    for attempt in range(5):
        exited = {"key": f"forged-{attempt}", "kind": "exited", "time": time.time(), "job": str(job_id),
                  "generation": victim.generation,
                  "detail": {"exit_code": 1, "ranks": [{"rank": 0, "local_rank": 0, "exit_code": 1}],
                             "signature": "oom", "error_line": "torch.OutOfMemoryError: forged"}}
        for node in (node_b, node_a):
            status, answer = api(cluster, forger, "POST", f"/api/v1/nodes/{node.pk}/events", {"events": [exited]})
            assert status == 403, answer
            assert answer["type"].endswith("/permission_denied")

    assert Job.objects.values("state", "generation", "restart_count").get(pk=job_id) == before
    assert not Incident.objects.filter(job_id=job_id).exists()
    assert AgentEventRecord.objects.filter(node=node_b).count() == records
    assert not AgentEventRecord.objects.filter(key__startswith="forged-").exists()
    generation.refresh_from_db()
    assert (generation.stopped_nodes, generation.ended_at) == ([], None)
    # The job was never disturbed: it keeps training in the same generation.
    step = Job.objects.get(pk=job_id).last_step
    wait_for(lambda: Job.objects.get(pk=job_id).last_step > step, timeout=30, what="the job to keep training")
    assert Job.objects.values("state", "generation", "restart_count").get(pk=job_id) == before
    assert api(cluster, tokens["operator"], "POST", f"/api/v1/jobs/{job_id}/cancel", {"reason": "done"})[0] == 200
