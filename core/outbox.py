"""Celery messages held in PostgreSQL while the broker (Redis) is down, and sent once it is back.

PostgreSQL is the source of truth and Celery messages are hints, but some hints are the only thing
that starts work: the exit report an agent delivered becomes an incident only through
``jobs.tasks.handle_exit``. If publishing fails, the request that recorded the fact must still
succeed (the agent would otherwise retry a report we already stored), and the work must still
happen. So a publish that fails is kept here (``hold``), and ``resend`` (beat, every
``OUTBOX_INTERVAL_S``) publishes what is held, oldest first, deleting each row in the transaction
that sent it: at least once, never lost.

Messages with an expiry (beat's periodic runs) are hints by definition and are not held: the next
run replaces them. Eager mode (tests) never reaches a broker.
"""

from __future__ import annotations

import logging

from celery import current_app
from django.db import transaction

from core import degraded
from core.models import OutboxMessage

log = logging.getLogger(__name__)

COMPONENT = "broker"
#: Publish options kept with a held message (the rest are per-call details or not JSON).
KEPT_OPTIONS = ("queue", "routing_key", "priority", "countdown")
#: Rows sent per ``resend`` call.
BATCH = 200


def hold(task: str, args, kwargs, options: dict, error: BaseException | str) -> OutboxMessage:
    """Keep a message the broker did not take; counted and logged as a Redis fallback."""
    degraded.note(COMPONENT, error)
    return OutboxMessage.objects.create(
        task=task, args=list(args or ()), kwargs=dict(kwargs or {}),
        options={k: options[k] for k in KEPT_OPTIONS if options.get(k) is not None}, error=str(error)[:500])


def resend(limit: int = BATCH) -> int:
    """Publish up to ``limit`` held messages, oldest first; returns how many went. Stops at the first
    failure (the broker is still down: they stay, for the next run)."""
    sent = 0
    with transaction.atomic():
        rows = list(OutboxMessage.objects.select_for_update(skip_locked=True).order_by("pk")[:limit])
        for row in rows:
            try:
                current_app.send_task(row.task, args=row.args, kwargs=row.kwargs, **row.options)
            except Exception as error:  # any publish failure: keep the rest for the next run
                degraded.note(COMPONENT, error)
                break
            row.delete()
            sent += 1
    if sent:
        degraded.recovered(COMPONENT)
        log.warning("outbox: %d held Celery messages sent now that the broker answers (%d were held)",
                    sent, len(rows))
    return sent


def held() -> int:
    """How many messages wait for the broker."""
    return OutboxMessage.objects.count()
