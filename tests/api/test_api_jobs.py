"""Launching jobs: validation with precise problem details, and idempotent retries."""

from __future__ import annotations

import threading

import pytest

from jobs.models import Event, Job

PROBLEM = "application/problem+json"


def launch(api, token, body, key=None, **extra):
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return api(token).post("/api/v1/jobs", body, format="json", **headers, **extra)


@pytest.mark.django_db
def test_launch_fills_policy_defaults_and_audits(cast, api):
    response = launch(api, cast.tokens["ci"], {"name": "gpt-small", "entrypoint": "examples/train.py",
                                                "nproc_per_node": 2, "nccl_profile": {"NCCL_DEBUG": "WARN"},
                                                "recovery_policy": {"max_restarts": 2}})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["state"] == "pending" and body["generation"] == 0 and body["world_size"] == 2
    assert body["recovery_policy"]["max_restarts"] == 2
    assert body["recovery_policy"]["window_minutes"] == 60
    assert body["checkpoint_policy"] == {"interval": "fixed", "interval_steps": None, "keep_last": 3,
                                         "permanent_every_hours": 12, "min_free_percent": 5,
                                         "release_permanent_under_pressure": True, "snapshot_every": 0}
    event = Event.objects.get(job_id=body["id"], kind="job.launch")
    assert event.actor == "token:ci(ci-bot)"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ({"entrypoint": "t.py"}, "name", "required"),
        ({"name": "x", "entrypoint": "t.py", "nnodes": "two"}, "nnodes", "valid integer"),
        ({"name": "x", "entrypoint": "t.py", "nnodes": 0}, "nnodes", "greater than or equal to 1"),
        ({"name": "x", "entrypoint": "/etc/passwd"}, "entrypoint", "relative path"),
        ({"name": "x", "entrypoint": "../../t.py"}, "entrypoint", "relative path"),
        ({"name": "x y", "entrypoint": "t.py"}, "name", "letters, digits"),
        ({"name": "x", "entrypoint": "t.py", "args": "--lr 1"}, "args", "list"),
        ({"name": "x", "entrypoint": "t.py", "nccl_profile": {"LD_PRELOAD": "/x.so"}}, "nccl_profile",
         "unknown variable"),
        ({"name": "x", "entrypoint": "t.py", "recovery_policy": {"max_restarts": -1}},
         "recovery_policy.max_restarts", "greater than or equal to 0"),
        ({"name": "x", "entrypoint": "t.py", "checkpoint_policy": {"interval": "sometimes"}},
         "checkpoint_policy.interval", "not a valid choice"),
        ({"name": "x", "entrypoint": "t.py", "checkpoint_policy": {"snapshot_every": -1}},
         "checkpoint_policy.snapshot_every", "greater than or equal to 0"),
        ({"name": "x", "entrypoint": "t.py", "checkpoint_policy": {"snapshot_every": 10_001}},
         "checkpoint_policy.snapshot_every", "less than or equal to 10000"),
        ({"name": "x", "entrypoint": "t.py", "checkpoint_policy": {"snapshot_every": "often"}},
         "checkpoint_policy.snapshot_every", "valid integer"),
        ({"name": "x", "entrypoint": "t.py", "checkpoint_policy": {"snapshot_every": None}},
         "checkpoint_policy.snapshot_every", "may not be null"),
    ],
)
def test_bad_launch_names_the_field_and_writes_nothing(cast, api, body, field, reason):
    before = Job.objects.count()
    response = launch(api, cast.tokens["ci"], body)
    assert response.status_code == 400
    assert response["Content-Type"] == PROBLEM
    problem = response.json()
    assert problem["status"] == 400 and problem["title"] == "Invalid request"
    assert any(e["field"] == field and reason in e["reason"] for e in problem["errors"]), problem
    assert Job.objects.count() == before


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        # torchrun would read these as its own options (--no-python runs the args as a command).
        ({"name": "x", "entrypoint": "--no-python", "args": ["sh", "-c", "id"]}, "entrypoint", "relative path"),
        ({"name": "x", "entrypoint": "-m"}, "entrypoint", "relative path"),
        ({"name": "x", "entrypoint": "examples/train.sh"}, "entrypoint", ".py file"),
        ({"name": "x", "entrypoint": " t.py"}, "entrypoint", "relative path"),  # not trimmed into shape
        ({"name": "x", "module": "pdb", "args": ["-c", "import os"]}, "module", "standard-library"),
        ({"name": "x", "module": "-m pkg.train"}, "module", "dotted Python module name"),
        ({"name": "x", "entrypoint": "t.py", "module": "pkg.train"}, "entrypoint", "exactly one"),
        ({"name": "x"}, "entrypoint", "exactly one"),
        ({"name": "x ", "entrypoint": "t.py"}, "name", "letters, digits"),
        ({"name": "x", "entrypoint": "t.py", "entrypont": "u.py"}, "entrypont", "did you mean 'entrypoint'"),
        ({"name": "x", "entrypoint": "t.py", "env": {"LD_PRELOAD": "/x.so"}}, "env", "Unknown field"),
        ({"name": "x", "entrypoint": "t.py", "recovery_policy": {"max_restart": 3}},
         "recovery_policy.max_restart", "did you mean 'max_restarts'"),
        ({"name": "x", "entrypoint": "t.py", "checkpoint_policy": {"keep": 3}}, "checkpoint_policy.keep",
         "Unknown field"),
        ({"name": "x", "entrypoint": "t.py", "nccl_profile": {"NCCL_DEBUG_FILE": "/etc/cron.d/x"}},
         "nccl_profile", "bare file name"),
        ({"name": "x", "entrypoint": "t.py", "nccl_profile": {"NCCL_TOPO_DUMP_FILE": "../../x.xml"}},
         "nccl_profile", "bare file name"),
        ({"name": "x", "entrypoint": "t.py", "checkpoint_policy": {"dir": "/etc"}}, "checkpoint_policy.dir",
         "is outside"),
        ({"name": "x", "entrypoint": "t.py", "checkpoint_policy": {"replica_dir": "/etc"}},
         "checkpoint_policy.replica_dir", "no root is configured"),
        ({"name": "x", "entrypoint": "t.py", "checkpoint_policy": {"dir": "relative/ckpt"}},
         "checkpoint_policy.dir", "absolute path"),
    ],
)
def test_an_injected_or_sloppy_spec_names_the_field_and_writes_nothing(cast, api, body, field, reason):
    before = Job.objects.count()
    response = launch(api, cast.tokens["ci"], body)
    assert response.status_code == 400, response.content
    assert any(e["field"] == field and reason in e["reason"] for e in response.json()["errors"]), response.json()
    assert Job.objects.count() == before


@pytest.mark.django_db
def test_an_argument_holding_nul_is_refused_not_cut(cast, api):
    before = Job.objects.count()
    response = launch(api, cast.tokens["ci"], {"name": "x", "entrypoint": "t.py", "args": ["ok", "a\u0000b"]})
    assert response.status_code == 400 and Job.objects.count() == before


@pytest.mark.django_db
def test_a_checkpoint_dir_must_resolve_inside_the_root(cast, api, settings, tmp_path):
    root = tmp_path / "checkpoints"
    (root / "job-a").mkdir(parents=True)
    (root / "escape").symlink_to("/etc")
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "CHECKPOINT_ROOT": str(root)}
    for outside in (root / "escape" / "x", root / "job-a" / ".." / ".." / "x", root):
        response = launch(api, cast.tokens["ci"], {"name": "x", "entrypoint": "t.py",
                                                    "checkpoint_policy": {"dir": str(outside)}})
        assert response.status_code == 400, outside
        assert response.json()["errors"][0]["field"] == "checkpoint_policy.dir"
    inside = launch(api, cast.tokens["ci"], {"name": "x", "entrypoint": "t.py",
                                             "checkpoint_policy": {"dir": str(root / "job-a" / "run-1")}})
    assert inside.status_code == 201, inside.content
    assert inside.json()["checkpoint_policy"]["dir"] == str(root / "job-a" / "run-1")


@pytest.mark.django_db
def test_a_checkpoint_dir_is_never_another_jobs(cast, api, settings, tmp_path):
    """A job whose directory holds or lies in another job's could commit, verify and prune that job's
    checkpoints as its own: each job's directory is its own, the defaults (<root>/job-<id>) included."""
    root = tmp_path / "checkpoints"
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "CHECKPOINT_ROOT": str(root)}
    first = launch(api, cast.tokens["ci"], {"name": "a", "entrypoint": "t.py",
                                            "checkpoint_policy": {"dir": str(root / "team" / "a")}})
    assert first.status_code == 201, first.content
    for shared in (root / "team" / "a", root / "team", root / "team" / "a" / "inner", root / f"job-{cast.job.pk}",
                   root / "job-999" / "x"):
        response = launch(api, cast.tokens["ci"], {"name": "b", "entrypoint": "t.py",
                                                    "checkpoint_policy": {"dir": str(shared)}})
        assert response.status_code == 400, shared
        assert "Overlaps job" in response.json()["errors"][0]["reason"], response.json()
    assert launch(api, cast.tokens["ci"], {"name": "b", "entrypoint": "t.py",
                                           "checkpoint_policy": {"dir": str(root / "team" / "b")}}).status_code == 201


@pytest.mark.django_db
def test_a_replica_dir_must_lie_in_a_replica_root(cast, api, settings, tmp_path):
    replicas = tmp_path / "replicas"
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "REPLICA_ROOTS": [str(replicas)]}
    outside = launch(api, cast.tokens["ci"], {"name": "x", "entrypoint": "t.py",
                                              "checkpoint_policy": {"replica_dir": str(tmp_path / "elsewhere")}})
    assert outside.status_code == 400
    assert outside.json()["errors"][0]["field"] == "checkpoint_policy.replica_dir"
    inside = launch(api, cast.tokens["ci"], {"name": "x", "entrypoint": "t.py",
                                             "checkpoint_policy": {"replica_dir": str(replicas / "job-x")}})
    assert inside.status_code == 201, inside.content


@pytest.mark.django_db
def test_args_are_stored_verbatim_and_a_module_job_launches(cast, api):
    args = ["  --lr ", "1e-3", "", "two words", "--no-python", "$(id)"]
    response = launch(api, cast.tokens["ci"], {"name": "mod", "module": "pkg.train", "args": args,
                                                "nccl_profile": {"NCCL_DEBUG_FILE": "nccl.%h.%p.log"}})
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert (job.module, job.entrypoint, job.args) == ("pkg.train", "", args)
    assert response.json()["module"] == "pkg.train"


@pytest.mark.django_db
def test_malformed_json_gets_problem_details(cast, api):
    response = api(cast.tokens["ci"]).post("/api/v1/jobs", data='{"name": "x",', content_type="application/json")
    assert response.status_code == 400
    assert response["Content-Type"] == PROBLEM
    assert "JSON parse error" in response.json()["detail"]


@pytest.mark.django_db
def test_wrong_top_level_type_gets_problem_details(cast, api):
    response = api(cast.tokens["ci"]).post("/api/v1/jobs", data="[1, 2]", content_type="application/json")
    assert response.status_code == 400
    assert response["Content-Type"] == PROBLEM


@pytest.mark.django_db
def test_unknown_api_route_and_missing_job_are_problem_details(cast, api):
    for path in ("/api/v1/nope", "/api/v1/jobs/999999"):
        response = api(cast.tokens["viewer"]).get(path)
        assert response.status_code == 404
        assert response["Content-Type"] == PROBLEM
        assert response.json()["status"] == 404


@pytest.mark.django_db
def test_retry_with_the_same_idempotency_key_launches_once(cast, api):
    body = {"name": "nightly", "entrypoint": "train.py"}
    first = launch(api, cast.tokens["ci"], body, key="ci-run-1234")
    again = launch(api, cast.tokens["ci"], body, key="ci-run-1234")
    assert first.status_code == again.status_code == 201
    assert first.json() == again.json()
    assert again["Idempotent-Replayed"] == "true"
    assert Job.objects.filter(name="nightly").count() == 1
    # Another credential's identical key is its own.
    other = launch(api, cast.tokens["operator"], body, key="ci-run-1234")
    assert other.json()["id"] != first.json()["id"]


@pytest.mark.django_db
def test_reusing_a_key_with_another_body_is_refused(cast, api):
    launch(api, cast.tokens["ci"], {"name": "a", "entrypoint": "t.py"}, key="k1")
    response = launch(api, cast.tokens["ci"], {"name": "b", "entrypoint": "t.py"}, key="k1")
    assert response.status_code == 422
    assert "different request body" in response.json()["detail"]
    assert not Job.objects.filter(name="b").exists()


@pytest.mark.django_db
def test_a_failed_launch_does_not_consume_the_key(cast, api):
    assert launch(api, cast.tokens["ci"], {"name": "bad name!", "entrypoint": "t.py"}, key="k2").status_code == 400
    assert launch(api, cast.tokens["ci"], {"name": "good", "entrypoint": "t.py"}, key="k2").status_code == 201


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_retries_with_one_key_launch_once(cast, api):
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL)")
    barrier = threading.Barrier(3)
    statuses = []

    def retry():
        from django.db import connection as thread_connection

        try:
            barrier.wait(timeout=10)
            response = launch(api, cast.tokens["ci"], {"name": "race", "entrypoint": "t.py"}, key="race")
            statuses.append(response.status_code)
        finally:
            thread_connection.close()

    threads = [threading.Thread(target=retry) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert statuses == [201, 201, 201]
    assert Job.objects.filter(name="race").count() == 1


@pytest.mark.django_db
def test_cancel_is_audited_and_a_second_cancel_conflicts(cast, api):
    client = api(cast.tokens["operator"])
    response = client.post(f"/api/v1/jobs/{cast.job.pk}/cancel", {"reason": "wrong dataset"}, format="json")
    assert response.status_code == 200 and response.json()["state"] == "cancelled"
    event = Event.objects.get(job=cast.job, kind="job.state")
    assert (event.actor, event.reason) == ("token:operator(otto)", "wrong dataset")
    again = client.post(f"/api/v1/jobs/{cast.job.pk}/cancel", {"reason": "again"}, format="json")
    assert again.status_code == 409
    assert "cannot go from cancelled to cancelled" in again.json()["detail"]


@pytest.mark.django_db
def test_interval_steps_is_pushed_to_the_hooks_or_refused_with_auto(cast, api):
    """checkpoint_policy.interval_steps works (the control answer carries it, so the hooks save that
    often) with interval fixed; with interval auto it is a 400 naming the field (issue 21)."""
    from jobs import ingest

    refused = launch(api, cast.tokens["ci"], {"name": "auto-and-steps", "entrypoint": "examples/train.py",
                                              "checkpoint_policy": {"interval": "auto", "interval_steps": 20}})
    assert refused.status_code == 400 and refused["Content-Type"] == PROBLEM
    errors = refused.json()["errors"]
    assert [e["field"] for e in errors] == ["checkpoint_policy.interval_steps"], errors
    assert "with interval: auto the interval is the Young/Daly recommendation" in errors[0]["reason"]
    assert not Job.objects.filter(name="auto-and-steps").exists()

    fixed = launch(api, cast.tokens["ci"], {"name": "every-7", "entrypoint": "examples/train.py",
                                            "checkpoint_policy": {"interval_steps": 7}})
    assert fixed.status_code == 201, fixed.content
    job = Job.objects.get(pk=fixed.json()["id"])
    assert ingest.control_for(job, job.generation).checkpoint_interval_steps == 7
    unset = Job.objects.get(pk=launch(api, cast.tokens["ci"], {"name": "script-decides",
                                                               "entrypoint": "examples/train.py"}).json()["id"])
    assert ingest.control_for(unset, unset.generation).checkpoint_interval_steps is None  # the script's own
    auto = Job.objects.get(pk=launch(api, cast.tokens["ci"], {"name": "auto", "entrypoint": "examples/train.py",
                                                              "checkpoint_policy": {"interval": "auto"}}).json()["id"])
    assert ingest.control_for(auto, auto.generation).checkpoint_interval_steps is None  # no recommendation yet
    Job.objects.filter(pk=auto.pk).update(recommended_interval_steps=300)
    auto.refresh_from_db()
    assert ingest.control_for(auto, auto.generation).checkpoint_interval_steps == 300
