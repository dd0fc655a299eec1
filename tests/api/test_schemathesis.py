"""Schemathesis against the served OpenAPI document: no server error and no response that the
document does not describe (status, content type, body schema), over more than 1,000 generated
requests — positive and negative — through the WSGI app on the test PostgreSQL database.

Half the generated cases keep their random path ids (mostly 404s); the other half are pointed at
real objects (a running job, a paused one, a node, a checkpoint, an incident), so that detail
views, filters and actions run their real code. Agent operations are called with the node
agent's token for its own node; everything else with an on-call token, which holds every human
capability.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(240)]

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES_PER_OPERATION = int(os.environ.get("NIGHTWATCH_FUZZ_EXAMPLES", "25"))
#: CI replays the same cases every run; NIGHTWATCH_FUZZ_RANDOM=1 explores new ones (a bug hunt).
DERANDOMIZE = not os.environ.get("NIGHTWATCH_FUZZ_RANDOM")
MINIMUM_REQUESTS = 1000


def _real_ids(world, path: str) -> dict:
    """Path parameters naming real objects, for ``path`` (an OpenAPI path template)."""
    if path.startswith("/api/v1/jobs/"):
        job = world.paused_job if path.endswith(("/approve", "/rollback")) else world.cast.job
        return {"id": job.pk}
    if path.startswith("/api/v1/nodes/"):
        return {"id": world.cast.node1.pk, "node_id": world.cast.node1.pk, "command_id": 1}
    if path.startswith("/api/v1/checkpoints/"):
        return {"id": world.checkpoint.pk}
    if path.startswith("/api/v1/incidents/"):
        return {"id": world.incident.pk}
    return {}


@pytest.fixture
def wsgi_app():
    """The WSGI app, minus the per-request connection closing that would end the test transaction
    (Django's own test client disconnects it the same way)."""
    from django.core import signals
    from django.db import close_old_connections

    from controlplane.wsgi import application

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield application
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


def test_generated_requests_find_no_server_error_and_no_schema_violation(world, wsgi_app):
    schema = schemathesis.openapi.from_wsgi("/api/schema/", wsgi_app)
    tokens = world.cast.tokens
    calls = {"total": 0}
    failures: list[str] = []

    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 35, [op.label for op in operations]
    for operation in operations:
        capability = operation.definition.raw.get("x-required-capability")
        if capability == "token":  # rotating revokes the caller's token: give each call its own
            def headers():
                from controlplane.models import ApiToken

                return {"Authorization": f"Bearer {ApiToken.issue(name='ci', scope='ci', user=world.cast.ci_user)[1]}"}
        else:
            fixed = {"Authorization": f"Bearer {tokens['agent' if capability == 'agent' else 'oncall']}"}

            def headers(fixed=fixed):
                return fixed
        _fuzz(operation, headers, _real_ids(world, operation.path), calls, failures)

    assert not failures, f"{len(failures)} failing requests:\n" + "\n".join(failures[:40])
    print(f"schemathesis: {calls['total']} requests over {len(operations)} operations")
    assert calls["total"] >= MINIMUM_REQUESTS, calls


def _fuzz(operation, make_headers, real: dict, calls: dict, failures: list) -> None:
    cases = st.one_of(*(operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)))

    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=DERANDOMIZE,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases, point_at_real_objects=st.booleans())
    def exercise(case, point_at_real_objects):
        if point_at_real_objects and case.path_parameters:
            case.path_parameters = {**case.path_parameters,
                                    **{k: v for k, v in real.items() if k in case.path_parameters}}
        headers = make_headers()
        response = case.call(headers=headers)
        calls["total"] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except (Exception, BaseExceptionGroup) as exc:  # collect them all: one run shows every broken operation
            failures.append(f"{operation.label} {case.path_parameters} {case.query} -> "
                            f"{response.status_code}: {str(exc)[:600]}")

    exercise()
