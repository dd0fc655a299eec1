"""The heartbeat sweeper: a node past its heartbeat deadline becomes unreachable.

It asks the fleet-silence watch first (``nodes.services.silence``): while (nearly) every node is
silent at once, the likeliest fault is on this side, and nobody is marked unreachable.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from nodes.choices import Health
from nodes.models import Node
from nodes.services import silence
from nodes.services.fleet import set_health

SWEEPER = "system:heartbeat-sweeper"


def expire_one_heartbeat() -> bool:
    """The node longest past its heartbeat deadline becomes unreachable; returns whether one did."""
    node = Node.objects.filter(heartbeat_deadline__lt=timezone.now()).order_by("heartbeat_deadline").first()
    if node is None:
        return False
    _mark_unreachable(node)
    return True


def _mark_unreachable(node: Node) -> bool:
    """Unreachable, unless the deadline we read has moved meanwhile (compare-and-set on it): a
    heartbeat racing the sweeper wins cleanly, and two sweepers never act on the same node."""
    with transaction.atomic():
        if not Node.objects.filter(pk=node.pk, heartbeat_deadline=node.heartbeat_deadline).update(
                heartbeat_deadline=None):
            return False
        since = node.last_heartbeat_at.isoformat() if node.last_heartbeat_at else "never"
        set_health(node, Health.UNREACHABLE, actor=SWEEPER,
                   reason=f"no heartbeat since {since} (deadline {node.heartbeat_deadline.isoformat()})",
                   evidence={"last_heartbeat_at": since, "deadline": node.heartbeat_deadline.isoformat()})
    return True


def expire_heartbeats(limit: int = 1000) -> int:
    """Run the one-shot until nothing is left (bounded); returns how many nodes it handled. Holds
    (handles none) while the whole fleet is silent."""
    if silence.watch():
        return 0
    done = 0
    while done < limit and expire_one_heartbeat():
        done += 1
    return done
