"""The checkpoint API: who may do what, protected deletes as 409 problems, audit events, filters."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints.choices import CheckpointState
from checkpoints.models import Checkpoint
from jobs.models import Event
from tests.checkpoints.conftest import register


@pytest.fixture
def three(ckjob, runs):
    """A/2, A/4, A/6 of ckjob, verified; A/6 is the latest verified (protected)."""
    return [register(ckjob, runs.path("A", step)) for step in (2, 4, 6)]


@pytest.mark.django_db
def test_a_viewer_reads_everything_but_may_not_change_anything(ckjob, three, cast, api):
    viewer = api(cast.tokens["viewer"])
    a2 = three[0]
    for url in ["/api/v1/checkpoints", f"/api/v1/checkpoints/{a2.pk}", f"/api/v1/checkpoints/{a2.pk}/lineage",
                f"/api/v1/jobs/{ckjob.pk}/checkpoints", f"/api/v1/jobs/{ckjob.pk}/checkpoints/tree",
                f"/api/v1/jobs/{ckjob.pk}/checkpoints/retention", f"/api/v1/jobs/{ckjob.pk}/checkpoints/interval"]:
        assert viewer.get(url).status_code == 200, url
    for method, url in [("post", f"/api/v1/checkpoints/{a2.pk}/verify"), ("post", f"/api/v1/checkpoints/{a2.pk}/pin"),
                        ("post", f"/api/v1/checkpoints/{a2.pk}/unpin"), ("delete", f"/api/v1/checkpoints/{a2.pk}")]:
        response = getattr(viewer, method)(url, {}, format="json")
        assert response.status_code == 403, url
        assert "'operate' capability" in response.json()["detail"]
    assert api().get(f"/api/v1/jobs/{ckjob.pk}/checkpoints").status_code == 401
    assert Path(a2.location).is_dir() and not a2.permanent


@pytest.mark.django_db
def test_an_operator_verifies_pins_unpins_and_deletes_each_with_an_audit_event(ckjob, three, cast, api):
    operator = api(cast.tokens["operator"])
    a2, a4, _ = three
    actor = "token:operator(otto)"

    verified = operator.post(f"/api/v1/checkpoints/{a2.pk}/verify", {"load_test": False}, format="json")
    assert verified.status_code == 200 and verified.json()["state"] == "verified"
    # The control plane never loads a checkpoint (it would unpickle what a training process wrote).
    refused = operator.post(f"/api/v1/checkpoints/{a2.pk}/verify", {"load_test": True}, format="json")
    assert refused.status_code == 400 and "agents.hooks.loadtest" in str(refused.json())
    assert Event.objects.filter(kind="checkpoint.verify", actor=actor, evidence__checkpoint=a2.pk).exists()

    pinned = operator.post(f"/api/v1/checkpoints/{a4.pk}/pin", {"reason": "best eval"}, format="json")
    assert pinned.status_code == 200 and pinned.json()["permanent"] is True
    assert Event.objects.get(kind="checkpoint.pin", actor=actor).reason == "best eval"
    unpinned = operator.post(f"/api/v1/checkpoints/{a4.pk}/unpin", {}, format="json")
    assert unpinned.json()["permanent"] is False
    assert Event.objects.get(kind="checkpoint.unpin").actor == actor

    deleted = operator.delete(f"/api/v1/checkpoints/{a2.pk}", {"reason": "disk space"}, format="json")
    assert deleted.status_code == 200 and deleted.json()["state"] == "deleted"
    assert not Path(a2.location).exists()
    event = Event.objects.get(kind="checkpoint.delete")
    assert (event.actor, event.reason, event.old_state, event.new_state) == (actor, "disk space", "verified", "deleted")
    # The row stays in the lineage: A/4's parent is still A/2.
    assert operator.get(f"/api/v1/checkpoints/{a4.pk}/lineage").json()[1]["state"] == "deleted"


@pytest.mark.django_db
def test_deleting_a_protected_checkpoint_is_a_409_problem_with_the_reason(ckjob, three, cast, api):
    operator = api(cast.tokens["operator"])
    a2, a4, a6 = three
    response = operator.delete(f"/api/v1/checkpoints/{a6.pk}", format="json")
    assert response.status_code == 409
    assert response["Content-Type"] == "application/problem+json"
    assert "is the latest verified checkpoint of the active branch" in response.json()["detail"]

    operator.post(f"/api/v1/checkpoints/{a4.pk}/pin", {}, format="json")
    response = operator.delete(f"/api/v1/checkpoints/{a4.pk}", format="json")
    assert response.status_code == 409 and "it is permanent (unpin it first)" in response.json()["detail"]

    from jobs.models import Generation

    Generation.objects.filter(job=ckjob, number=1).update(resumed_from=a2)  # generation 1 is live
    response = operator.delete(f"/api/v1/checkpoints/{a2.pk}", format="json")
    assert response.status_code == 409 and "active generation 1 resumed from it" in response.json()["detail"]

    assert all(Path(c.location).is_dir() for c in three)
    assert not Checkpoint.objects.filter(state=CheckpointState.DELETED).exists()
    assert not Event.objects.filter(kind="checkpoint.delete").exists()


@pytest.mark.django_db
def test_pinning_a_corrupt_checkpoint_is_refused(ckjob, three, cast, api):
    Checkpoint.objects.filter(pk=three[0].pk).update(state=CheckpointState.CORRUPT, state_reason="flipped byte")
    response = api(cast.tokens["operator"]).post(f"/api/v1/checkpoints/{three[0].pk}/pin", {}, format="json")
    assert response.status_code == 409 and "corrupt with no verified copy" in response.json()["detail"]


@pytest.mark.django_db
def test_the_list_filters(ckjob, three, cast, api):
    viewer = api(cast.tokens["viewer"])
    url = f"/api/v1/jobs/{ckjob.pk}/checkpoints"
    Checkpoint.objects.filter(pk=three[1].pk).update(permanent=True)

    def steps(**params):
        response = viewer.get(url, params)
        assert response.status_code == 200, response.content
        return [c["step"] for c in response.json()["results"]]

    assert steps() == [6, 4, 2]
    assert steps(min_step=3, max_step=5) == [4]
    assert steps(permanent="true") == [4]
    assert steps(state="verified", generation=1, branch="active") == [6, 4, 2]
    assert steps(generation=2) == []
    assert viewer.get(url, {"state": "rotten"}).status_code == 400
    assert viewer.get(url, {"min_step": "x"}).status_code == 400
    assert viewer.get("/api/v1/checkpoints", {"job": ckjob.pk, "state": "verified"}).json()["count"] == 3


@pytest.mark.django_db
def test_the_tree_and_the_retention_dry_run(ckjob, three, cast, api):
    viewer = api(cast.tokens["viewer"])
    tree = viewer.get(f"/api/v1/jobs/{ckjob.pk}/checkpoints/tree").json()
    assert tree["latest_verified"] == three[2].pk and tree["active_leaf"] == three[2].pk
    assert [b["steps"] for b in tree["branches"]] == [[2, 4, 6]] and tree["branches"][0]["active"]
    (root,) = tree["roots"]
    assert (root["step"], root["children"][0]["step"], root["children"][0]["children"][0]["step"]) == (2, 4, 6)

    plan = viewer.get(f"/api/v1/jobs/{ckjob.pk}/checkpoints/retention").json()
    assert plan["dry_run"] is True and plan["keep_last"] == 3 and plan["delete"] == []
    assert plan["storage"]["checkpoints"] == 3
    assert plan["storage"]["primary_bytes"] == sum(c.size_bytes for c in three) > 0
    assert [d["make_permanent"] for d in plan["keep"]] == [True, False, False]  # the first starts the series
    assert not Checkpoint.objects.filter(permanent=True).exists()  # a dry run changes nothing


@pytest.mark.django_db
def test_list_and_tree_query_counts_do_not_grow_with_the_number_of_checkpoints(ckjob, three, cast, api):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    viewer = api(cast.tokens["viewer"])
    urls = [f"/api/v1/jobs/{ckjob.pk}/checkpoints", f"/api/v1/jobs/{ckjob.pk}/checkpoints/tree",
            f"/api/v1/checkpoints?job={ckjob.pk}"]

    def counts():
        found = []
        for url in urls:
            with CaptureQueriesContext(connection) as queries:
                assert viewer.get(url).status_code == 200
            found.append(len(queries))
        return found

    counts()  # the token's first use of the minute stamps last_used_at: one more query, once
    before = counts()
    parent = three[-1]
    for step in range(8, 40, 2):  # a longer chain, registry rows only
        parent = Checkpoint.objects.create(job=ckjob, generation=parent.generation, step=step, parent=parent,
                                           location=f"/nowhere/step-{step}", state=CheckpointState.VERIFIED)
    assert counts() == before
