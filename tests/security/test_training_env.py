"""Finding 2: user code held the node's agent token. The supervisor exported it to torchrun and every
rank as ``NIGHTWATCH_TOKEN`` (on Slurm, an ``agent`` token with a 30-day TTL), and a training script
used it to rotate the node's token, locking the real agent out.

Against the real server, with a real agent launching a real generation: the environment of
torchrun and of every rank (``/proc/<pid>/environ``) holds no agent token, only the generation's
job token. That token cannot rotate itself, read or act on jobs, speak for another job or
generation, or call an agent endpoint; the real agent keeps working; and once the generation ends
the token is refused (401).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.e2e.cluster import api, rank_pids, wait_for
from tests.security.training import long_training_spec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").split("=", 1) for entry in raw if b"=" in entry)


def parent(pid: int) -> int:
    # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after the ")".
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_ranks_hold_only_their_generations_job_token(cluster, tokens, tmp_path):
    from core.models import ApiToken, hash_token
    from jobs.models import Generation, Job
    from nodes.models import Node

    cluster.start_agent("node-a", bootstrap_token=tokens["bootstrap"]())
    node = wait_for(lambda: Node.objects.filter(hostname="node-a", health="healthy").first(), timeout=60,
                    what="node-a healthy")
    agent_token = json.loads((cluster.tmp / "agents" / "node-a" / "node-token.json").read_text())["node_token"]
    body = long_training_spec("user-code", tmp_path)
    status, job = api(cluster, tokens["operator"], "POST", "/api/v1/jobs", body)
    assert status == 201, job
    job_id = job["id"]
    wait_for(lambda: (Job.objects.get(pk=job_id).last_step or 0) >= 2, timeout=120,
             what="the generation's hooks reporting steps (with the job token)")
    generation = Job.objects.get(pk=job_id).generation
    ranks = wait_for(lambda: (found := rank_pids(job_id, generation, cluster.tmp)) and len(found) == 2 and found,
                     timeout=30, what="both ranks running")

    job_token = no_agent_token_in_the_environment(ranks, agent_token)
    stored = ApiToken.objects.get(digest=hash_token(job_token))
    assert (stored.scope, stored.job_id, stored.generation, stored.node_id) == ("job", job_id, generation, node.pk)

    the_job_token_reaches_only_its_generation(cluster, job_id, generation, job_token, node)
    # The real agent was not locked out: its token still works, and it still heartbeats.
    assert ApiToken.objects.usable().filter(digest=hash_token(agent_token)).exists()
    assert api(cluster, agent_token, "POST", f"/api/v1/nodes/{node.pk}/heartbeat",
               {"node_id": str(node.pk), "seq": 1, "time": time.time()})[0] == 200

    assert api(cluster, tokens["operator"], "POST", f"/api/v1/jobs/{job_id}/cancel", {"reason": "test over"})[0] == 200
    wait_for(lambda: Generation.objects.get(job_id=job_id, number=generation).ended_at, timeout=60,
             what="the generation to end (its stop confirmed)")
    status, answer = api(cluster, job_token, "GET", f"/api/v1/jobs/{job_id}/control?generation={generation}")
    assert status == 401, answer


def no_agent_token_in_the_environment(ranks: dict[int, int], agent_token: str) -> str:
    """The ranks' and their parent's (torchrun's) environment: no agent token anywhere; every rank
    has the same job token."""
    for pid in [*ranks.values(), parent(ranks[0])]:
        env = environ(pid)
        assert not any(agent_token in value for value in env.values()), f"the agent token is in pid {pid}'s environment"
    seen = {environ(pid).get("NIGHTWATCH_TOKEN") for pid in ranks.values()}
    assert len(seen) == 1 and None not in seen, seen
    return seen.pop()


def the_job_token_reaches_only_its_generation(cluster, job_id: int, generation: int, token: str, node) -> None:
    from jobs.models import Job

    other = Job.objects.create(name="someone-else", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                               created_by="test")
    # Its own generation's control poll works ...
    status, control = api(cluster, token, "GET", f"/api/v1/jobs/{job_id}/control?generation={generation}")
    assert status == 200 and control["stale"] is False, control
    refused = [
        ("POST", "/api/v1/tokens/rotate", None),
        ("GET", f"/api/v1/jobs/{other.pk}/control?generation={generation}", None),
        ("GET", f"/api/v1/jobs/{job_id}/control?generation={generation + 1}", None),
        ("POST", f"/api/v1/jobs/{other.pk}/reports", {"job": str(other.pk), "generation": generation,
                                                      "reports": [], "events": []}),
        ("POST", f"/api/v1/jobs/{job_id}/cancel", {"reason": "user code"}),
        ("GET", "/api/v1/jobs", None),
        ("POST", "/api/v1/jobs", {"name": "x"}),
        ("POST", f"/api/v1/nodes/{node.pk}/heartbeat", {"node_id": str(node.pk), "seq": 1, "time": time.time()}),
        ("POST", f"/api/v1/nodes/{node.pk}/events", {"events": []}),
    ]
    for method, path, body in refused:
        status, answer = api(cluster, token, method, path, body)
        assert status == 403, (method, path, status, answer)
    # ... and after all that it is still the same, usable token: nothing was rotated away.
    assert api(cluster, token, "GET", f"/api/v1/jobs/{job_id}/control?generation={generation}")[0] == 200
