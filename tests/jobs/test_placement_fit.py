"""Placement explains itself (issue 24, item 7): a spec the fleet can never hold is refused at
launch with a 422 naming the field (unless it asks to queue), and a pending job's status says why
it waits, counting what keeps the other nodes out."""

from __future__ import annotations

import pytest

from jobs.fit import Fleet, never_fits, waiting_reason
from jobs.models import Job
from nodes.models import GPU, Node

TWO = Fleet(registered=2, usable=2, drained=0, lemons=0, unhealthy=0, busy=0, max_gpus=8)


def test_never_fits_names_each_field_the_fleet_cannot_hold() -> None:
    assert never_fits(nnodes=2, nproc_per_node=8, accelerator="gpu", fleet=TWO) == {}
    problems = never_fits(nnodes=4096, nproc_per_node=16, accelerator="gpu", fleet=TWO)
    assert problems["nnodes"].startswith("4096 nodes needed, but 2 node(s) are registered")
    assert problems["nproc_per_node"].startswith("16 GPUs per node needed, but no registered node has more than 8")
    assert never_fits(nnodes=1, nproc_per_node=16, accelerator="cpu", fleet=TWO) == {}  # CPU ranks: any number
    unknown = Fleet(registered=2, usable=2, drained=0, lemons=0, unhealthy=0, busy=0, max_gpus=None)
    assert never_fits(nnodes=1, nproc_per_node=64, accelerator="gpu", fleet=unknown) == {}  # no inventory: no verdict
    assert never_fits(nnodes=3, nproc_per_node=1, accelerator="gpu", fleet=TWO, allow_shrink=True) == {}
    empty = Fleet(registered=0, usable=0, drained=0, lemons=0, unhealthy=0, busy=0, max_gpus=None)
    assert never_fits(nnodes=4096, nproc_per_node=1, accelerator="gpu", fleet=empty) == {}  # agents still to come


def test_the_waiting_reason_counts_what_keeps_nodes_out() -> None:
    fleet = Fleet(registered=5, usable=1, drained=1, lemons=1, unhealthy=1, busy=1, max_gpus=None)
    assert waiting_reason(nnodes=4, fleet=fleet) == (
        "not enough healthy nodes: have 1, need 4 (of 5 registered: 1 drained or draining, 1 lemons (kept out until "
        "cleared), 1 unhealthy, unreachable or not yet judged, 1 running other jobs)")
    assert waiting_reason(nnodes=4096, fleet=TWO) == "not enough healthy nodes: have 2, need 4096 (of 2 registered)"


@pytest.mark.django_db
def test_a_spec_that_can_never_fit_is_refused_with_422_unless_queued(cast, api):
    operator = api(cast.tokens["operator"])
    jobs = Job.objects.count()
    refused = operator.post("/api/v1/jobs", {"name": "huge", "entrypoint": "t.py", "nnodes": 4096}, format="json")
    assert refused.status_code == 422, refused.content
    body = refused.json()
    assert body["errors"] == [{"field": "nnodes", "reason": body["detail"]}]
    assert body["detail"].startswith("4096 nodes needed, but 2 node(s) are registered: it could never be placed.")
    assert Job.objects.count() == jobs  # nothing written

    GPU.objects.bulk_create([GPU(node=cast.node1, index=i) for i in range(8)])
    refused = operator.post("/api/v1/jobs", {"name": "wide", "entrypoint": "t.py", "nproc_per_node": 16},
                            format="json")
    assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "nproc_per_node"
    assert "no registered node has more than 8" in refused.json()["detail"]

    queued = operator.post("/api/v1/jobs", {"name": "huge", "entrypoint": "t.py", "nnodes": 4096, "queue": True},
                           format="json")
    assert queued.status_code == 201, queued.content
    assert "queue" not in queued.json() and Job.objects.get(pk=queued.json()["id"]).state == "pending"


@pytest.mark.django_db
def test_a_pending_jobs_status_says_why_it_waits(cast, api):
    job = Job.objects.create(name="huge", entrypoint="t.py", nnodes=4096, created_by="test")
    viewer = api(cast.tokens["viewer"])
    waiting = viewer.get(f"/api/v1/jobs/{job.pk}/status").json()["waiting"]
    assert waiting["reason"].startswith("not enough healthy nodes: have 2, need 4096 (of 2 registered);")
    assert "can never be placed" in waiting["reason"] and set(waiting["never_fits"]) == {"nnodes"}
    assert (waiting["have"], waiting["need"]) == (2, 4096)

    Node.objects.filter(pk=cast.node1.pk).update(schedulability="drained")
    Node.objects.filter(pk=cast.node2.pk).update(lemon_count=3)
    Node.objects.create(hostname="gpu-03", address="10.0.0.3", health="unreachable")
    Job.objects.filter(pk=job.pk).update(nnodes=2)
    waiting = viewer.get(f"/api/v1/jobs/{job.pk}/status").json()["waiting"]
    assert waiting["reason"] == ("not enough healthy nodes: have 0, need 2 (of 3 registered: 1 drained or draining, "
                                 "1 lemons (kept out until cleared), 1 unhealthy, unreachable or not yet judged)")
    assert waiting["fleet"] == {"registered": 3, "drained": 1, "lemons": 1, "unhealthy": 1, "busy": 0,
                                "max_gpus": None}

    Job.objects.filter(pk=job.pk).update(state="running")
    assert viewer.get(f"/api/v1/jobs/{job.pk}/status").json()["waiting"] is None
