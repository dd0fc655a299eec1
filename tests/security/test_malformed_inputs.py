"""Finding 10: malformed inputs answered 500 (NUL characters, NaN/Infinity and huge times, integers
beyond int64, deeply nested JSON, non-ASCII digits in numbers and query parameters, two dashboard
actions).

Against the real server (daphne, PostgreSQL, Redis): every malformed input that a probe of every
body field and query parameter found answering 500 — and its siblings — is sent by the principal
that can reach it (the node's agent token, the generation's job token, a viewer token, anyone for
registration, a signed-in operator on the dashboard). Each must answer a 4xx: problem-details JSON
on the API and the dashboard's actions, an HTML page for dashboard pages. One cluster for all of
them; the failures are collected so that one run shows every input that still fails.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
import requests

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DEEP_ARRAY = "[" * 5000 + "]" * 5000
DEEP_OBJECT = '{"a":' * 5000 + "1" + "}" * 5000
_HOLE = '"@@hole@@"'


@dataclass
class Case:
    name: str
    method: str
    path: str
    principal: str  # "agent", "job", "viewer", "operator" (token), "anonymous", "session" (dashboard)
    body: str | dict | None = None  # raw JSON text, or a form for the dashboard
    status: int = 400
    html: bool = False  # a dashboard page: an HTML answer, not problem details


def with_raw(body: dict, path: tuple, raw: str) -> str:
    """``body`` as JSON text with the value at ``path`` replaced by the raw JSON text ``raw``
    (``NaN``, ``1e400``, a 5,000-deep array: what ``json.dumps`` will not write)."""
    copy = json.loads(json.dumps(body))
    where = copy
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = json.loads(_HOLE)
    text = json.dumps(copy)
    assert text.count(_HOLE) == 1, text
    return text.replace(_HOLE, raw)


@dataclass
class Fleet:
    node: int
    job: int
    checkpoint_dir: str


@pytest.fixture
def fleet(transactional_db, tmp_path):
    """A node whose agent runs generation 1 of a job, and the tokens of everyone who calls."""
    from django.contrib.auth.models import Group, User

    from core.models import ApiToken
    from jobs.models import Generation, Job
    from nodes.models import Node

    node = Node.objects.create(hostname="gpu-01", address="127.0.0.1", health="healthy")
    job = Job.objects.create(name="tiny", entrypoint="train.py", nnodes=1, nproc_per_node=1, created_by="test",
                             state="running", generation=1)
    generation = Generation.objects.create(job=job, number=1, world_size=1, state="running")
    generation.nodes.add(node)
    viewer = User.objects.create_user("vera")
    viewer.groups.add(Group.objects.get(name="viewer"))
    operator = User.objects.create_user("otto", password="otto-password-1")
    operator.groups.add(Group.objects.get(name="operator"))
    tokens = {
        "agent": ApiToken.issue(name="agent", scope="agent", node=node)[1],
        "job": ApiToken.issue(name="job", scope="job", job=job, generation=1)[1],
        "viewer": ApiToken.issue(name="viewer", scope="viewer", user=viewer)[1],
        "bootstrap": ApiToken.issue(name="boot", scope="bootstrap", single_use=True)[1],
    }
    return Fleet(node.pk, job.pk, str(tmp_path / "ckpt")), tokens


def well_formed(node: int, job: int) -> list[Case]:
    """The same messages, well formed: accepted, so that a 400 below is the malformed value's doing."""
    now = time.time()
    report = {"job": str(job), "generation": 1, "rank": 0, "step": 1, "loss": "nan", "grad_norm": 1.0,
              "world_size": 1, "data_cursor": 1, "samples": 1, "time": now}
    return [
        Case("heartbeat", "POST", f"/api/v1/nodes/{node}/heartbeat", "agent",
             json.dumps({"node_id": str(node), "seq": 1, "time": now}), status=200),
        Case("telemetry", "POST", f"/api/v1/nodes/{node}/telemetry", "agent",
             json.dumps({"samples": [{"node": str(node), "gpu": 0, "time": now, "temperature_c": 50.0}]}), status=202),
        Case("reports", "POST", f"/api/v1/jobs/{job}/reports", "job",
             json.dumps({"job": str(job), "generation": 1, "reports": [report]}), status=202),
        Case("control", "GET", f"/api/v1/jobs/{job}/control?generation=1", "job", status=200),
    ]


def agent_cases(node: int, job: int, bootstrap: str) -> list[Case]:
    now = time.time()
    heartbeat = {"node_id": str(node), "seq": 1, "time": now,
                 "running": [{"job": str(job), "generation": 1, "pids": [1], "started_at": now}]}
    sample = {"node": str(node), "gpu": 0, "time": now, "temperature_c": 50.0}
    event = {"key": "k1", "kind": "exited", "time": now, "job": str(job), "generation": 1,
             "detail": {"exit_code": 1, "log_tail": ["x"]}}
    ack = {"command_id": "1", "idempotency_key": "k", "status": "done", "time": now, "detail": "d"}
    register = {"bootstrap_token": bootstrap, "hostname": "gpu-09", "address": "10.0.0.9", "agent_version": "1"}
    beat, telemetry = f"/api/v1/nodes/{node}/heartbeat", f"/api/v1/nodes/{node}/telemetry"
    events, acks = f"/api/v1/nodes/{node}/events", f"/api/v1/nodes/{node}/commands/1/ack"
    return [
        Case("heartbeat time NaN", "POST", beat, "agent", with_raw(heartbeat, ("time",), "NaN")),
        Case("heartbeat time Infinity", "POST", beat, "agent", with_raw(heartbeat, ("time",), "Infinity")),
        Case("heartbeat time -Infinity", "POST", beat, "agent", with_raw(heartbeat, ("time",), "-Infinity")),
        Case("heartbeat time 1e400", "POST", beat, "agent", with_raw(heartbeat, ("time",), "1e400")),
        Case("heartbeat time 1e300", "POST", beat, "agent", with_raw(heartbeat, ("time",), "1e300")),
        Case("heartbeat time -1e300", "POST", beat, "agent", with_raw(heartbeat, ("time",), "-1e300")),
        Case("heartbeat seq 2**63", "POST", beat, "agent", with_raw(heartbeat, ("seq",), str(2**63))),
        Case("heartbeat seq -2**63-1", "POST", beat, "agent", with_raw(heartbeat, ("seq",), str(-2**63 - 1))),
        Case("heartbeat node_id NUL", "POST", beat, "agent", with_raw(heartbeat, ("node_id",), '"1\\u0000"')),
        Case("heartbeat pid 2**63", "POST", beat, "agent", with_raw(heartbeat, ("running", 0, "pids", 0), str(2**63))),
        Case("heartbeat started_at NaN string", "POST", beat, "agent",
             with_raw(heartbeat, ("running", 0, "started_at"), '"nan"')),
        Case("heartbeat 5,000-deep array", "POST", beat, "agent", DEEP_ARRAY),
        Case("heartbeat 5,000-deep object", "POST", beat, "agent", DEEP_OBJECT),
        Case("heartbeat seq 5,000 deep", "POST", beat, "agent", with_raw(heartbeat, ("seq",), DEEP_ARRAY)),
        Case("telemetry time 1e400", "POST", telemetry, "agent",
             with_raw({"samples": [sample]}, ("samples", 0, "time"), "1e400")),
        Case("telemetry temperature NaN", "POST", telemetry, "agent",
             with_raw({"samples": [sample]}, ("samples", 0, "temperature_c"), "NaN")),
        Case("telemetry gpu '²'", "POST", telemetry, "agent",
             with_raw({"samples": [sample]}, ("samples", 0, "gpu"), '"²"')),
        Case("telemetry 5,000-deep samples", "POST", telemetry, "agent",
             with_raw({"samples": [sample]}, ("samples",), DEEP_ARRAY)),
        Case("event key NUL", "POST", events, "agent",
             with_raw({"events": [event]}, ("events", 0, "key"), '"a\\u0000b"')),
        Case("event exit code 2**63", "POST", events, "agent",
             with_raw({"events": [event]}, ("events", 0, "detail", "exit_code"), str(2**63))),
        Case("event log line NUL", "POST", events, "agent",
             with_raw({"events": [event]}, ("events", 0, "detail", "log_tail", 0), '"a\\u0000b"')),
        Case("event detail 5,000 deep", "POST", events, "agent",
             with_raw({"events": [event]}, ("events", 0, "detail"), DEEP_OBJECT)),
        Case("ack time 1e300", "POST", acks, "agent", with_raw(ack, ("time",), "1e300")),
        Case("ack detail NUL", "POST", acks, "agent", with_raw(ack, ("detail",), '"a\\u0000b"')),
        Case("ack 5,000-deep body", "POST", acks, "agent", DEEP_ARRAY),
        Case("register hostname NUL", "POST", "/api/v1/agents/register", "anonymous",
             with_raw(register, ("hostname",), '"gpu\\u000009"')),
        Case("register probe port 2**63", "POST", "/api/v1/agents/register", "anonymous",
             with_raw(register, ("probe_port",), str(2**63))),
        Case("register 5,000-deep body", "POST", "/api/v1/agents/register", "anonymous", DEEP_OBJECT),
    ]


def hooks_cases(job: int, checkpoint_dir: str) -> list[Case]:
    now = time.time()
    report = {"job": str(job), "generation": 1, "rank": 0, "step": 1, "loss": 1.0, "grad_norm": 1.0,
              "world_size": 1, "data_cursor": 1, "samples": 1, "time": now}
    event = {"job": str(job), "generation": 1, "rank": 0, "step": 1, "kind": "nan", "key": "e", "message": "m",
             "detail": {"loss": "nan"}, "time": now}
    batch = {"job": str(job), "generation": 1, "reports": [report], "events": [event]}
    commit = {"job": str(job), "generation": 1, "step": 5, "path": checkpoint_dir, "loss": 1.0, "config_hash": "h",
              "data_cursor": 1, "world_size": 1, "size_bytes": 1, "blocking_s": 0.1, "total_s": 0.2}
    reports, commits, control = f"/api/v1/jobs/{job}/reports", f"/api/v1/jobs/{job}/checkpoints", \
        f"/api/v1/jobs/{job}/control"
    return [
        Case("report time 1e300", "POST", reports, "job", with_raw(batch, ("reports", 0, "time"), "1e300")),
        Case("report time Infinity", "POST", reports, "job", with_raw(batch, ("reports", 0, "time"), "Infinity")),
        Case("report step 2**63", "POST", reports, "job", with_raw(batch, ("reports", 0, "step"), str(2**63))),
        Case("report loss 1e400", "POST", reports, "job", with_raw(batch, ("reports", 0, "loss"), "1e400")),
        Case("report phase NaN", "POST", reports, "job",
             with_raw(batch, ("reports", 0, "phases"), '{"compute": "nan"}')),
        Case("event detail NUL", "POST", reports, "job",
             with_raw(batch, ("events", 0, "detail", "loss"), '"a\\u0000b"')),
        Case("event detail 20 deep", "POST", reports, "job",
             with_raw(batch, ("events", 0, "detail", "loss"), "[" * 20 + "]" * 20)),
        Case("reports 5,000-deep body", "POST", reports, "job", DEEP_ARRAY),
        Case("commit path NUL", "POST", commits, "job", with_raw(commit, ("path",), '"/ckpt\\u0000"')),
        Case("commit size 2**63", "POST", commits, "job", with_raw(commit, ("size_bytes",), str(2**63))),
        Case("commit blocking_s NaN", "POST", commits, "job", with_raw(commit, ("blocking_s",), "NaN")),
        Case("commit manifest 5,000 deep", "POST", commits, "job", with_raw(commit, ("manifest",), DEEP_OBJECT)),
        Case("control generation '²'", "GET", f"{control}?generation=%C2%B2", "job"),
        Case("control generation '١٢'", "GET", f"{control}?generation=%D9%A1%D9%A2", "job"),
        Case("control generation 'Ⅻ'", "GET", f"{control}?generation=%E2%85%AB", "job"),
        Case("control generation 2**63", "GET", f"{control}?generation={2**63}", "agent"),
    ]


def viewer_cases(job: int) -> list[Case]:
    return [
        Case("checkpoints ?min_step=²", "GET", "/api/v1/checkpoints?min_step=%C2%B2", "viewer"),
        Case("job checkpoints ?max_step=١٢", "GET", f"/api/v1/jobs/{job}/checkpoints?max_step=%D9%A1%D9%A2",
             "viewer"),
        Case("checkpoints ?generation=Ⅻ", "GET", "/api/v1/checkpoints?generation=%E2%85%AB", "viewer"),
        Case("checkpoints ?job=²", "GET", "/api/v1/checkpoints?job=%C2%B2", "viewer"),
        Case("incidents ?job=١٢", "GET", "/api/v1/incidents?job=%D9%A1%D9%A2", "viewer"),
        Case("jobs ?name=NUL", "GET", "/api/v1/jobs?name=a%00b", "viewer"),
    ]


def dashboard_cases(node: int, job: int) -> list[Case]:
    return [
        Case("dashboard rollback checkpoint '²'", "POST", f"/jobs/{job}/rollback", "session",
             {"reason": "r", "checkpoint": "²"}),
        Case("dashboard rollback checkpoint 2**64", "POST", f"/jobs/{job}/rollback", "session",
             {"reason": "r", "checkpoint": str(2**64)}),
        Case("dashboard drain reason NUL", "POST", f"/nodes/{node}/drain", "session", {"reason": "a\x00b"}),
        Case("dashboard undrain reason NUL", "POST", f"/nodes/{node}/undrain", "session", {"reason": "a\x00b"}),
        Case("dashboard job page 2**63", "GET", f"/jobs/{2**63}/", "session", status=404, html=True),
    ]


def test_every_malformed_input_is_a_4xx_problem(cluster, fleet):
    where, tokens = fleet
    cases = [*agent_cases(where.node, where.job, tokens["bootstrap"]), *hooks_cases(where.job, where.checkpoint_dir),
             *viewer_cases(where.job), *dashboard_cases(where.node, where.job)]
    assert len(cases) >= 31
    dashboard = signed_in(cluster.url, "otto", "otto-password-1")
    failures = []
    try:
        for case in well_formed(where.node, where.job):
            answer = send(cluster.url, case, tokens, dashboard)
            assert answer.status_code == case.status, (case.name, answer.status_code, answer.text[:300])
        for case in cases:
            answer = send(cluster.url, case, tokens, dashboard)
            if (problem := judge(case, answer)) is not None:
                failures.append(f"{case.name}: {problem}")
    finally:
        dashboard.close()
    assert not failures, f"{len(failures)} of {len(cases)} malformed inputs not refused cleanly:\n" + \
        "\n".join(failures)


def send(url: str, case: Case, tokens: dict, dashboard: requests.Session) -> requests.Response:
    if case.principal == "session":
        headers = {"X-CSRFToken": dashboard.cookies["csrftoken"], "Referer": url + "/"}
        return dashboard.request(case.method, url + case.path, data=case.body, headers=headers, timeout=30)
    headers = {"Content-Type": "application/json"}
    if case.principal in tokens:
        headers["Authorization"] = f"Bearer {tokens[case.principal]}"
    data = case.body.encode() if isinstance(case.body, str) else None
    return requests.request(case.method, url + case.path, data=data, headers=headers, timeout=30)


def judge(case: Case, answer: requests.Response) -> str | None:
    """Why ``answer`` is not a clean refusal of ``case`` (None when it is)."""
    kind = answer.headers.get("Content-Type", "")
    if answer.status_code != case.status:
        return f"answered {answer.status_code}, not {case.status}: {answer.text[:300]}"
    if case.html:
        return None if kind.startswith("text/html") else f"answered {kind}, not an HTML page"
    if not kind.startswith("application/problem+json"):
        return f"answered {kind}, not problem details: {answer.text[:300]}"
    body = answer.json()
    if body.get("status") != case.status or not body.get("detail"):
        return f"not a problem-details body: {body}"
    return None


def signed_in(url: str, username: str, password: str) -> requests.Session:
    """A browser session of ``username`` on the dashboard, through the real sign-in form."""
    session = requests.Session()
    session.get(f"{url}/login/", timeout=30).raise_for_status()
    answer = session.post(f"{url}/login/", data={"username": username, "password": password,
                                                 "csrfmiddlewaretoken": session.cookies["csrftoken"]},
                          headers={"Referer": f"{url}/login/"}, allow_redirects=False, timeout=30)
    assert answer.status_code == 302, answer.text[:500]
    return session
