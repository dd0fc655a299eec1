"""Every API error as RFC 9457 problem details (``application/problem+json``).

``{"type", "title", "status", "detail", "instance", "errors": [{"field", "reason"}]}`` — the same
shape for validation errors, auth failures, conflicts, unknown routes and server errors.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.db import OperationalError
from django.http import Http404, JsonResponse
from psycopg_pool import PoolTimeout
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

logger = logging.getLogger(__name__)
PROBLEM_TYPE = "https://nightwatch.dev/problems/"
CONTENT_TYPE = "application/problem+json"


class Conflict(exceptions.APIException):
    """The request is well-formed but contradicts the current state (e.g. a stale generation)."""

    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state."
    default_code = "conflict"


class Unprocessable(exceptions.APIException):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_detail = "The request cannot be processed."
    default_code = "unprocessable"


def problem(status_code: int, title: str, detail: str, *, code: str, instance: str = "", errors=None) -> dict:
    body = {"type": PROBLEM_TYPE + code, "title": title, "status": status_code, "detail": detail}
    if instance:
        body["instance"] = instance
    if errors:
        body["errors"] = errors
    return body


def flatten_errors(detail, prefix: str = "") -> list[dict]:
    """DRF's nested ``{"field": ["msg"]}`` as ``[{"field": "a.b", "reason": "msg"}]``."""
    if isinstance(detail, dict):
        out = []
        for key, value in detail.items():
            name = prefix if key == "non_field_errors" else (f"{prefix}.{key}" if prefix else str(key))
            out.extend(flatten_errors(value, name))
        return out
    if isinstance(detail, list):
        if all(not isinstance(item, (dict, list)) for item in detail):
            return [{"field": prefix, "reason": str(item)} for item in detail]
        out = []
        for index, item in enumerate(detail):
            out.extend(flatten_errors(item, f"{prefix}.{index}" if prefix else str(index)))
        return out
    return [{"field": prefix, "reason": str(detail)}]


def exception_handler(exc, context):
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    request = context.get("request")
    instance = request.path if request is not None else ""
    if response is None and no_connection_in_time(exc):
        logger.warning("no database connection within the pool's timeout: %s answered 503", instance)
        body, headers = overloaded(instance)
        return Response(body, status=503, content_type=CONTENT_TYPE, headers=headers)
    if response is None:
        logger.exception("unhandled API error", exc_info=exc)
        body = problem(500, "Internal server error", "The server failed; the error was logged.",
                       code="server-error", instance=instance)
        return Response(body, status=500, content_type=CONTENT_TYPE)
    code = getattr(exc, "default_code", "error")
    if isinstance(exc, exceptions.ValidationError):
        errors = flatten_errors(exc.detail)
        detail = "; ".join(f"{e['field']}: {e['reason']}" if e["field"] else e["reason"] for e in errors)
        body = problem(response.status_code, "Invalid request", detail, code="invalid", instance=instance,
                       errors=errors)
    else:
        detail = exc.detail if isinstance(exc, exceptions.APIException) else str(exc)
        if isinstance(detail, (dict, list)):
            errors = flatten_errors(detail)
            body = problem(response.status_code, _title(response.status_code), "; ".join(e["reason"] for e in errors),
                           code=str(code), instance=instance, errors=errors)
        else:
            body = problem(response.status_code, _title(response.status_code), str(detail), code=str(code),
                           instance=instance)
    response.data = body
    response.content_type = CONTENT_TYPE
    return response


def no_connection_in_time(exc: BaseException | None) -> bool:
    """Django's ``OperationalError`` for psycopg_pool's ``PoolTimeout`` (``DB_POOL_MAX_SIZE``)."""
    return isinstance(exc, OperationalError) and isinstance(exc.__cause__, PoolTimeout)


def overloaded(instance: str) -> tuple[dict, dict[str, str]]:
    """The problem body and headers of a request that found no free database connection
    (``no_connection_in_time``). Overload, not a failure: the process's connection pool stayed empty
    for its whole timeout (a reconnect storm in bench.fleet: two long polls answered 500). Refused
    like admission control refuses (``core.admission``), so the caller backs off and keeps what it
    sent, and an operator's browser is told to come back rather than shown a server error."""
    wait_s = settings.NIGHTWATCH["RETRY_AFTER_S"]
    body = problem(503, "Service Unavailable", f"The database is busy: no connection became free in time; "
                   f"retry after {wait_s} s (with jitter).", code="overloaded", instance=instance)
    return body, {"Retry-After": str(wait_s)}


def _title(status_code: int) -> str:
    try:
        return HTTPStatus(status_code).phrase
    except ValueError:
        return "Error"


def json_problem_view(status_code: int, code: str, detail: str):
    """Django-level handlers (404/500 outside DRF views) for paths under /api/."""

    def view(request, exception=None):
        body = problem(status_code, _title(status_code), detail, code=code, instance=request.path)
        return JsonResponse(body, status=status_code, content_type=CONTENT_TYPE)

    return view
