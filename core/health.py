"""Liveness and readiness probes: unauthenticated, cheap, no secrets in the answer."""

from __future__ import annotations

import os

from django.conf import settings
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.http import JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET


@require_GET
@never_cache
def healthz(request):
    """The process answers."""
    return JsonResponse({"status": "ok"})


@require_GET
@never_cache
def readyz(request):
    """Database reachable and migrated: 200, else 503 with the failing checks. The broker is reported
    but does not decide: without Redis this process still answers the API (rate limits in memory,
    Celery messages held in the outbox: ``core.cache``, ``core.outbox``), so a load balancer must
    keep sending it requests; the status then says ``degraded``."""
    checks = {"database": _database(), "migrations": _migrations(), "broker": _broker()}
    ready = checks["database"] == "ok" and checks["migrations"] == "ok"
    status = "unavailable" if not ready else "ok" if checks["broker"] == "ok" else "degraded"
    return JsonResponse({"status": status, "checks": checks}, status=200 if ready else 503)


def _database() -> str:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return "ok"
    except Exception as exc:  # noqa: BLE001 - a probe reports, it does not raise
        return f"error: {type(exc).__name__}"


def _migrations() -> str:
    try:
        executor = MigrationExecutor(connection)
        pending = executor.migration_plan(executor.loader.graph.leaf_nodes())
        return "ok" if not pending else f"error: {len(pending)} unapplied"
    except Exception as exc:  # noqa: BLE001
        return f"error: {type(exc).__name__}"


def _broker() -> str:
    if settings.REDIS_URL:
        # Only a Redis deployment probes it: the embedded broker's processes never load the client.
        import redis

        try:
            redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1).ping()
            return "ok"
        except Exception as exc:  # noqa: BLE001
            return f"error: {type(exc).__name__}"
    folder = settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"]
    return "ok" if os.access(folder, os.W_OK) else "error: broker folder not writable"
