"""``POST /api/v1/tokens/rotate``: a token rotates itself (agents and CI pipelines on a schedule);
and the job tokens of training processes: minted per (job, generation, node), revoked with it.

Kept apart from ``core.api``, which DRF's settings import (pagination) before views exist.
"""

from __future__ import annotations

import base64
from datetime import timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.crypto import get_random_string, salted_hmac
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions, permissions, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core.auth import actor_label
from core.events import EventKind, record_event
from core.models import TOKEN_PREFIX, ApiToken, Scope, hash_token
from core.problems import Unprocessable

#: After a job ends (cancelled, failed, completed) its tokens live this much longer, so that the
#: hooks of ranks still stopping hear "stale" (409) and stop cleanly; then they expire even if a
#: node never confirms the stop. Confirmed stops revoke them at once.
TERMINAL_JOB_TOKEN_GRACE = timedelta(minutes=10)
_JOB_TOKEN_SALT = "nightwatch.job-token"  # noqa: S105 - an HMAC domain label; the key is SECRET_KEY


def job_token_for(job, generation: int, node) -> str:
    """The raw job token of ``generation`` of ``job`` on ``node``, minted on first use.

    A launch command is re-sent until the agent acknowledges it, and the agent runs the first copy
    it gets; so every copy must carry the same token, and the database must not hold it in clear
    (command payloads are stored). The raw value is therefore derived from ``SECRET_KEY`` and the
    token's row: the row stores only its SHA-256, and only the control plane can re-derive it.
    """
    with transaction.atomic():
        minted = (ApiToken.objects.usable().select_for_update()
                  .filter(scope=Scope.JOB, job=job, generation=generation, node=node).order_by("pk"))
        # One minted under an earlier SECRET_KEY cannot be re-derived: a fresh one is minted beside
        # it (the old one may already be in use; both die with the generation).
        token = next((t for t in minted if hash_token(_derived(t.pk)) == t.digest), None)
        if token is None:
            token = _mint(job, generation, node)
    return _derived(token.pk)


def _mint(job, generation: int, node) -> ApiToken:
    # The digest is known only once the row has its primary key: a random placeholder first.
    token = ApiToken.objects.create(name=f"job {job.pk} gen {generation} on {node.hostname}"[:100], scope=Scope.JOB,
                                    digest=get_random_string(64), prefix="", job=job, generation=generation,
                                    node=node)
    raw = _derived(token.pk)
    ApiToken.objects.filter(pk=token.pk).update(digest=hash_token(raw), prefix=raw[:10])
    return token


def _derived(token_pk: int) -> str:
    mac = salted_hmac(_JOB_TOKEN_SALT, f"token:{token_pk}", algorithm="sha256").digest()
    return TOKEN_PREFIX + base64.urlsafe_b64encode(mac).decode().rstrip("=")


def revoke_generation_tokens(job_id: int, generations) -> int:
    """Revoke the job tokens of ``generations`` (numbers) of a job: those generations ended."""
    return ApiToken.objects.filter(scope=Scope.JOB, job_id=job_id, generation__in=list(generations),
                                   revoked_at__isnull=True).update(revoked_at=timezone.now())


def retire_job_tokens(job_id: int) -> int:
    """The job ended: its tokens expire within ``TERMINAL_JOB_TOKEN_GRACE`` (sooner if revoked)."""
    cap = timezone.now() + TERMINAL_JOB_TOKEN_GRACE
    return ApiToken.objects.filter(scope=Scope.JOB, job_id=job_id, revoked_at__isnull=True).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=cap)).update(expires_at=cap)


class TokenRotation:
    """``POST /api/v1/tokens/rotate``: the calling token is revoked and its replacement returned once.

    Lets an agent or a CI pipeline rotate its own credential on a schedule without a person with
    shell access (``manage.py nightwatch_token rotate`` does the same for an operator). The new
    token keeps the name, scope, owner, node and expiry; only its SHA-256 is stored. Only the
    holder rotates a token, so a node's agent token is rotated by that agent alone; job tokens
    die with their generation and never rotate.
    """

    @staticmethod
    def rotate(token: ApiToken, *, actor: str) -> tuple[ApiToken, str]:
        """Revoke ``token`` and issue its successor, in one transaction, with an audit event."""
        with transaction.atomic():
            locked = ApiToken.objects.select_for_update().get(pk=token.pk)
            if locked.revoked_at is not None:
                raise Unprocessable("This token was already rotated or revoked.")
            locked.revoke()
            new, raw = locked.successor()
            record_event(EventKind.TOKEN_ROTATE, actor=actor, node=locked.node,
                         reason=f"token {locked.name!r} ({locked.scope}) rotated itself",
                         evidence={"old_prefix": locked.prefix, "new_prefix": new.prefix})
            return new, raw


class RotatedTokenSerializer(serializers.Serializer):
    token = serializers.CharField(help_text="The new raw token. Shown once: store it now.")
    name = serializers.CharField()
    scope = serializers.CharField()
    prefix = serializers.CharField(help_text="Its first characters, as listings show it.")
    expires_at = serializers.DateTimeField(allow_null=True)


class CallerHasRotatableToken(permissions.BasePermission):
    message = ("Only a bearer token can rotate itself (a session, a one-time bootstrap token or a job token "
               "cannot).")

    def has_permission(self, request, view):
        token = request.auth
        if token is None and not (request.user and request.user.is_authenticated):
            raise exceptions.NotAuthenticated()
        return isinstance(token, ApiToken) and token.scope not in (Scope.BOOTSTRAP, Scope.JOB)


class TokenRotate(APIView):
    """Revoke the calling token and issue its replacement (same name, scope, owner, node, expiry)."""

    permission_classes = [CallerHasRotatableToken]
    required = "token"  # for the schema: any bearer token but a bootstrap or job one

    @extend_schema(request=None, responses={
        201: RotatedTokenSerializer,
        422: OpenApiResponse(description="The token was rotated or revoked by a concurrent request.")})
    def post(self, request):
        token, raw = TokenRotation.rotate(request.auth, actor=actor_label(request))
        return Response(RotatedTokenSerializer({"token": raw, "name": token.name, "scope": token.scope,
                                                "prefix": token.prefix, "expires_at": token.expires_at}).data,
                        status=201)
