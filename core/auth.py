"""Who is calling, and what they may do.

A caller is a person (session or a token owned by a user) or a machine (an agent token bound to
one node, or a one-time bootstrap token). What they may do is a set of *capabilities*
(``core.roles``): for a person, those their role grants; for a token, those its scope
grants, never more than its owner's role. Views declare the capability each method requires.
"""

from __future__ import annotations

import functools
import ipaddress

from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.core.cache import cache
from django.db import connections
from django.utils import timezone
from rest_framework import authentication, exceptions, permissions, throttling

from core import roles
from core.models import ApiToken, Scope, hash_token

AUTH_FAILURE_WINDOW_S = 60


def client_address(request) -> str | None:
    """The address of the client that sent ``request``: the one key of every per-address limit
    (failed tokens, registration, login lockouts through django-axes).

    ``REMOTE_ADDR`` is the direct peer. Only when that peer is a trusted proxy
    (``NIGHTWATCH["TRUSTED_PROXIES"]``) does ``X-Forwarded-For`` count, read from the right: each
    trusted proxy appends the address it was reached from, so the right-most address that is not a
    trusted proxy is the client, and everything left of it was written by the client itself. An
    entry that is not an address ends the walk at the nearest trusted hop, which the client cannot
    choose. None when the server was not told (a Unix socket).
    """
    peer = request.META.get("REMOTE_ADDR") or None
    trusted = trusted_proxies()
    if peer is None or not _within(peer, trusted):
        return peer
    nearest = peer
    for hop in reversed(request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")):
        address = _address(hop.strip())
        if address is None:
            return nearest
        if not _within(address, trusted):
            return address
        nearest = address
    return nearest


def trusted_proxies() -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``NIGHTWATCH["TRUSTED_PROXIES"]`` parsed (system check nightwatch.E004 refuses a bad entry)."""
    return _networks(tuple(settings.NIGHTWATCH["TRUSTED_PROXIES"]))


@functools.lru_cache(maxsize=8)
def _networks(cidrs: tuple[str, ...]):
    return tuple(ipaddress.ip_network(cidr.strip(), strict=False) for cidr in cidrs)


def _address(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def _within(address: str, networks) -> bool:
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(parsed in network for network in networks)


def _failure_key(request) -> str:
    return f"auth-failures:{client_address(request) or 'unknown'}"


class TokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer nw_…``. Sets ``request.auth`` to the ApiToken.

    A valid token is always accepted, whatever its address has sent before: behind a shared TLS
    proxy or NAT, a stranger's bad tokens must never lock out agents and CI pipelines. A bad token
    from an address that has already failed ``AUTH_FAILURES_PER_MINUTE`` times this minute is
    answered 429 instead of 401. Tokens carry 256 random bits, so it is not the limit that stops
    guessing; it keeps a misconfigured or hostile client's failures cheap and loud.
    """

    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        try:
            return self._authenticate(header)
        except exceptions.AuthenticationFailed:
            _refuse_if_over_limit(request)
            _count_failure(request)
            raise

    def _authenticate(self, header):
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Malformed Authorization header: expected 'Bearer <token>'.")
        try:
            raw = header[1].decode()
        except UnicodeError:
            raise exceptions.AuthenticationFailed("The token contains invalid characters.") from None
        token = usable_token(hash_token(raw))
        if token is None:
            raise exceptions.AuthenticationFailed("Unknown, revoked or expired token.")
        if token.user is not None and not token.user.is_active:
            raise exceptions.AuthenticationFailed("The token's user is inactive.")
        now = timezone.now()
        # Avoid a write per request: refresh the last-use stamp at most once a minute.
        if token.last_used_at is None or (now - token.last_used_at).total_seconds() > 60:
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return (token.user or AnonymousUser(), token)

    def authenticate_header(self, request):
        return self.keyword


#: The relations every authenticated request reads (``ApiToken.objects.select_related(*_JOINED)``).
_JOINED = ("user", "node")


def usable_token(digest: str) -> ApiToken | None:
    """``ApiToken.objects.usable().select_related("user", "node").filter(digest=digest).first()``, in one
    statement compiled once per process rather than once per request.

    Every agent heartbeat, telemetry batch and hooks report is authenticated, and Django spends
    ~1.5 ms compiling that joined query (the node row alone has ~40 columns) against ~0.5 ms for the
    database to answer it; 1,024 agents send over 200 authenticated requests a second. The rows come
    back through each field's own converters (``_converters``) and the joined objects are cached on
    the token exactly as ``select_related`` caches them. ``tests/core/test_token_lookup.py`` holds it
    to the ORM query's answer."""
    sql, parts = _token_select()
    connection = connections[ApiToken.objects.db]
    with connection.cursor() as cursor:
        cursor.execute(sql, [digest, timezone.now()])
        row = cursor.fetchone()
    if row is None:
        return None
    objects, start = [], 0
    for model, fields, converters in parts:
        values = [_converted(value, column_converters, connection)
                  for (column_converters, value) in zip(converters, row[start:start + len(fields)])]
        start += len(fields)
        objects.append(model.from_db(connection.alias, [f.attname for f in fields], values)
                       if values[0] is not None else None)
    token = objects[0]
    for name, joined in zip(_JOINED, objects[1:]):
        ApiToken._meta.get_field(name).set_cached_value(token, joined)
    return token


@functools.cache
def _token_select():
    """The statement of ``usable_token`` and, per model in its row, the fields it reads (primary key first)
    with each field's converters (the backend's and the field's own, as the ORM's compiler finds them)."""
    token = ApiToken._meta
    parts = [(ApiToken, _fields(ApiToken))]
    joins = []
    for i, name in enumerate(_JOINED):
        relation = token.get_field(name)
        model = relation.related_model
        parts.append((model, _fields(model)))
        joins.append(f"LEFT OUTER JOIN {_q(model._meta.db_table)} j{i} "
                     f"ON j{i}.{_q(model._meta.pk.column)} = t.{_q(relation.column)}")
    columns = [f"t.{_q(f.column)}" for f in parts[0][1]]
    for i, (_, fields) in enumerate(parts[1:]):
        columns += [f"j{i}.{_q(f.column)}" for f in fields]
    where = (f"t.{_q(token.get_field('digest').column)} = %s AND t.{_q(token.get_field('revoked_at').column)} IS NULL "
             f"AND (t.{_q(token.get_field('expires_at').column)} IS NULL "
             f"OR t.{_q(token.get_field('expires_at').column)} > %s)")
    order = f"ORDER BY t.{_q(token.pk.column)} LIMIT 1"
    # Only names from the models are formatted in; every value is a parameter.
    sql = f"SELECT {', '.join(columns)} FROM {_q(token.db_table)} t {' '.join(joins)} WHERE {where} {order}"  # noqa: S608
    connection = connections[ApiToken.objects.db]
    return sql, [(model, fields, [_converters(field, connection) for field in fields]) for model, fields in parts]


def _fields(model) -> list:
    concrete = list(model._meta.concrete_fields)
    return [model._meta.pk] + [f for f in concrete if f is not model._meta.pk]


def _q(name: str) -> str:
    return connections[ApiToken.objects.db].ops.quote_name(name)


def _converters(field, connection) -> list:
    column = field.get_col(field.model._meta.db_table)
    found = connection.ops.get_db_converters(column) + field.get_db_converters(connection)
    return [(convert, column) for convert in found]


def _converted(value, converters: list, connection):
    """A raw column value as the ORM would hand it to the model."""
    for convert, column in converters:
        value = convert(value, column, connection)
    return value


def _refuse_if_over_limit(request) -> None:
    limit = settings.NIGHTWATCH["AUTH_FAILURES_PER_MINUTE"]
    if (cache.get(_failure_key(request)) or 0) >= limit:
        raise exceptions.Throttled(AUTH_FAILURE_WINDOW_S, detail=f"Too many failed authentications from "
                                                                 f"this address (limit {limit} a minute).")


def _count_failure(request) -> None:
    key = _failure_key(request)
    if not cache.add(key, 1, timeout=AUTH_FAILURE_WINDOW_S):
        try:
            cache.incr(key)
        except ValueError:  # expired between add and incr
            cache.add(key, 1, timeout=AUTH_FAILURE_WINDOW_S)


class AgentThrottle(throttling.SimpleRateThrottle):
    """Per node token: a runaway agent (a retry loop, a replayed spool) cannot flood the ingest path."""

    scope = "agent"

    def get_cache_key(self, request, view):
        token = getattr(request, "auth", None)
        if not isinstance(token, ApiToken):
            return None
        return self.cache_format % {"scope": self.scope, "ident": f"token-{token.pk}"}


class RegisterThrottle(throttling.SimpleRateThrottle):
    """Per address: bootstrap tokens are one-time, but guessing them should still be slow."""

    scope = "register"

    def get_cache_key(self, request, view):
        return self.cache_format % {"scope": self.scope, "ident": client_address(request) or "unknown"}


def capabilities(request) -> set[str]:
    """Every capability the caller of ``request`` holds."""
    token = request.auth if isinstance(getattr(request, "auth", None), ApiToken) else None
    user = request.user
    if token is not None:
        granted = set(roles.SCOPE_CAPABILITIES.get(token.scope, ()))
        if token.user is None:
            return granted
        return {cap for cap in granted if _person_may(token.user, cap)}
    if user is None or not user.is_authenticated:
        return set()
    return {cap for cap in roles.CAPABILITY_PERMISSIONS if _person_may(user, cap)}


def _person_may(user, capability: str) -> bool:
    perm = roles.CAPABILITY_PERMISSIONS.get(capability)
    return perm is not None and user.has_perm(perm)


def calling_node(request):
    """The node an agent token acts for, or None."""
    token = getattr(request, "auth", None)
    if isinstance(token, ApiToken) and token.scope == "agent":
        return token.node
    return None


class Requires(permissions.BasePermission):
    """Checks ``view.required`` — a capability, or a dict method -> capability (default: view).

    Anonymous callers get 401, authenticated callers lacking the capability get 403.
    """

    def has_permission(self, request, view):
        required = getattr(view, "required", roles.VIEW)
        if isinstance(required, dict):
            required = required.get(request.method, required.get("*", roles.VIEW))
        held = capabilities(request)
        if required in held:
            return True
        if not held and not (request.user and request.user.is_authenticated) and request.auth is None:
            raise exceptions.NotAuthenticated()
        self.message = f"This action needs the '{required}' capability, which your credentials do not grant."
        return False


def actor_label(request) -> str:
    """How the audit log names the caller: ``user:alice``, ``token:ci-main``, ``node:gpu-01``, or
    ``job:7/g3@gpu-01`` for the training processes of a generation (user code, not the node's agent)."""
    token = getattr(request, "auth", None)
    if isinstance(token, ApiToken):
        if token.scope == Scope.JOB:
            return f"job:{token.job_id}/g{token.generation}" + (f"@{token.node.hostname}" if token.node_id else "")
        if token.node_id:
            return f"node:{token.node.hostname}"
        who = token.user.get_username() if token.user else "-"
        return f"token:{token.name}({who})"
    if request.user and request.user.is_authenticated:
        return f"user:{request.user.get_username()}"
    return "anonymous"
