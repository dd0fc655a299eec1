"""The heartbeat sweeper: nodes past their heartbeat deadline become unreachable, a batch at a time.

It asks two watches first, both about our own side: the fleet-silence watch
(``nodes.services.silence``: while (nearly) every node is silent at once, the likeliest fault is
ours) and the overload watch (``nodes.services.overload``: while the control plane answers
heartbeats late or cannot tell whom it refused, a silent node may be a live one we did not hear).
While either holds, nobody is marked unreachable. A node whose own heartbeats admission control
refused (``core.refusals``) was heard trying: it is spared, its deadline a heartbeat timeout after
its last refused attempt, so a node that dies while the control plane sheds load is still found
a timeout after it stopped trying.

Its cost follows what changed, not the size of the fleet (issue 18's probe: one query and one
task per node, 2–9.5 s per run and up to 1,669 tasks at 1,024 nodes):

1. One query on the ``heartbeat_deadline`` index finds the nodes past their deadline, oldest first,
   at most ``limit``, and locks them, skipping any row a heartbeat is updating right now: that
   heartbeat wins (its deadline is in the future once it commits), and two sweepers never take
   the same node.
2. One UPDATE marks them unreachable and clears their deadlines, one INSERT appends their
   ``node.health`` events, as ``set_health`` would for each.
3. After commit, one ``nodes_health_changed`` signal carries the batch: the jobs app queues one
   task for all of them, not one per node. Unreachable is not unhealthy, so, as with
   ``set_health``, no drain follows.
"""

from __future__ import annotations

import bisect

from django.db import transaction
from django.db.models.expressions import RawSQL
from django.utils import timezone

from core import refusals, shared_counts
from core.events import EventKind, record_events
from nodes import signals
from nodes.choices import Health
from nodes.models import Node
from nodes.services import overload, silence
from nodes.services.fleet import heartbeat_timeout

SWEEPER = "system:heartbeat-sweeper"
#: The most nodes one sweep expires; the rest wait one heartbeat interval for the next sweep.
BATCH = 1000
#: Upper bounds of the expiry batch-size histogram in ``/metrics``.
BATCH_BUCKETS = (1, 5, 25, 100, 250, 1000)


def expire_heartbeats(limit: int = BATCH) -> int:
    """The beat task's sweep: one batch, unless a watch holds; returns how many nodes it expired."""
    if silence.watch() or overload.watch():
        return 0
    return expire_batch(limit)


def expire_one_heartbeat() -> bool:
    """The node longest past its heartbeat deadline becomes unreachable; returns whether one did."""
    return expire_batch(1) == 1


def expire_batch(limit: int) -> int:
    """Up to ``limit`` nodes past their deadline become unreachable; returns how many."""
    now = timezone.now()
    with transaction.atomic():
        nodes = list(Node.objects.select_for_update(skip_locked=True).filter(heartbeat_deadline__lt=now)
                     .order_by("heartbeat_deadline")[:limit])
        if not nodes:
            return 0
        nodes = _spare_refused(nodes, now)
        if not nodes:
            return 0
        changes = [change for node in nodes if (change := _mark_unreachable(node, now)) is not None]
        _update(nodes, changes, now)
        events = record_events(EventKind.NODE_HEALTH, changes)
        signals.send_on_commit(signals.nodes_health_changed, new=Health.UNREACHABLE, changes=[
            {"node": change["node"], "old": change["old_state"], "reasons": [change["reason"]], "event_id": event.pk}
            for change, event in zip(changes, events, strict=True)])
    _count_batch(len(nodes), now)
    return len(nodes)


def _spare_refused(nodes: list[Node], now) -> list[Node]:
    """``nodes`` less those whose heartbeats admission control refused within the last heartbeat
    timeout: their deadlines move to a timeout after the last refusal (one UPDATE). When who was
    refused cannot be read (Redis down), nobody is spared: the overload watch holds if heartbeats
    were refused at all, and it cannot know that either, so the silence is taken at its word."""
    timeout = heartbeat_timeout()
    refused = refusals.refused_since(timeout.total_seconds(), now=now)
    if refused is None or not refused.nodes:
        return nodes
    spared = {node.pk: refused.nodes[node.pk] + timeout for node in nodes if node.pk in refused.nodes}
    if not spared:
        return nodes
    pk = Node._meta.pk.column
    # As in _update: placeholders and the key column's name only; every value is a parameter.
    deadlines = RawSQL(f"CASE {pk} {' '.join(['WHEN %s THEN %s'] * len(spared))} END",  # noqa: S611
                       [value for item in spared.items() for value in item], output_field=Node._meta.get_field(
                           "heartbeat_deadline"))
    Node.objects.filter(pk__in=list(spared)).update(heartbeat_deadline=deadlines)
    shared_counts.add({"expiry:spared": len(spared)}, at=now.timestamp())
    return [node for node in nodes if node.pk not in spared]


def _mark_unreachable(node: Node, now) -> dict | None:
    """``node`` as the batch UPDATE leaves it; returns its ``node.health`` event's fields, or None
    when it already was unreachable (its deadline is cleared all the same)."""
    since = node.last_heartbeat_at.isoformat() if node.last_heartbeat_at else "never"
    deadline = node.heartbeat_deadline.isoformat()
    old, node.heartbeat_deadline = node.health, None
    if old == Health.UNREACHABLE:
        return None
    reason = f"no heartbeat since {since} (deadline {deadline})"
    node.health, node.health_reason, node.health_changed_at = Health.UNREACHABLE, reason, now
    return {"node": node, "actor": SWEEPER, "old_state": old, "new_state": Health.UNREACHABLE, "reason": reason,
            "evidence": {"last_heartbeat_at": since, "deadline": deadline}, "created_at": now}


def _update(nodes: list[Node], changes: list[dict], now) -> None:
    """One UPDATE (two when some node already was unreachable): the health, its time, each node's
    reason, and no deadline. The reasons are one CASE written out: Django's ``bulk_update`` (and
    ``Case(When(...))``) resolve an expression object per node, 0.7 s of Python for 1,000 nodes."""
    if changes:
        pk = Node._meta.pk.column
        # Only placeholders and the key column's name are SQL here; every value is a parameter.
        reasons = RawSQL(f"CASE {pk} {' '.join(['WHEN %s THEN %s'] * len(changes))} END",  # noqa: S611
                         [value for change in changes for value in (change["node"].pk, change["reason"])])
        Node.objects.filter(pk__in=[change["node"].pk for change in changes]).update(
            heartbeat_deadline=None, health=Health.UNREACHABLE, health_changed_at=now, health_reason=reasons)
    if len(changes) < len(nodes):
        changed = {change["node"].pk for change in changes}
        Node.objects.filter(pk__in=[node.pk for node in nodes if node.pk not in changed]).update(
            heartbeat_deadline=None)


def _count_batch(size: int, now) -> None:
    """Into the shared counts that ``/metrics`` exports as a histogram of batch sizes."""
    at = bisect.bisect_left(BATCH_BUCKETS, size)
    bound = str(BATCH_BUCKETS[at]) if at < len(BATCH_BUCKETS) else "+Inf"
    shared_counts.add({"expiry:batches": 1, "expiry:nodes": size, f"expiry:le:{bound}": 1}, at=now.timestamp())
