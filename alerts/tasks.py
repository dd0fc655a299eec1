"""Celery tasks of the alerts app: take primary keys, re-fetch, call a service. Safe to run twice."""

from __future__ import annotations

from celery import shared_task

from alerts import efficiency, services


@shared_task(ignore_result=True)
def evaluate_incident(incident_id: int) -> None:
    services.evaluate_incident(incident_id)


@shared_task(ignore_result=True)
def evaluate_event(event_id: int) -> None:
    services.evaluate_event(event_id)


@shared_task(bind=True, ignore_result=True, max_retries=None)
def deliver(self, delivery_id: int, attempt: int) -> None:
    """One attempt; on failure, retry with exponential backoff (``services.backoff_s``) until the
    attempt budget is spent. The attempt number rides along so a duplicate dispatch is a no-op."""
    wait = services.attempt_delivery(delivery_id, attempt)
    if wait is not None:
        raise self.retry(args=(delivery_id, attempt + 1), countdown=wait)


@shared_task(ignore_result=True)
def sweep() -> None:
    """Beat: re-judge firing alerts, re-dispatch overdue deliveries, watch efficiency."""
    services.raise_missed_incidents()
    services.reconcile_alerts()
    for _ in range(100):  # bounded: a poison row must not keep a worker busy
        if not services.redispatch_one_delivery():
            break
    efficiency.watch_running_jobs()
