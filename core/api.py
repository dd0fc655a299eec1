"""API conventions shared by every app: pagination and ``Idempotency-Key`` handling."""

from __future__ import annotations

import codecs
import hashlib
import json
import math
from collections.abc import Callable
from datetime import UTC, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from rest_framework import exceptions, parsers
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response

from agents.protocol import ProtocolError, parse
from core.models import ApiToken, IdempotencyRecord
from core.problems import Unprocessable

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
    try:
        return parse(message_class, request.data)
    except ProtocolError as exc:
        raise ValidationError({exc.field or "body": [exc.reason]}) from None


def choices_param(params, name: str, allowed) -> list[str] | None:
    """A comma-separated filter of enum values (``?state=running,paused``); an unknown value is a 400
    naming it, never an empty page that looks like "nothing matched"."""
    raw = params.get(name)
    if raw is None or raw == "":
        return None
    values = raw.split(",")
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ValidationError({name: [f"unknown value {unknown[0]!r}; use one of {', '.join(sorted(allowed))}"]})
    return values


def int_param(params, name: str, *, minimum: int = 0, required: bool = False) -> int | None:
    """An integer query parameter; anything else is a 400 naming the parameter."""
    raw = params.get(name)
    if raw is None or raw == "":
        if required:
            raise ValidationError({name: ["required, an integer"]})
        return None
    value = parse_int(raw)
    if value is None:
        raise ValidationError({name: ["must be an integer"]})
    if value < minimum or value > 2**63 - 1:
        raise ValidationError({name: [f"must be between {minimum} and {2**63 - 1}"]})
    return value


def parse_int(raw: str) -> int | None:
    """``raw`` as an integer if it is one written in ASCII digits (an optional leading ``-``), else None.

    ``str.isdigit()`` admits ``²`` (which ``int()`` refuses) and ``int()`` admits ``١٢``, `` 12 ``
    and ``1_000``: neither is how a client writes a number, so both are refused here.
    """
    digits = raw[1:] if raw.startswith("-") else raw
    if not (digits.isascii() and digits.isdecimal()):
        return None
    try:
        return int(raw)
    except ValueError:  # more digits than Python converts (4,300)
        return None


def datetime_param(params, name: str):
    """An ISO 8601 timestamp filter (``?since=2026-11-30T18:00:00Z``)."""
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
    """DRF's JSON parser, refusing (400) what would pass validation and then fail as a 500 on the way
    to PostgreSQL or through Python's own limits:

    - ``NaN``/``Infinity`` and number literals beyond the float range (``1e400`` reads as infinity);
    - nesting deeper than ``MAX_JSON_DEPTH`` (Python's recursion limit would turn it into a 500);
    - NUL characters (no PostgreSQL text or jsonb value can hold one) and lone UTF-16 surrogates
      (``"\\udb8e"`` is valid JSON, but no UTF-8), anywhere in the body, keys included.
    """
    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            data = json.load(codecs.getreader(encoding)(stream), parse_constant=_refuse_constant,
                             parse_float=_finite_float)
        except RecursionError:
            raise exceptions.ParseError(f"JSON parse error - nested more than {MAX_JSON_DEPTH} levels deep.") from None
        except ValueError as exc:
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None
        if (refusal := refusal_of(data)) is not None:
            where, reason = refusal
            raise exceptions.ParseError(f"JSON parse error - {where or 'the body'} {reason}.")
        return data


#: Deeper than any message of this API needs (the deepest, a manifest's entry, is under 10).
MAX_JSON_DEPTH = 64


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is beyond the range of a 64-bit float")
    return value


def refusal_of(data) -> tuple[str, str] | None:
    """``(dotted path, reason)`` of the first value PostgreSQL cannot store or that nests too deep.

    Iterative, so that the walk itself never meets the recursion limit it guards against.
    """
    stack = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if (reason := _bad_text(value)) is not None:
                return path, reason
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                return path, f"is nested more than {MAX_JSON_DEPTH} levels deep"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                name = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and (reason := _bad_text(key)) is not None:
                    return path or "the body", f"has a key that {reason}"
                stack.append((item, name, depth + 1))
    return None


def _bad_text(text: str) -> str | None:
    if "\x00" in text:
        return "holds a NUL character (\\u0000), which is not allowed in text"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone surrogate (\\ud800-\\udfff), which is not text"
    return None
