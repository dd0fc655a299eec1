"""The machine-principal matrix of docs/api.md, walked cell by cell (issue 17, findings 2 and 3).

The expected answers are read from the table in docs/api.md ("Machine principals"), so the
documentation and the server cannot drift apart: a cell that differs fails here, and so does a row
or a column this test does not know how to call. Each cell runs on a fresh database (rotation and
registration consume their token).

The world: job 1 runs generation 2 on node A (its generation 1 ran on node A too, and ended);
node B is another registered node.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path

import pytest

from core.tokens import job_token_for
from jobs import state
from jobs.choices import JobState
from jobs.launching import end_generations
from jobs.models import Generation, Incident, Job

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
SECTION = "### Machine principals"


def _matrix() -> tuple[list[str], dict[str, dict[str, int]]]:
    """(principals, {request: {principal: status}}) from the table under ``SECTION``."""
    text = DOC.read_text()
    assert SECTION in text, f"docs/api.md has no {SECTION!r} section"
    rows = []
    for line in text.split(SECTION, 1)[1].splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break  # the end of the section's first table
    header, _rule, *body = rows
    principals = [cell.strip() for cell in header.strip("|").split("|")][1:]
    table = {}
    for row in body:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        request = re.search(r"`([^`]+)`", cells[0]).group(1)
        table[request] = {p: int(re.match(r"\d{3}", c).group(0)) for p, c in zip(principals, cells[1:], strict=True)}
    return principals, table


PRINCIPALS, TABLE = _matrix()


class World:
    def __init__(self, cast, api, tmp_path):
        from django.utils import timezone

        from nodes.models import NodeCommand

        self.cast, self.api = cast, api
        self.job, self.node_a, self.node_b = cast.job, cast.node1, cast.node2
        state.transition(self.job, JobState.INITIALIZING, actor="test")  # generation 1
        first = Generation.objects.create(job=self.job, number=1, world_size=2)
        first.nodes.add(self.node_a)
        finished = job_token_for(self.job, 1, self.node_a)
        for new_state in (JobState.QUIESCING, JobState.RECOVERING):
            state.transition(self.job, new_state, actor="test")
        end_generations(Generation.objects.filter(pk=first.pk), first.started_at)
        state.transition(self.job, JobState.INITIALIZING, actor="test", restart=True)  # generation 2
        Generation.objects.create(job=self.job, number=2, world_size=2).nodes.add(self.node_a)
        self.job.refresh_from_db()
        self.launch = NodeCommand.objects.create(
            node=self.node_a, kind="launch", job=self.job, generation=2, idempotency_key="launch-g2",
            payload={"script": "train.py"}, created_by="test", expires_at=timezone.now() + timedelta(hours=1))
        self.tokens = {
            "agent of node A": cast.tokens["agent"],
            "agent of node B": cast.tokens["agent2"],
            "job token of job 1 generation 2": job_token_for(self.job, 2, self.node_a),
            "job token of a finished generation": finished,
            "bootstrap token": cast.tokens["bootstrap"],
        }
        self.checkpoint_root = tmp_path

    def own_node(self, principal: str):
        return self.node_b if principal == "agent of node B" else self.node_a

    def call(self, request: str, principal: str):
        token = self.tokens[principal]
        client = self.api(token)
        job, node = self.job.pk, self.own_node(principal)
        now = time.time()
        if request.startswith("POST /agents/register"):
            body = {"bootstrap_token": token, "hostname": "gpu-new-01", "address": "10.0.0.9",
                    "agent_version": "0.1.0", "gpus": []}
            return self.api().post("/api/v1/agents/register", body, format="json")
        if request.startswith("POST /nodes/{A}/heartbeat"):
            a = self.node_a.pk
            return client.post(f"/api/v1/nodes/{a}/heartbeat", {"node_id": str(a), "seq": 1, "time": now},
                               format="json")
        if request.startswith("POST /nodes/{A}/telemetry"):
            return client.post(f"/api/v1/nodes/{self.node_a.pk}/telemetry", {"samples": []}, format="json")
        if request.startswith("POST /nodes/{own}/events"):
            exited = {"key": f"exit-{principal}", "kind": "exited", "time": now, "job": str(job), "generation": 2,
                      "detail": {"exit_code": 1, "ranks": [{"rank": 0, "local_rank": 0, "exit_code": 1}]}}
            return client.post(f"/api/v1/nodes/{node.pk}/events", {"events": [exited]}, format="json")
        if request.startswith("POST /nodes/{own}/logs"):
            lines = {"job": str(job), "generation": 2, "first_line": 0, "lines": ["[rank0]: step 1", "hello"]}
            return client.post(f"/api/v1/nodes/{node.pk}/logs", lines, format="json")
        if request.startswith("POST /nodes/{own}/commands/{launch}/ack"):
            ack = {"command_id": str(self.launch.pk), "idempotency_key": "launch-g2", "status": "done", "time": now,
                   "job": str(job), "generation": 2, "detail": "torchrun started"}
            return client.post(f"/api/v1/nodes/{node.pk}/commands/{self.launch.pk}/ack", ack, format="json")
        if request.startswith("POST /jobs/1/reports"):
            report = {"job": str(job), "generation": 2, "rank": 0, "step": 1, "loss": 2.5, "grad_norm": 1.0,
                      "world_size": 2, "data_cursor": 8, "samples": 4, "phases": {"compute": 0.1}, "time": now}
            return client.post(f"/api/v1/jobs/{job}/reports",
                               {"job": str(job), "generation": 2, "reports": [report], "events": []}, format="json")
        if request.startswith("GET /jobs/1/control"):
            return client.get(f"/api/v1/jobs/{job}/control", {"generation": 2, "rank": 0})
        if request.startswith("POST /jobs/1/checkpoints"):
            directory = self.checkpoint_root / f"job-{job}" / "step-10"
            directory.mkdir(parents=True, exist_ok=True)
            commit = {"job": str(job), "generation": 2, "step": 10, "path": str(directory), "loss": 2.0,
                      "config_hash": "abc", "data_cursor": 80, "world_size": 2, "size_bytes": 1000,
                      "blocking_s": 0.03, "total_s": 1.2, "manifest": {"step": 10}}
            return client.post(f"/api/v1/jobs/{job}/checkpoints", commit, format="json")
        if request.startswith("POST /tokens/rotate"):
            return client.post("/api/v1/tokens/rotate")
        raise AssertionError(f"docs/api.md names a request this test cannot make: {request!r}")


@pytest.fixture
def world(cast, api, tmp_path, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "CHECKPOINT_ROOT": str(tmp_path)}
    return World(cast, api, tmp_path)


def test_the_matrix_names_every_machine_principal_and_endpoint():
    assert PRINCIPALS == ["agent of node A", "agent of node B", "job token of job 1 generation 2",
                          "job token of a finished generation", "bootstrap token"]
    assert len(TABLE) == 10, sorted(TABLE)


@pytest.mark.django_db
@pytest.mark.parametrize("request_", sorted(TABLE))
@pytest.mark.parametrize("principal", PRINCIPALS)
def test_each_cell_of_the_matrix(world, request_, principal):
    expected = TABLE[request_][principal]
    response = world.call(request_, principal)
    assert response.status_code == expected, (
        f"{request_} as {principal}: docs/api.md says {expected}, the server answered {response.status_code}: "
        f"{response.content[:300]!r}")
    if expected in (401, 403, 404):
        assert response["Content-Type"] == "application/problem+json"


@pytest.mark.django_db
def test_a_refused_exit_acts_on_nothing(world):
    """Node B's forged exit of job 1: no incident, no stop confirmed, the job and its generation unchanged."""
    from nodes.models import AgentEventRecord

    before = Job.objects.values("state", "generation", "restart_count").get(pk=world.job.pk)
    assert world.call("POST /nodes/{own}/events", "agent of node B").status_code == 403
    assert Job.objects.values("state", "generation", "restart_count").get(pk=world.job.pk) == before
    assert not Incident.objects.filter(job=world.job).exists()
    assert not AgentEventRecord.objects.exists()
    assert Generation.objects.get(job=world.job, number=2).stopped_nodes == []


@pytest.mark.django_db
def test_a_job_token_speaks_only_for_its_own_job_and_generation(world, api):
    from jobs.models import Job as JobModel

    token = world.tokens["job token of job 1 generation 2"]
    other = JobModel.objects.create(name="other", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                                    created_by="test")
    client = api(token)
    assert client.get(f"/api/v1/jobs/{other.pk}/control", {"generation": 2}).status_code == 403
    assert client.get(f"/api/v1/jobs/{world.job.pk}/control", {"generation": 1}).status_code == 403
    # Nothing a person or an agent may do: reading, launching, the agent's own endpoints.
    assert client.get(f"/api/v1/jobs/{world.job.pk}").status_code == 403
    assert client.post(f"/api/v1/jobs/{world.job.pk}/cancel", {"reason": "x"}, format="json").status_code == 403


@pytest.mark.django_db
def test_an_older_generations_token_not_yet_revoked_is_fenced_off_as_stale(world, api):
    """Generation 2's token while generation 3 starts (before generation 2's end is recorded): 409."""
    state.transition(world.job, JobState.QUIESCING, actor="test")
    state.transition(world.job, JobState.RECOVERING, actor="test")
    state.transition(world.job, JobState.INITIALIZING, actor="test", restart=True)  # generation 3
    response = world.call("POST /jobs/1/reports", "job token of job 1 generation 2")
    assert response.status_code == 409, response.content
    control = world.call("GET /jobs/1/control", "job token of job 1 generation 2").json()
    assert control["stale"] is True


@pytest.mark.django_db
@pytest.mark.parametrize("ending", [JobState.CANCELLED, JobState.FAILED])
def test_an_ended_job_refuses_reports_and_tells_its_hooks_to_stop(world, ending):
    state.transition(world.job, ending, actor="test")
    response = world.call("POST /jobs/1/reports", "job token of job 1 generation 2")
    assert response.status_code == 409, response.content
    assert f"is {ending}" in response.json()["detail"]
    assert world.call("GET /jobs/1/control", "job token of job 1 generation 2").json()["stale"] is True


@pytest.mark.django_db
def test_job_tokens_are_revoked_when_the_generation_ends_and_expire_soon_after_the_job_ends(world):
    from django.utils import timezone

    from core.models import ApiToken
    from core.tokens import TERMINAL_JOB_TOKEN_GRACE

    token = ApiToken.objects.get(scope="job", job=world.job, generation=2)
    state.transition(world.job, JobState.CANCELLED, actor="test")
    token.refresh_from_db()
    assert token.revoked_at is None and token.expires_at is not None
    assert token.expires_at <= timezone.now() + TERMINAL_JOB_TOKEN_GRACE
    end_generations(Generation.objects.filter(job=world.job, number=2), token.expires_at)
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert world.call("GET /jobs/1/control", "job token of job 1 generation 2").status_code == 401


@pytest.mark.django_db
def test_a_redelivered_launch_carries_the_same_token_and_the_payload_stores_none(world):
    from nodes.models import NodeCommand
    from nodes.services import pending_commands_for

    NodeCommand.objects.filter(pk=world.launch.pk).delete()
    command = NodeCommand.objects.create(
        node=world.node_a, kind="launch", job=world.job, generation=2, idempotency_key="launch-g2b",
        payload={"script": "train.py", "nnodes": 1, "nproc_per_node": 2, "node_rank": 0,
                 "rdzv_endpoint": "10.0.0.1:29500", "rdzv_id": "nw-1-g2"},
        created_by="test", expires_at=world.launch.expires_at)
    first = [c for c in pending_commands_for(world.node_a) if c.id == str(command.pk)][0]
    again = [c for c in pending_commands_for(world.node_a) if c.id == str(command.pk)][0]
    assert first.payload["hooks_token"] == again.payload["hooks_token"] == world.tokens[
        "job token of job 1 generation 2"]
    command.refresh_from_db()
    assert "hooks_token" not in command.payload


@pytest.mark.django_db
def test_after_secret_key_rotation_a_redelivery_gets_a_fresh_working_token(world, settings, api):
    from core.models import ApiToken, hash_token

    before = world.tokens["job token of job 1 generation 2"]
    settings.SECRET_KEY = "rotated-" + "k" * 50
    after = job_token_for(world.job, 2, world.node_a)
    assert after != before
    assert ApiToken.objects.usable().filter(digest=hash_token(after)).exists()
    assert job_token_for(world.job, 2, world.node_a) == after
    for token in (before, after):  # the one a running generation may hold keeps working
        assert api(token).get(f"/api/v1/jobs/{world.job.pk}/control", {"generation": 2}).status_code == 200
