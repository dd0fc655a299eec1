"""``recovery_policy.startup_timeout_s`` on the way in: the launch API and the CLI's spec file."""

from __future__ import annotations

import textwrap

import pytest

from agents.cli import spec as specs
from jobs.models import Job

RANGE = "Must be between 10 and 86400 seconds (24 h), or null to derive it from the job's earlier starts."


def launch(api, cast, recovery_policy):
    return api(cast.tokens["operator"]).post(
        "/api/v1/jobs", {"name": "tiny", "entrypoint": "train.py", "recovery_policy": recovery_policy},
        format="json")


@pytest.mark.django_db
@pytest.mark.parametrize("value", [10, 45, 86400])
def test_a_value_in_range_is_stored(cast, api, value):
    response = launch(api, cast, {"startup_timeout_s": value})
    assert response.status_code == 201, response.content
    assert response.json()["recovery_policy"]["startup_timeout_s"] == value
    assert Job.objects.get(pk=response.json()["id"]).recovery_policy["startup_timeout_s"] == value


@pytest.mark.django_db
def test_null_and_absent_mean_derived(cast, api):
    for policy in ({"startup_timeout_s": None}, {}):
        response = launch(api, cast, policy)
        assert response.status_code == 201, response.content
        assert response.json()["recovery_policy"]["startup_timeout_s"] is None


@pytest.mark.django_db
@pytest.mark.parametrize(("value", "reason"), [
    (9, RANGE),
    (0, RANGE),
    (-30, RANGE),
    (86401, RANGE),
    (12.5, "A whole number of seconds is required. " + RANGE),
    ("soon", "A whole number of seconds is required. " + RANGE),
    (True, "A whole number of seconds is required. " + RANGE),
])
def test_out_of_range_or_not_a_number_is_refused_with_the_field_named(cast, api, value, reason):
    before = Job.objects.count()
    response = launch(api, cast, {"startup_timeout_s": value})
    assert response.status_code == 400, response.content
    assert response["Content-Type"] == "application/problem+json"
    errors = response.json()["errors"]
    assert {"field": "recovery_policy.startup_timeout_s", "reason": reason} in errors, errors
    assert Job.objects.count() == before


def write(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_the_spec_file_accepts_it_and_null(tmp_path):
    spec = specs.load(write(tmp_path, """
        name: tiny-lm
        entrypoint: examples/train.py
        recovery_policy:
          progress_timeout_s: 10
          startup_timeout_s: 45
    """))
    assert spec.body["recovery_policy"] == {"progress_timeout_s": 10, "startup_timeout_s": 45}
    assert spec.locate("recovery_policy.startup_timeout_s") == 5
    spec = specs.load(write(tmp_path, """
        name: tiny-lm
        entrypoint: examples/train.py
        recovery_policy: {startup_timeout_s: null}
    """))
    assert spec.body["recovery_policy"] == {"startup_timeout_s": None}


def test_the_spec_file_refuses_a_non_integer_with_its_line(tmp_path):
    with pytest.raises(specs.SpecError) as caught:
        specs.load(write(tmp_path, """
            name: tiny-lm
            entrypoint: examples/train.py
            recovery_policy:
              startup_timeout_s: 2m
        """))
    assert [(p.line, p.field, p.reason) for p in caught.value.problems] == [
        (4, "recovery_policy.startup_timeout_s", "expected an integer, got '2m'")]
