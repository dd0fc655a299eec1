"""Lemon nodes are kept out by placement (issue 24, item 2): an undrain alone does not put one back
(it warns, in the answer and the audit log), an explicit, audited clear-lemon does; crashes of
several different jobs on one node blame the node and drain it as suspect, whether each was
relaunched or replaced in process (issue 20)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from agents.protocol import agent as wire
from agents.protocol import dump, parse
from jobs import inprocess, orchestrator, services
from jobs.launching import candidates
from jobs.models import Event, Generation, Incident, Job, TrainingEvent
from nodes.models import Node
from nodes.policies import LemonPolicy
from nodes.services import ingest as node_ingest


def test_the_policy_defaults_are_the_settings_defaults_and_each_key_overrides() -> None:
    from django.conf import settings

    assert LemonPolicy.of(settings.NIGHTWATCH) == LemonPolicy() == LemonPolicy.of({})
    assert LemonPolicy.of({"LEMON_INCIDENTS": 5, "LEMON_CRASH_JOBS": 2}) == LemonPolicy(incidents=5, crash_jobs=2)
    assert LemonPolicy().warning("gpu-01", 2) is None
    assert "clear-lemon" in (LemonPolicy().warning("gpu-01", 3) or "")


def placed_on(job) -> list[str]:
    job.refresh_from_db()
    return list(Generation.objects.get(job=job, number=job.generation).nodes.values_list("hostname", flat=True))


@pytest.mark.django_db
def test_placement_skips_a_lemon_undrain_warns_and_only_clear_lemon_lets_it_back(cast, api):
    Node.objects.filter(pk=cast.node1.pk).update(lemon_count=3, schedulability="drained",
                                                 drain_reason="lemon: blamed in 3 incidents")
    operator = api(cast.tokens["operator"])

    answer = operator.post(f"/api/v1/nodes/{cast.node1.pk}/undrain", {"reason": "looks fine"}, format="json")
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["schedulability"] == "active" and body["lemon_count"] == 3
    assert "is a lemon (blamed in 3 incidents, threshold 3)" in body["warning"]
    undrain = Event.objects.get(kind="node.undrain", node=cast.node1)
    assert undrain.evidence["warning"] == body["warning"] and "warning:" in undrain.reason

    # Active and healthy, but a lemon: the job goes to the spare.
    assert [n.hostname for n in candidates(cast.job)] == ["gpu-02"]
    services.start_job(cast.job, actor="test")
    assert placed_on(cast.job) == ["gpu-02"]

    answer = operator.post(f"/api/v1/nodes/{cast.node1.pk}/clear-lemon", {"reason": "GPU 3 replaced"}, format="json")
    assert answer.status_code == 200, answer.content
    assert (answer.json()["lemon_cleared"], answer.json()["lemon_count"], answer.json()["warning"]) == (3, 0, None)
    cleared = Event.objects.get(kind="node.lemon_cleared", node=cast.node1)
    assert (cleared.actor, cleared.old_state, cleared.reason) == ("token:operator(otto)", "3", "GPU 3 replaced")
    other = Job.objects.create(name="next", entrypoint="t.py", nnodes=1, accelerator="cpu", created_by="test")
    services.start_job(other, actor="test")
    assert placed_on(other) == ["gpu-01"]
    # A viewer may not clear a lemon.
    denied = api(cast.tokens["viewer"]).post(f"/api/v1/nodes/{cast.node1.pk}/clear-lemon", {"reason": "x"},
                                             format="json")
    assert denied.status_code == 403


def running_job(name: str, node: Node) -> Job:
    job = Job.objects.create(name=name, entrypoint="t.py", nnodes=1, accelerator="cpu", created_by="test",
                             state="running", generation=1)
    Generation.objects.create(job=job, number=1, world_size=1).nodes.add(node)
    return job


def crash(job: Job, hostname: str, line: str):
    return orchestrator.report_fault(job.pk, "exit", generation=1, nodes=(hostname,), actor=f"node:{hostname}",
                                     signature="traceback", error_line=line)


@pytest.mark.django_db
def test_crashes_of_three_different_jobs_on_one_node_blame_it_and_drain_it_as_suspect(cast):
    extra = Node.objects.create(hostname="gpu-03", address="10.0.0.3", health="healthy")
    a, b, c = (running_job(name, cast.node1) for name in "abc")
    crash(a, "gpu-01", "RuntimeError: a")
    crash(running_job("a-again", extra), "gpu-03", "RuntimeError: elsewhere")  # another node: not counted
    crash(b, "gpu-01", "RuntimeError: b")
    cast.node1.refresh_from_db()
    assert (cast.node1.lemon_count, cast.node1.schedulability) == (0, "active")  # two jobs: could be the jobs

    incident = crash(c, "gpu-01", "RuntimeError: c")
    cast.node1.refresh_from_db()
    assert cast.node1.lemon_count == 1 and cast.node1.schedulability in ("draining", "drained")
    assert cast.node1.drain_reason.startswith(f"suspect: crashes of 3 different jobs (jobs {a.pk}, {b.pk}, {c.pk})")
    blame = Event.objects.get(kind="node.blame", node=cast.node1)
    assert blame.evidence == {"incident": incident.pk, "jobs": [a.pk, b.pk, c.pk]}
    assert Node.objects.get(hostname="gpu-03").lemon_count == 0


def crash_in_process(job: Job, node: Node):
    """A rank of ``job`` dies on ``node`` and is replaced in process: the agent's ``rank_gone``
    notice, then rank 0's ``resumed`` event of the next round, recorded as ``jobs.inprocess`` does."""
    round_number = TrainingEvent.objects.filter(job=job, kind="resumed").count() + 1
    died = timezone.now() - timedelta(seconds=1)
    notice = wire.RankGone(at=died.timestamp())
    batch = parse(wire.EventBatch, {"events": [{"key": f"rank_gone:{job.pk}:1:{notice.at:.3f}", "kind": "rank_gone",
                                                "time": died.timestamp(), "job": str(job.pk), "generation": 1,
                                                "detail": dump(notice)}]})
    node_ingest.record_agent_events(node, wire.parse_event_details(batch))
    event = TrainingEvent.objects.create(
        job=job, generation=1, rank=0, step=10, kind="resumed", key=f"0.{round_number}:0:10:resumed:0",
        reported_at=timezone.now(), detail={"step": 10, "in_process": {"round": round_number, "restarts": round_number,
                                                                       "failed_at": died.timestamp() + 0.02}})
    incident = inprocess.record_restart(event.pk)
    assert incident is not None and incident.evidence["nodes"] == [node.hostname]
    return incident


@pytest.mark.django_db
def test_crashes_replaced_in_process_count_like_relaunched_ones_a_stopped_rank_does_not(cast):
    """A node that kills a rank of every job now and then is found though each job restarts in
    process: two such crashes and one relaunched crash are three jobs. A rank the agent found
    stopped and killed is a hang, the program's as likely as the node's: not counted."""
    a, b, c, d = (running_job(name, cast.node1) for name in "abcd")
    crash_in_process(a, cast.node1)
    crash_in_process(a, cast.node1)  # the same job again: still one job
    stopped = crash_in_process(b, cast.node1)
    stopped.kind = "hang"
    stopped.save(update_fields=["kind"])
    crash_in_process(c, cast.node1)
    cast.node1.refresh_from_db()
    assert (cast.node1.lemon_count, cast.node1.schedulability) == (0, "active")  # jobs a and c

    incident = crash(d, "gpu-01", "RuntimeError: d")
    cast.node1.refresh_from_db()
    assert cast.node1.lemon_count == 1 and cast.node1.schedulability in ("draining", "drained")
    blame = Event.objects.get(kind="node.blame", node=cast.node1)
    assert blame.evidence == {"incident": incident.pk, "jobs": [a.pk, c.pk, d.pk]}


@pytest.mark.django_db
def test_one_job_crashing_again_or_crashes_outside_the_window_blame_nobody(cast):
    a, b = running_job("a", cast.node1), running_job("b", cast.node1)
    crash(a, "gpu-01", "RuntimeError: a")
    Incident.objects.filter(job=a).update(detected_at=timezone.now() - timedelta(hours=25))
    crash(b, "gpu-01", "RuntimeError: b")
    Job.objects.filter(pk=b.pk).update(state="running")
    crash(b, "gpu-01", "RuntimeError: b")  # the same job again: still one job
    crash(running_job("c", cast.node1), "gpu-01", "RuntimeError: c")  # a's crash is 25 h old: two jobs in 24 h
    cast.node1.refresh_from_db()
    assert (cast.node1.lemon_count, cast.node1.schedulability) == (0, "active")
