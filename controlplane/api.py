"""API conventions shared by every app: pagination and ``Idempotency-Key`` handling."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
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
    if not key or len(key) > MAX_KEY_LENGTH:
        raise Unprocessable(f"{IDEMPOTENCY_HEADER} must be 1-{MAX_KEY_LENGTH} characters.")
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


def require_node_of_job(request, job) -> None:
    """An agent token may act for a job only if its node ran one of the job's generations."""
    from rest_framework.exceptions import PermissionDenied

    from controlplane.auth import calling_node

    node = calling_node(request)
    if node is None or not job.generations.filter(nodes=node).exists():
        raise PermissionDenied("This node runs no generation of this job.")
