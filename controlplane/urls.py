import sys

from django.contrib import admin
from django.http import HttpResponse, JsonResponse
from django.urls import include, path
from django.utils.html import escape
from django.views import defaults
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from core import health
from core.problems import CONTENT_TYPE, json_problem_view, no_connection_in_time, overloaded
from core.tokens import TokenRotate
from dashboard.metrics import metrics_view

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema"), name="api-redoc"),
    path("api/v1/tokens/rotate", TokenRotate.as_view(), name="token-rotate"),
    path("api/v1/", include("jobs.api.urls")),
    path("api/v1/", include("nodes.api.urls")),
    path("api/v1/", include("checkpoints.api.urls")),
    path("api/v1/", include("alerts.api.urls")),
    path("", include("dashboard.urls")),
]

handler400 = "controlplane.urls.bad_request"
handler403 = "controlplane.urls.forbidden"
handler404 = "controlplane.urls.not_found"
handler500 = "controlplane.urls.server_error"


def not_found(request, exception=None):
    if request.path.startswith("/api/"):
        return json_problem_view(404, "not_found", "No such API endpoint.")(request)
    return defaults.page_not_found(request, exception)


def server_error(request):
    """An exception no view handled, in a view or in a middleware (Django calls this inside its
    ``except``). No free database connection is overload (``core.problems.overloaded``): 503 with
    ``Retry-After``, on a page as in the API."""
    if no_connection_in_time(sys.exc_info()[1]):
        body, headers = overloaded(request.path)
        if request.path.startswith("/api/"):
            return JsonResponse(body, status=503, content_type=CONTENT_TYPE, headers=headers)
        page = (f"<!doctype html><html lang=en><meta charset=utf-8><title>Nightwatch is busy</title>"
                f"<h1>Nightwatch is busy</h1><p>{escape(body['detail'])}</p></html>")
        return HttpResponse(page, status=503, headers=headers)
    if request.path.startswith("/api/"):
        return json_problem_view(500, "server-error", "The server failed; the error was logged.")(request)
    return defaults.server_error(request)


def bad_request(request, exception=None):
    """Django-level 400s (an unknown Host header, a malformed request) under /api/ as problem details."""
    if request.path.startswith("/api/"):
        return json_problem_view(400, "bad-request", "The request is malformed or its Host is not allowed.")(request)
    return defaults.bad_request(request, exception)


def forbidden(request, exception=None):
    if request.path.startswith("/api/"):
        return json_problem_view(403, "permission_denied", "Forbidden.")(request)
    return defaults.permission_denied(request, exception)

