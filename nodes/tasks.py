"""Celery tasks of the nodes app: thin wrappers around one-shot service functions.

Each is safe to run twice (the one-shots compare-and-set) and bounded, so that a poison row
never keeps a worker busy for ever.
"""

from __future__ import annotations

import logging

from celery import shared_task

from nodes import services

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def expire_heartbeats() -> int:
    """Beat, every heartbeat interval: nodes past their deadline become unreachable; stale commands close."""
    handled = services.expire_heartbeats(limit=1000)
    services.expire_commands()
    return handled


@shared_task(ignore_result=True)
def prune_telemetry() -> int:
    """Beat, hourly: telemetry older than the retention period goes (heavy: never in a request)."""
    deleted = services.prune_telemetry()
    if deleted:
        log.info("pruned %d old GPU samples", deleted)
    return deleted
