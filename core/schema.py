"""The OpenAPI document (drf-spectacular): bearer tokens, the capability each operation needs, and
the problem-details errors every operation can answer.

Views declare what they need (``required``, see ``core.auth.Requires``); this module turns
that into the words and the error responses of the document, so the two never drift apart. The
bodies of the agent and hooks endpoints are the wire protocol's dataclasses (``agents.protocol``):
``protocol_schema(Message)`` stands for one in ``extend_schema``, and its JSON schema is generated from the
dataclass's fields and their constraints, so the document says what ``parse`` enforces. The
schemathesis test (``tests/api/test_schemathesis.py``) holds the server to what is written here.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

from drf_spectacular.extensions import OpenApiAuthenticationExtension, OpenApiSerializerExtension
from drf_spectacular.openapi import AutoSchema as BaseAutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from rest_framework import permissions, serializers

from agents.protocol.base import INT64_MAX, INT64_MIN, NONFINITE
from core import roles

#: capability -> the token scopes that can carry it (a token never outranks its owner's role)
_HOLDERS = {cap: sorted(scope for scope, caps in roles.SCOPE_CAPABILITIES.items() if cap in caps)
            for cap in set().union(*roles.SCOPE_CAPABILITIES.values())}
_PEOPLE = {roles.VIEW: "viewer, operator and oncall", roles.LAUNCH: "operator and oncall",
           roles.OPERATE: "operator and oncall", roles.DRAIN: "operator and oncall", roles.APPROVE: "oncall"}


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "core.auth.TokenAuthentication"
    name = "bearerToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API token (`nw_…`) with scope viewer, ci, operator, oncall, agent, job or bootstrap. "
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
    """The capability ``core.auth.Requires`` demands for ``method`` on ``view`` (None: open)."""
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
            auth = ("**Authorisation:** any bearer token except a bootstrap or job token; it is the token "
                    "rotated.")
        elif capability == roles.AGENT:
            auth = "**Authorisation:** an `agent` token, acting only for its own node."
        elif capability == roles.HOOKS:
            auth = ("**Authorisation:** the `hooks` capability — the generation's `job` token, or the `agent` token "
                    "of a node the generation is placed on; for that generation only.")
        elif capability in _PEOPLE:
            auth = (f"**Authorisation:** the `{capability}` capability — token scopes "
                    f"{', '.join(_HOLDERS[capability])}; signed-in {_PEOPLE[capability]}.")
        else:  # a machine capability: tokens only
            auth = (f"**Authorisation:** the `{capability}` capability — token scopes "
                    f"{', '.join(_HOLDERS.get(capability, []))}.")
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


# --- the wire protocol's messages -----------------------------------------------------------------

class WireMessage(serializers.Serializer):
    """Stands for the ``agents.protocol`` dataclass ``message`` in the document (never used to parse:
    the views call ``agents.protocol.parse``)."""

    message: type


@functools.cache
def protocol_schema(message: type) -> type[WireMessage]:
    """The stand-in of ``message`` for ``extend_schema(request=..., responses=...)``."""
    return type(f"Wire{message.__name__}", (WireMessage,), {"message": message, "__module__": __name__})


class WireMessageSchema(OpenApiSerializerExtension):
    target_class = WireMessage
    match_subclasses = True

    def get_name(self, auto_schema, direction):
        return _component_name(self.target.message)

    def map_serializer(self, auto_schema, direction):
        return _object_schema(self.target.message, auto_schema.registry)


def _component_name(message: type) -> str:
    return f"Wire{message.__name__}"


def _object_schema(message: type, registry) -> dict:
    hints = typing.get_type_hints(message)
    fields = dataclasses.fields(message)
    schema = {
        "type": "object",
        "properties": {f.name: _field_schema(hints[f.name], f.metadata, registry) for f in fields},
        "required": [f.name for f in fields
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING],
        "additionalProperties": False,
    }
    doc = (message.__doc__ or "").strip()
    if doc and not doc.startswith(f"{message.__name__}("):  # not the signature dataclasses make up
        schema["description"] = doc
    if not schema["required"]:
        del schema["required"]
    return schema


def _field_schema(tp, meta: typing.Mapping, registry) -> dict:
    """The JSON schema of one field: the same type and constraints ``agents.protocol.base`` checks."""
    if tp is typing.Any:
        return {}
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = _field_schema(next(t for t in typing.get_args(tp) if t is not type(None)), meta, registry)
        if not inner:
            return inner
        return {"allOf": [inner], "nullable": True} if "$ref" in inner else {**inner, "nullable": True}
    if typing.get_origin(tp) is list:
        return _bounded({"type": "array", "items": _field_schema(typing.get_args(tp)[0], {}, registry)},
                        maxItems=meta.get("max_len"))
    if typing.get_origin(tp) is dict:
        return _dict_schema(_field_schema(typing.get_args(tp)[1], {}, registry), meta)
    if dataclasses.is_dataclass(tp):
        component = ResolvedComponent(name=_component_name(tp), type=ResolvedComponent.SCHEMA,
                                      object=protocol_schema(tp), schema=None)
        if component not in registry:
            registry.register(component)  # first, so that a message nesting itself would end here
            component.schema = _object_schema(tp, registry)
        return component.ref
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return _bounded({"type": "integer", "format": "int64"},
                        minimum=max(meta.get("min") if meta.get("min") is not None else INT64_MIN, INT64_MIN),
                        maximum=min(meta.get("max") if meta.get("max") is not None else INT64_MAX, INT64_MAX))
    if tp is float:
        number = _bounded({"type": "number", "format": "double"}, minimum=meta.get("min"), maximum=meta.get("max"))
        if meta.get("nonfinite"):  # NaN and infinities travel as strings
            return {"oneOf": [number, {"type": "string", "enum": sorted(NONFINITE)}]}
        return number
    if tp is str:
        choices = meta.get("choices")
        return _bounded({"type": "string"}, maxLength=meta.get("max_len"),
                        enum=sorted(choices) if choices else None,
                        pattern=f"^(?:{meta['pattern']})$" if meta.get("pattern") else None)
    raise TypeError(f"no JSON schema for {tp!r}")  # pragma: no cover - schema authoring error


def _dict_schema(values: dict, meta: typing.Mapping) -> dict:
    """``dict[str, X]``: any keys, or only the ``choices`` when the field names them."""
    if meta.get("choices"):
        return _bounded({"type": "object", "properties": {key: values for key in sorted(meta["choices"])},
                         "additionalProperties": False}, maxProperties=meta.get("max_len"))
    return _bounded({"type": "object", "additionalProperties": values}, maxProperties=meta.get("max_len"))


def _bounded(schema: dict, **bounds) -> dict:
    return {**schema, **{k: v for k, v in bounds.items() if v is not None}}
