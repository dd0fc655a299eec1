"""``POST /api/v1/tokens/rotate``: a token rotates itself (agents and CI pipelines on a schedule).

Kept apart from ``controlplane.api``, which DRF's settings import (pagination) before views exist.
"""

from __future__ import annotations

from django.db import transaction
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions, permissions, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.auth import actor_label
from controlplane.models import ApiToken
from controlplane.problems import Unprocessable


class TokenRotation:
    """``POST /api/v1/tokens/rotate``: the calling token is revoked and its replacement returned once.

    Lets an agent or a CI pipeline rotate its own credential on a schedule without a person with
    shell access (``manage.py nightwatch_token rotate`` does the same for an operator). The new
    token keeps the name, scope, owner and node; only its SHA-256 is stored.
    """

    @staticmethod
    def rotate(token: ApiToken, *, actor: str) -> tuple[ApiToken, str]:
        """Revoke ``token`` and issue its successor, in one transaction, with an audit event."""
        from jobs.models import Event

        with transaction.atomic():
            locked = ApiToken.objects.select_for_update().get(pk=token.pk)
            if locked.revoked_at is not None:
                raise Unprocessable("This token was already rotated or revoked.")
            locked.revoke()
            new, raw = ApiToken.issue(name=locked.name, scope=locked.scope, user=locked.user, node=locked.node,
                                      single_use=locked.single_use, expires_at=locked.expires_at)
            Event.objects.create(kind="token.rotate", actor=actor, node=locked.node,
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
    message = "Only a bearer token can rotate itself (a session or a one-time bootstrap token cannot)."

    def has_permission(self, request, view):
        token = request.auth
        if token is None and not (request.user and request.user.is_authenticated):
            raise exceptions.NotAuthenticated()
        return isinstance(token, ApiToken) and token.scope != "bootstrap"


class TokenRotate(APIView):
    """Revoke the calling token and issue its replacement (same name, scope, owner, node, expiry)."""

    permission_classes = [CallerHasRotatableToken]
    required = "token"  # for the schema: any bearer token but a bootstrap one

    @extend_schema(request=None, responses={
        201: RotatedTokenSerializer,
        422: OpenApiResponse(description="The token was rotated or revoked by a concurrent request.")})
    def post(self, request):
        token, raw = TokenRotation.rotate(request.auth, actor=actor_label(request))
        return Response(RotatedTokenSerializer({"token": raw, "name": token.name, "scope": token.scope,
                                                "prefix": token.prefix, "expires_at": token.expires_at}).data,
                        status=201)
