"""The OpenAPI document (drf-spectacular): bearer tokens, the capability each operation needs, and
the problem-details errors every operation can answer.

Views declare what they need (``required``, see ``controlplane.auth.Requires``); this module turns
that into the words and the error responses of the document, so the two never drift apart. The
schemathesis test (``tests/api/test_schemathesis.py``) holds the server to what is written here.
"""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema as BaseAutoSchema
from rest_framework import permissions, serializers

from controlplane import roles

#: capability -> the token scopes that can carry it (a token never outranks its owner's role)
_HOLDERS = {cap: sorted(scope for scope, caps in roles.SCOPE_CAPABILITIES.items() if cap in caps)
            for cap in (roles.VIEW, roles.LAUNCH, roles.OPERATE, roles.DRAIN, roles.APPROVE, roles.AGENT)}
_PEOPLE = {roles.VIEW: "viewer, operator and oncall", roles.LAUNCH: "operator and oncall",
           roles.OPERATE: "operator and oncall", roles.DRAIN: "operator and oncall", roles.APPROVE: "oncall"}


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.auth.TokenAuthentication"
    name = "bearerToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API token (`nw_…`) with scope viewer, ci, operator, oncall, agent or bootstrap. "
            "Issue one with `manage.py nightwatch_token issue`. Repeated failures from one address are "
            "answered 429 for a while.",
        }


class ProblemErrorSerializer(serializers.Serializer):
    field = serializers.CharField(help_text="Dotted path of the offending field ('' for the whole body).")
    reason = serializers.CharField()


class ProblemSerializer(serializers.Serializer):
    """RFC 9457 problem details, as every error of this API is answered (``application/problem+json``)."""

    type = serializers.CharField(help_text="https://nightwatch.dev/problems/<code>")
    title = serializers.CharField()
    status = serializers.IntegerField()
    detail = serializers.CharField()
    instance = serializers.CharField(required=False, help_text="The request path.")
    errors = ProblemErrorSerializer(many=True, required=False, help_text="One entry per invalid field.")


_ERRORS = {
    400: "Invalid request: a field, a query parameter or the JSON body is malformed (each named in `errors`).",
    401: "No credentials, or an unknown, revoked or expired token.",
    403: "The credentials lack the capability this operation needs, or act for another node.",
    404: "No such object.",
    405: "The method is not allowed on this path.",
    406: "The Accept header asks for something other than JSON.",
    409: "The object's current state forbids it (the detail says why), or the generation is stale.",
    413: "The body is larger than the server accepts.",
    415: "The body is not JSON.",
    422: "The request is well-formed but cannot be processed (the detail says why).",
    429: "Too many requests (authentication failures, or an agent sending too fast); retry after Retry-After.",
}


def required_capability(view, method: str) -> str | None:
    """The capability ``controlplane.auth.Requires`` demands for ``method`` on ``view`` (None: open)."""
    if any(isinstance(p, permissions.AllowAny) for p in view.get_permissions()):
        return None
    required = getattr(view, "required", roles.VIEW)
    if isinstance(required, dict):
        required = required.get(method, required.get("*", roles.VIEW))
    return required


class AutoSchema(BaseAutoSchema):
    """drf-spectacular's schema plus the required capability and the problem responses."""

    def get_description(self):
        description = super().get_description() or ""
        capability = required_capability(self.view, self.method)
        if capability is None:
            auth = "**Authorisation:** none (the body carries a one-time bootstrap token)."
        elif capability == "token":
            auth = "**Authorisation:** any bearer token except a bootstrap token; it is the token rotated."
        elif capability == roles.AGENT:
            auth = ("**Authorisation:** an `agent` token, acting only for its own node (and for jobs that node "
                    "runs).")
        else:
            auth = (f"**Authorisation:** the `{capability}` capability — token scopes "
                    f"{', '.join(_HOLDERS[capability])}; signed-in {_PEOPLE[capability]}.")
        return f"{description}\n\n{auth}".strip()

    def get_extensions(self):
        extensions = dict(super().get_extensions() or {})
        extensions["x-required-capability"] = required_capability(self.view, self.method)
        return extensions

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        problem = self.resolve_serializer(ProblemSerializer, "response").ref
        codes = [400, 401, 403, 405, 406, 429]
        if "{" in self.path:
            codes.append(404)
        if self.method in ("POST", "PUT", "PATCH", "DELETE"):
            codes += [409, 413, 415]
        for code in sorted(codes):
            existing = responses.get(str(code)) or {}
            responses[str(code)] = {
                "description": existing.get("description") or _ERRORS[code],
                "content": {"application/problem+json": {"schema": problem}},
            }
        for code, existing in responses.items():  # declared in a view without a body: the same problem shape
            if code.isdigit() and int(code) >= 400 and "content" not in existing:
                existing["content"] = {"application/problem+json": {"schema": problem}}
        return responses
