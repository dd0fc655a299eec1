"""API conventions shared by every app: pagination and ``Idempotency-Key`` handling."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import UTC, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from rest_framework import exceptions, parsers
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response

from controlplane.models import ApiToken, IdempotencyRecord
from controlplane.problems import Unprocessable

IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 200


class Pagination(LimitOffsetPagination):
    default_limit = 50
    max_limit = 500


def _owner(request) -> str:
    token = request.auth if isinstance(request.auth, ApiToken) else None
    if token is not None:
        return f"token:{token.pk}"
    return f"user:{request.user.pk}"


def idempotent(request, perform: Callable[[], Response]) -> Response:
    """Run ``perform`` at most once per (caller, Idempotency-Key); replay its response on retries.

    ``perform`` runs in the same transaction as the ledger row, so a crash leaves neither. Two
    concurrent first attempts race on the unique constraint; the loser replays the winner.
    A retry with the same key but a different body is refused (422): that is a client bug.
    """
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return perform()
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise Unprocessable(f"{IDEMPOTENCY_HEADER} must be 1-{MAX_KEY_LENGTH} printable characters.")
    owner = _owner(request)
    digest = hashlib.sha256(json.dumps(request.data, sort_keys=True, default=str).encode()).hexdigest()
    ttl = timedelta(seconds=settings.NIGHTWATCH["IDEMPOTENCY_TTL_S"])
    IdempotencyRecord.objects.filter(owner=owner, key=key, created_at__lt=timezone.now() - ttl).delete()

    existing = IdempotencyRecord.objects.filter(owner=owner, key=key).first()
    if existing is None:
        try:
            with transaction.atomic():
                response = perform()
                if response.status_code >= 400:
                    return response
                IdempotencyRecord.objects.create(owner=owner, key=key, request_digest=digest,
                                                 status_code=response.status_code, response=response.data)
                return response
        except IntegrityError:
            existing = IdempotencyRecord.objects.filter(owner=owner, key=key).first()
            if existing is None:
                raise
    if existing.request_digest != digest:
        raise Unprocessable(f"{IDEMPOTENCY_HEADER} {key!r} was already used with a different request body.")
    return Response(existing.response, status=existing.status_code, headers={"Idempotent-Replayed": "true"})


def parse_wire(message_class, request):
    """Validate a request body against a wire-protocol message (``agents.protocol``).

    The agent and the hooks build their messages from the same classes, so the two ends agree
    by construction; a mismatch is a 400 naming the field.
    """
    from rest_framework.exceptions import ValidationError

    from agents.protocol import ProtocolError, parse

    try:
        return parse(message_class, request.data)
    except ProtocolError as exc:
        raise ValidationError({exc.field or "body": [exc.reason]}) from None


def require_hooks_caller(request, job, generation: int | None = None) -> None:
    """Whether the caller may speak for ``generation`` of ``job`` on the training hooks' endpoints
    (without ``generation``: for some generation of ``job``, checked before the body is read).

    A job token speaks only for its own job and generation; an agent token only for a generation
    placed on its node. Anything else is a 403, before the body is acted on. (A job token of an
    older generation, not yet revoked, meets the fencing rule next: 409 stale.)
    """
    from rest_framework.exceptions import PermissionDenied

    from controlplane.models import Scope
    from jobs.models import Generation

    token = request.auth if isinstance(request.auth, ApiToken) else None
    if token is not None and token.scope == Scope.JOB:
        if token.job_id != job.pk:
            raise PermissionDenied(f"This token speaks for job {token.job_id} only, not job {job.pk}.")
        if generation is not None and token.generation != generation:
            raise PermissionDenied(f"This token speaks for generation {token.generation} of job {job.pk} only, "
                                   f"not generation {generation}.")
        return
    node = token.node if token is not None and token.scope == Scope.AGENT else None
    placed = Generation.objects.filter(job=job, nodes=node) if node is not None else Generation.objects.none()
    if generation is not None:
        placed = placed.filter(number=generation)
    if not placed.exists():
        which = "any generation" if generation is None else f"generation {generation}"
        raise PermissionDenied(f"This token speaks neither for {which} of job {job.pk} nor for a node it is "
                               f"placed on.")


def choices_param(params, name: str, allowed) -> list[str] | None:
    """A comma-separated filter of enum values (``?state=running,paused``); an unknown value is a 400
    naming it, never an empty page that looks like "nothing matched"."""
    from rest_framework.exceptions import ValidationError

    raw = params.get(name)
    if raw is None or raw == "":
        return None
    values = raw.split(",")
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ValidationError({name: [f"unknown value {unknown[0]!r}; use one of {', '.join(sorted(allowed))}"]})
    return values


def int_param(params, name: str, *, minimum: int = 0) -> int | None:
    """An integer query filter; anything else is a 400 naming the parameter."""
    from rest_framework.exceptions import ValidationError

    raw = params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError({name: ["must be an integer"]}) from None
    if value < minimum or value > 2**63 - 1:
        raise ValidationError({name: [f"must be between {minimum} and {2**63 - 1}"]})
    return value


def datetime_param(params, name: str):
    """An ISO 8601 timestamp filter (``?since=2026-11-30T18:00:00Z``)."""
    from django.utils.dateparse import parse_datetime
    from rest_framework.exceptions import ValidationError

    raw = params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = parse_datetime(raw)
    except ValueError:
        value = None
    if value is None:
        raise ValidationError({name: ["must be an ISO 8601 date and time, e.g. 2026-11-30T18:00:00Z"]})
    if timezone.is_naive(value):
        value = timezone.make_aware(value, UTC)
    return value


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, refusing text PostgreSQL cannot store: a lone UTF-16 surrogate (``"\\udb8e"``
    is valid JSON, but no UTF-8) would otherwise pass validation and fail as a 500 on save."""

    def parse(self, stream, media_type=None, parser_context=None):
        data = super().parse(stream, media_type, parser_context)
        if (where := _unencodable(data)) is not None:
            raise exceptions.ParseError(f"JSON parse error - {where or 'the body'} holds a lone surrogate "
                                        "(\\ud800-\\udfff), which is not text.")
        return data


def _unencodable(value, path: str = "") -> str | None:
    """The dotted path of the first string (or key) that is not valid Unicode text, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = f"{path}.{key}" if path else str(key)
            if _unencodable(key) is not None:
                return path or "a key"
            if (found := _unencodable(item, name)) is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if (found := _unencodable(item, f"{path}.{index}" if path else str(index))) is not None:
                return found
    return None
