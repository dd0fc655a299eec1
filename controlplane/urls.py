from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from controlplane import health
from controlplane.problems import json_problem_view

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema"), name="api-redoc"),
    path("api/v1/", include("jobs.api.urls")),
    path("api/v1/", include("nodes.api.urls")),
    path("api/v1/", include("checkpoints.api.urls")),
    path("", include("jobs.urls")),
]

handler404 = "controlplane.urls.not_found"
handler500 = "controlplane.urls.server_error"


def not_found(request, exception=None):
    if request.path.startswith("/api/"):
        return json_problem_view(404, "not_found", "No such API endpoint.")(request)
    from django.views.defaults import page_not_found

    return page_not_found(request, exception)


def server_error(request):
    if request.path.startswith("/api/"):
        return json_problem_view(500, "server-error", "The server failed; the error was logged.")(request)
    from django.views.defaults import server_error as default

    return default(request)
