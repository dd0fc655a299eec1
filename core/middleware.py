"""The HTTP boundary: ids for the logs, body-size limits, security headers of API answers and pages."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.core.signals import request_finished
from django.http import JsonResponse
from django.urls import Resolver404, resolve

from agents.jsonlog import start_context
from core.problems import CONTENT_TYPE, problem

#: URL keyword -> log field, by the prefix of the route's name
_ROUTE_IDS = {"job": "job", "incident": "incident", "checkpoint": "checkpoint", "node": "node", "agent": "node"}
_DATA_TYPES = ("application/json", "application/problem+json", "text/plain", "application/vnd.oai.openapi")


def _ids_of(path: str) -> dict:
    try:
        match = resolve(path)
    except Resolver404:
        return {}
    kind = (match.url_name or "").split("-")[0]
    ids = {}
    if "node_id" in match.kwargs:
        ids["node"] = match.kwargs["node_id"]
    if "pk" in match.kwargs and kind in _ROUTE_IDS:
        ids[_ROUTE_IDS[kind]] = match.kwargs["pk"]
    return ids


def _forget_request_ids(**kwargs) -> None:
    start_context()


# Django logs a 4xx/5xx answer after the middleware returned, so the ids stay bound until the
# response is finished, and go then: nothing of this request leaks into the thread's next work.
request_finished.connect(_forget_request_ids, dispatch_uid="nightwatch.forget_request_ids")


class RequestContextMiddleware:
    """Every line logged while serving ``/api/v1/jobs/7/…`` carries ``job: 7`` (and so on)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path.startswith("/api/"):
            start_context(**_ids_of(request.path_info), method=request.method)
        else:
            start_context()
        return self.get_response(request)


class ApiBoundaryMiddleware:
    """Refuses bodies over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` up front (413 problem details), and marks
    API and metrics responses as data: a strict CSP, no caching of authenticated answers.

    DRF's parsers read the body stream directly, so Django's own limit never applies to them; the
    declared length is checked here, before any view or parser runs.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        raw_length = request.META.get("CONTENT_LENGTH") or "0"
        try:
            length = int(raw_length)
        except ValueError:
            length = -1
        if length < 0:
            response = _problem(request, 400, "Bad Request", "bad-request", "Content-Length is not a valid number.")
        elif limit is not None and length > limit:
            response = _problem(request, 413, "Content Too Large", "too-large",
                                f"The body is {length} bytes; at most {limit} are accepted. Send smaller batches.")
        elif request.path.startswith("/api/") and (bad := _nul_parameter(request)) is not None:
            # PostgreSQL text cannot hold NUL: refuse it here rather than fail inside a filter.
            response = _problem(request, 400, "Bad Request", "invalid", f"{bad}: must not contain NUL characters.",
                                errors=[{"field": bad, "reason": "must not contain NUL characters"}])
        else:
            response = self.get_response(request)
        if request.path.startswith("/api/") or request.path == "/metrics":
            content_type = response.get("Content-Type", "")
            if content_type.startswith(_DATA_TYPES):
                response.headers.setdefault("Content-Security-Policy", settings.NIGHTWATCH_API_CSP)
                response.headers.setdefault("Cache-Control", "no-store")
            response.headers.setdefault("Cross-Origin-Resource-Policy", "same-origin")
        return response


class PageSecurityMiddleware:
    """Gives every HTML page outside /api/ (dashboard, login, admin) ``NIGHTWATCH_PAGE_CSP``, plus a
    ``connect-src`` for the live view's WebSocket to the host the page was served from.

    The pages run no inline script or style (data reaches the JavaScript through ``data-*``
    attributes), so an injected ``<script>`` or ``onclick=`` runs nowhere. API answers keep
    their own stricter policy (``ApiBoundaryMiddleware``).
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if not request.path.startswith("/api/") and response.get("Content-Type", "").startswith("text/html"):
            response.headers.setdefault("Content-Security-Policy", _page_policy(request))
        return response


def _page_policy(request) -> str:
    # 'self' covers ws:/wss: to this host only in CSP level 3 browsers; name the socket's origin too.
    # get_host() is validated against ALLOWED_HOSTS, so nothing the client writes enters the header;
    # the 400 page of a Host that is not allowed gets 'self' alone.
    try:
        socket_origin = f" {'wss' if request.is_secure() else 'ws'}://{request.get_host()}"
    except DisallowedHost:
        socket_origin = ""
    return f"{settings.NIGHTWATCH_PAGE_CSP}; connect-src 'self'{socket_origin}"


def _nul_parameter(request) -> str | None:
    for name, values in request.GET.lists():
        if "\x00" in name or any("\x00" in value for value in values):
            return name.replace("\x00", "\\0")
    return None


def _problem(request, status: int, title: str, code: str, detail: str, errors=None):
    body = problem(status, title, detail, code=code, instance=request.path, errors=errors)
    return JsonResponse(body, status=status, content_type=CONTENT_TYPE)
