"""Is Slurm's controller answering? The degraded state and the back-off of the periodic one-shots.

Each one-shot asks ``may_call()`` first and reports every outcome with ``record_ok`` /
``record_failure``. While the controller does not answer, calls wait an exponentially growing
back-off (capped by ``NIGHTWATCH["SLURM"]["MAX_BACKOFF_S"]``); the first failure and the recovery
each write one ``slurm.unreachable`` / ``slurm.reachable`` event, and the Slurm nodes turn
``degraded`` with the controller's error as their reason (still usable: their jobs keep running
under slurmd, Nightwatch only cannot see them), and healthy again afterwards.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.events import EventKind, record_event
from nodes.choices import Health, Transport
from nodes.models import Node, SlurmController
from nodes.services import set_health
from nodes.transports.slurm.cli import SlurmError

log = logging.getLogger(__name__)
ACTOR = "system:slurm"
UNREACHABLE_PREFIX = "Slurm controller unreachable: "


def controller() -> SlurmController:
    name = settings.NIGHTWATCH["SLURM"]["CLUSTER"]
    row, _ = SlurmController.objects.get_or_create(cluster=name)
    return row


def may_call() -> bool:
    """False while a failed controller's back-off runs."""
    row = controller()
    return row.retry_after is None or row.retry_after <= timezone.now()


#: A reachable controller's contact time is refreshed at most this often (not on every poll).
CONTACT_REFRESH_S = 30


def record_ok() -> None:
    now = timezone.now()
    name = settings.NIGHTWATCH["SLURM"]["CLUSTER"]
    if SlurmController.objects.filter(cluster=name, reachable=True,
                                      last_contact_at__gte=now - timedelta(seconds=CONTACT_REFRESH_S)).exists():
        return
    with transaction.atomic():
        row = SlurmController.objects.select_for_update().get(pk=controller().pk)
        was_down = not row.reachable
        SlurmController.objects.filter(pk=row.pk).update(reachable=True, last_contact_at=now, last_error="",
                                                         failing_since=None, consecutive_failures=0, retry_after=None)
        if was_down:
            record_event(EventKind.SLURM_REACHABLE, actor=ACTOR, old_state="unreachable", new_state="reachable",
                         reason=f"Slurm controller answers again (down since {row.failing_since:%H:%M:%S})",
                         evidence={"cluster": row.cluster, "last_error": row.last_error})
            for node in Node.objects.filter(transport=Transport.SLURM, health=Health.DEGRADED,
                                            health_reason__startswith=UNREACHABLE_PREFIX):
                set_health(node, Health.HEALTHY, actor=ACTOR, reason="Slurm controller answers again")


def record_failure(error: SlurmError) -> None:
    """Note that Slurm did not answer: back off, and on the first failure degrade and say so."""
    now = timezone.now()
    cap = settings.NIGHTWATCH["SLURM"]["MAX_BACKOFF_S"]
    with transaction.atomic():
        row = SlurmController.objects.select_for_update().get(pk=controller().pk)
        failures = row.consecutive_failures + 1
        backoff = min(cap, 2 ** min(failures, 16))
        SlurmController.objects.filter(pk=row.pk).update(
            reachable=False, last_error=str(error)[:2000], consecutive_failures=failures,
            failing_since=row.failing_since or now, retry_after=now + timedelta(seconds=backoff))
        if row.reachable:
            log.error("Slurm controller unreachable: %s (next try in %d s)", error, backoff)
            record_event(EventKind.SLURM_UNREACHABLE, actor=ACTOR, old_state="reachable", new_state="unreachable",
                         reason=str(error)[:2000], evidence={"cluster": row.cluster, "command": error.command})
            for node in Node.objects.filter(transport=Transport.SLURM, health__in=Health.USABLE):
                set_health(node, Health.DEGRADED, actor=ACTOR, reason=f"{UNREACHABLE_PREFIX}{error}"[:2000],
                           evidence={"command": error.command})
        else:
            log.warning("Slurm controller still unreachable (%d tries): %s", failures, error)
