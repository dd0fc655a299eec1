"""The alerts app listens to the jobs app's append-only log, without the jobs app knowing.

Receivers run inside the transaction that wrote the row (the state machine's, the
orchestrator's), so they only filter cheaply and enqueue a task after commit: a rolled-back
transition never alerts, and alerting never slows a transition down or makes it fail (``robust``:
a broker that is down is logged; the sweeper raises what was missed).
"""

from __future__ import annotations

from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver

from alerts.choices import AlertState, Rule
from alerts.models import Alert
from alerts.tasks import evaluate_event, evaluate_incident
from core.events import EventKind
from core.models import Event
from jobs.models import Incident

#: Event kinds that can raise or clear an alert (see ``alerts.services.evaluate_event``). An
#: incident is resolved by a bulk update (no ``post_save``): its ``incident.resolved`` event is
#: how its alert learns of it at once, not at the next sweep.
WATCHED_EVENTS = frozenset({EventKind.JOB_STATE, EventKind.NODE_DRAIN, EventKind.NODE_BLAME, EventKind.NODE_UNDRAIN,
                            EventKind.NODE_LEMON_CLEARED, EventKind.CHECKPOINT_VERIFY, EventKind.INCIDENT_RESOLVED})


@receiver(post_save, sender=Event, dispatch_uid="alerts.event_saved")
def on_event_saved(sender, instance: Event, created: bool, **kwargs):
    if not created or instance.kind not in WATCHED_EVENTS:
        return
    if (instance.kind == EventKind.CHECKPOINT_VERIFY and instance.new_state != "corrupt"
            and not _corrupt_alert_firing(instance)):
        return  # the common case, a checkpoint verified: nothing to raise, nothing to clear
    pk = instance.pk
    transaction.on_commit(lambda: evaluate_event.delay(pk), robust=True)


@receiver(post_save, sender=Incident, dispatch_uid="alerts.incident_saved")
def on_incident_saved(sender, instance: Incident, **kwargs):
    """Created (a new fault) or saved again (further evidence, a manual close): re-evaluate."""
    pk = instance.pk
    transaction.on_commit(lambda: evaluate_incident.delay(pk), robust=True)


def _corrupt_alert_firing(event: Event) -> bool:
    return Alert.objects.filter(job_id=event.job_id, rule=Rule.CHECKPOINT_CORRUPT, state=AlertState.FIRING).exists()
