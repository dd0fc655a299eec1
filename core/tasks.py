"""Celery tasks of the bottom layer: sending what the broker could not take (``core.outbox``)."""

from __future__ import annotations

from celery import shared_task

from core import outbox


@shared_task(ignore_result=True)
def send_outbox() -> int:
    """Beat: publish the messages held while the broker was down (oldest first, a batch per run)."""
    return outbox.resend()
