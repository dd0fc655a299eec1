"""Schemathesis against the served OpenAPI document: no server error and no response that the
document does not describe (status, content type, body schema), over more than 1,000 generated
requests — positive and negative — through the WSGI app on the test PostgreSQL database.

Half the generated cases keep their random path ids (mostly 404s); the other half are pointed at
real objects (a running job, a paused one, a node, a checkpoint, an incident), so that detail
views, filters and actions run their real code.

The whole document is walked three times, each time as one principal: an on-call token (every
human capability), the node agent's token (node 1, which runs generation 1 of the job) and the
job token of that generation. The request bodies of the agent and hooks endpoints are declared
(generated from ``agents.protocol``), so each principal's own operations get generated bodies;
the others' operations answer it 401/403, which the document must describe as well.
About 30 s per principal on one core.
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

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(300)]

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


def _issuer(world, principal: str):
    """``issue()`` -> a new raw token of ``principal``'s kind: the token the pass calls with."""
    from core.models import ApiToken

    cast = world.cast
    kinds = {
        "oncall": {"scope": "oncall", "user": cast.oncall},
        "agent": {"scope": "agent", "node": cast.node1},
        "job": {"scope": "job", "job": cast.job, "generation": world.generation.number},
    }
    return lambda: ApiToken.issue(name=f"fuzz-{principal}", **kinds[principal])[1]


@pytest.mark.parametrize("principal", ["oncall", "agent", "job"])
def test_generated_requests_find_no_server_error_and_no_schema_violation(world, wsgi_app, principal):
    schema = schemathesis.openapi.from_wsgi("/api/schema/", wsgi_app)
    world.cast.job.generation = world.generation.number  # the job token's generation is the current one
    world.cast.job.save(update_fields=["generation"])
    issue = _issuer(world, principal)
    token = issue()
    calls = {"total": 0}
    failures: list[str] = []

    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 35, [op.label for op in operations]
    undeclared = [op.label for op in operations
                  if op.method.upper() == "POST" and op.definition.raw.get("x-required-capability") in _MACHINE
                  and "requestBody" not in op.definition.raw]
    assert not undeclared, f"agent and hooks operations without a declared request body: {undeclared}"
    for operation in operations:
        if operation.definition.raw.get("x-required-capability") == "token":
            def headers():  # rotating revokes the caller's token: give each call its own
                return {"Authorization": f"Bearer {issue()}"}
        else:
            def headers():
                return {"Authorization": f"Bearer {token}"}
        _fuzz(operation, headers, _real_ids(world, operation.path), calls, failures)

    assert not failures, f"{len(failures)} failing requests:\n" + "\n".join(failures[:40])
    print(f"schemathesis ({principal}): {calls['total']} requests over {len(operations)} operations")
    assert calls["total"] >= MINIMUM_REQUESTS, calls


#: Capabilities of machine principals: their bodies are wire-protocol messages (core.schema).
_MACHINE = {"agent", "hooks", None}


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
