"""Node state mirroring: a periodic one-shot reconciles the Slurm nodes with their Node rows.

1. ``sinfo --json`` lists the nodes (of the configured partition). An unknown one becomes a
   ``Node`` with transport ``slurm``; a node that an agent registered is left to its agent.
2. Health follows Slurm: down or failed is ``unreachable``; a missed ping (``idle*``, which every
   ``state=resume`` also shows for a moment) or ``unknown`` (every node, for a moment after
   slurmctld restarts) is ``degraded``; otherwise ``healthy``.
3. Drains, without ping-pong. ``SlurmNodeMirror.agreed_drained`` is the drain state both sides
   last agreed on. Whichever side now differs from it changed since, and its change is copied to
   the other side — a Nightwatch drain becomes ``scontrol update state=drain reason="nightwatch: …"``,
   a drain made with ``scontrol`` becomes a Nightwatch drain with Slurm's reason, an undrain on
   either side resumes the other — and then both agree again. A reason that starts with
   ``nightwatch:`` is Nightwatch's own, never copied back.
4. A Nightwatch node that is draining becomes drained once Slurm runs nothing on it.

A controller that does not answer is recorded (``controller.record_failure``): the nodes turn
degraded with the error as their reason, and the next try waits for the back-off.
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from nodes import services
from nodes.choices import Health, Schedulability, Transport
from nodes.models import Node, SlurmNodeMirror
from nodes.transports.slurm import controller
from nodes.transports.slurm.cli import Slurm, SlurmError, SlurmNode, SlurmUnavailable

log = logging.getLogger(__name__)
ACTOR = "system:slurm"
#: Drain reasons Nightwatch writes into Slurm start with this, so they are known as its own.
REASON_PREFIX = "nightwatch: "


def mirror_nodes(slurm: Slurm | None = None) -> int:
    """One reconciliation pass; returns how many nodes changed on either side. Never raises for
    Slurm: failures are recorded and backed off."""
    if not controller.may_call():
        return 0
    slurm = slurm or Slurm.from_settings()
    try:
        seen = slurm.nodes(settings.NIGHTWATCH["SLURM"]["PARTITION"])
    except SlurmError as exc:
        if isinstance(exc, SlurmUnavailable):
            controller.record_failure(exc)
        else:
            log.error("reading Slurm's nodes failed: %s", exc)
        return 0
    controller.record_ok()
    changed = 0
    for info in seen:
        node = _node_for(info)
        if node is not None:
            changed += _reconcile(node, info, slurm)
    gone = Node.objects.filter(transport=Transport.SLURM).exclude(hostname__in=[n.name for n in seen])
    for node in gone.exclude(health=Health.UNREACHABLE):
        changed += services.set_health(node, Health.UNREACHABLE, actor=ACTOR, reason="Slurm no longer lists this node")
    return changed


def _node_for(info: SlurmNode) -> Node | None:
    node, created = Node.objects.get_or_create(hostname=info.name,
                                               defaults={"address": info.address, "transport": Transport.SLURM})
    if node.transport != Transport.SLURM:
        return None  # an agent speaks for this host
    if created:
        log.info("Slurm node %s mirrored as a Nightwatch node", info.name)
    return node


def _reconcile(node: Node, info: SlurmNode, slurm: Slurm) -> int:
    changed = 0
    # A node seen for the first time: Slurm's drain state is news to follow, not a change to undo.
    mirror, _ = SlurmNodeMirror.objects.get_or_create(
        node=node, defaults={"agreed_drained": node.schedulability in Schedulability.OUT})
    why = f"Slurm: {'+'.join([info.state, *info.flags])}" + (f" ({info.reason})" if info.reason else "")
    health = Health.UNREACHABLE if info.unreachable else Health.DEGRADED if info.uncertain else Health.HEALTHY
    if node.health != health:
        changed += services.set_health(node, health, actor=ACTOR, reason=why,
                                       evidence={"slurm_state": info.state, "flags": list(info.flags)})
    ours = node.schedulability in Schedulability.OUT
    theirs = info.drained
    agreed = mirror.agreed_drained
    error = ""
    if ours != theirs:
        try:
            if ours != agreed:  # Nightwatch changed it: tell Slurm
                if ours:
                    slurm.drain(node.hostname, REASON_PREFIX + (node.drain_reason or "drained in Nightwatch"))
                else:
                    slurm.resume(node.hostname)
                agreed = ours
            else:  # Slurm changed it: follow
                if theirs:
                    reason = info.reason or "drained in Slurm"
                    services.drain_node(node, actor=f"slurm:{info.reason_by or 'scontrol'}",
                                        reason=f"Slurm: {reason}")
                else:
                    services.undrain_node(node, actor=f"slurm:{info.reason_by or 'scontrol'}",
                                          reason="resumed in Slurm")
                agreed = theirs
            changed += 1
        except SlurmError as exc:
            error = str(exc)[:2000]
            log.error("node %s: could not mirror the drain into Slurm: %s", node.hostname, exc)
            if isinstance(exc, SlurmUnavailable):
                controller.record_failure(exc)
    else:
        agreed = ours
    node.refresh_from_db(fields=["schedulability"])
    if node.schedulability == Schedulability.DRAINING and info.drained and not info.busy:
        changed += services.finish_drain(node, actor=ACTOR, reason="Slurm runs nothing on it any more")
    with transaction.atomic():
        SlurmNodeMirror.objects.filter(pk=mirror.pk).update(
            slurm_state=info.state, slurm_flags=list(info.flags), slurm_reason=info.reason,
            slurm_reason_by=info.reason_by, agreed_drained=agreed, seen_at=timezone.now(), last_error=error)
    return changed
