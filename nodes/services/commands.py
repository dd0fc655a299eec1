"""The command queue: what the agents must do, pulled with each heartbeat, at least once.

1. ``enqueue_command`` validates the command with the wire protocol (the agent will parse it with
   the same classes) and stores it once per (node, idempotency key).
2. ``pending_commands_for`` answers every heartbeat with all open commands — the first delivery
   and every re-delivery alike — until each is acknowledged or expires. A launch for a
   generation the job has already left is expired instead of delivered: it could only be refused.
   A launch is delivered with the generation's job token for that node (``hooks_token``), added
   on the way out and never stored in the payload: the same token on every re-delivery.
3. ``ack_command`` records the first acknowledgement (later ones are answered the same and change
   nothing). An acknowledgement of a command whose generation is no longer the job's is answered
   409 (``StaleCommand``), and the command is closed so it is not re-sent.

A command waits for its node's next heartbeat, and under overload admission control refuses most
heartbeats: in bench.fleet at 1,024 nodes, launches stayed pending for minutes behind nodes whose
heartbeats were refused again and again, and 4-5 of 23 jobs never started. So a node with open
commands is named to admission control (``core.shared_counts.expect_heartbeats``, the digest of its
agent token, after commit), which lets its heartbeats in as urgent until it has acknowledged the
last of them (``core.admission``); few nodes have open commands at a time, and each is a launch or
a stop some recovery waits for.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, Model
from django.utils import timezone

from agents.protocol import agent as wire
from core import shared_counts
from core.events import EventKind, record_event
from core.models import ApiToken, Scope
from core.tokens import job_token_for
from nodes import signals
from nodes.choices import CommandKind, CommandState
from nodes.models import Node, NodeCommand

DEFAULT_COMMAND_TTL_S = 600


class AckMismatch(Exception):
    """The acknowledgement names another idempotency key, job or generation than the command."""


class StaleCommand(Exception):
    """The command's generation is no longer its job's (the job moved on: fenced off)."""

    def __init__(self, command: NodeCommand):
        super().__init__(f"job {command.job_id}: generation {command.generation} is stale; "
                         f"the active generation is {command.job.generation}")


def command_ttl() -> timedelta:
    return timedelta(seconds=settings.NIGHTWATCH.get("COMMAND_TTL_S", DEFAULT_COMMAND_TTL_S))


@dataclass(frozen=True)
class Order:
    """One node's command in a batch: its payload and its idempotency key (None: a fresh one)."""

    node: Node
    payload: dict | None = None
    idempotency_key: str | None = None


def enqueue_command(node: Node, kind: str, *, payload: dict | None = None, job: Model | None = None,
                    generation: int | None = None, idempotency_key: str | None = None,
                    actor: str = "system", ttl: timedelta | None = None) -> NodeCommand:
    """Queue ``kind`` for ``node``'s agent; the same (node, idempotency_key) returns the first command.

    Raises ``agents.protocol.ProtocolError`` (a ``ValueError``) when the payload is not what the
    protocol allows for ``kind`` — a bug of the caller, caught here rather than on the node.
    """
    [command] = enqueue_commands(kind, [Order(node, payload, idempotency_key)], job=job, generation=generation,
                                 actor=actor, ttl=ttl)
    return command


def enqueue_commands(kind: str, orders: list[Order], *, job: Model | None = None, generation: int | None = None,
                     actor: str = "system", ttl: timedelta | None = None) -> list[NodeCommand]:
    """Queue ``kind`` for each order's node, as ``enqueue_command`` does one at a time, in one insert
    and one read whatever the number of nodes; returns the commands in the orders' order, the first
    one stored for a (node, key) seen before. A hang verdict on a 64-node job was 290 queries when
    each command had its own savepoint, insert and token lookup (bench.fleet run Q, issue 18).

    Every order is validated before anything is written: one bad payload writes none of them.
    """
    now = timezone.now()
    expires_at = now + (ttl or command_ttl())
    rows = []
    for order in orders:
        key = order.idempotency_key or f"{kind}:{uuid.uuid4().hex}"
        if not 1 <= len(key) <= 128:
            raise ValueError("idempotency_key must be 1-128 characters")
        message = wire.Command(id="0", kind=kind, idempotency_key=key, job=str(job.pk) if job else None,
                               generation=generation, payload=order.payload or {})
        # Validate exactly as the agent will; store the canonical form (defaults filled in, nulls left out).
        canonical = wire.compact(wire.parse_command_payload(message))
        rows.append(NodeCommand(node=order.node, kind=kind, job=job, generation=generation, idempotency_key=key,
                                payload=canonical, created_by=actor, created_at=now, expires_at=expires_at))
    if not rows:
        return []
    # A key seen before keeps its first command (ON CONFLICT DO NOTHING), which the read below returns.
    NodeCommand.objects.bulk_create(rows, ignore_conflicts=True)
    stored = {(c.node_id, c.idempotency_key): c for c in NodeCommand.objects.filter(
        node_id__in={row.node_id for row in rows}, idempotency_key__in={row.idempotency_key for row in rows})}
    commands = [stored[row.node_id, row.idempotency_key] for row in rows]
    # Every node with one of these open carries it on its next heartbeat (naming one again is harmless).
    carrying = {c.node_id: c.expires_at for c in commands if c.state in CommandState.OPEN}
    if carrying:
        transaction.on_commit(lambda: expect_heartbeats(carrying))
    return commands


def _agent_digests(node_ids: list[int]) -> dict[str, int]:
    """The usable agent tokens of these nodes: digest -> node id."""
    return dict(ApiToken.objects.usable().filter(scope=Scope.AGENT, node_id__in=node_ids)
                .values_list("digest", "node_id"))


def expect_heartbeats(expiries: dict[int, datetime]) -> None:
    """These nodes' next heartbeats carry a command (node id -> when it expires at the latest): tell
    admission control to let them in as urgent. Best effort: without Redis they wait their turn, as
    before. One token query and one Redis round trip for the batch."""
    if shared_counts.client() is None:  # no Redis (the embedded demo), or skipped after a failure
        return
    now = timezone.now()
    digests = _agent_digests(list(expiries))
    if digests:
        keep_s = max((expiries[node_id] - now).total_seconds() for node_id in digests.values())
        shared_counts.expect_heartbeats(dict.fromkeys(digests, now.timestamp()), keep_s=max(0.0, keep_s))


def pending_commands_for(node: Node, *, limit: int = wire.MAX_COMMANDS_PER_HEARTBEAT) -> list[wire.Command]:
    """Every open command of ``node`` (oldest first), marked delivered; expired ones are closed."""
    now = timezone.now()
    open_commands = list(
        NodeCommand.objects.filter(node=node, state__in=CommandState.OPEN)
        .select_related("job").order_by("created_at", "pk")[:limit]
    )
    if not open_commands:
        return []
    deliver, expired, stale = [], [], []
    for command in open_commands:
        if command.expires_at <= now:
            expired.append(command.pk)
        elif command.kind == CommandKind.LAUNCH and _is_stale(command):
            stale.append(command.pk)
        else:
            deliver.append(command)
    if expired:
        NodeCommand.objects.filter(pk__in=expired, state__in=CommandState.OPEN).update(
            state=CommandState.EXPIRED, detail="not acknowledged before it expired")
    if stale:
        NodeCommand.objects.filter(pk__in=stale, state__in=CommandState.OPEN).update(
            state=CommandState.EXPIRED, detail="its generation is no longer the job's: not delivered")
    if deliver:
        NodeCommand.objects.filter(pk__in=[c.pk for c in deliver], state__in=CommandState.OPEN).update(
            state=CommandState.DELIVERED, delivered_at=now, delivery_count=F("delivery_count") + 1)
    return [to_wire(c, with_secrets=True) for c in deliver]


def to_wire(command: NodeCommand, *, with_secrets: bool = False) -> wire.Command:
    """The command as the agent receives it; ``with_secrets``: a launch carries its job token."""
    payload = command.payload
    if with_secrets and command.kind == CommandKind.LAUNCH and command.job is not None:
        payload = {**payload, "hooks_token": job_token_for(command.job, command.generation, command.node)}
    return wire.Command(id=str(command.pk), kind=command.kind, idempotency_key=command.idempotency_key,
                        job=str(command.job_id) if command.job_id else None, generation=command.generation,
                        payload=payload)


def _is_stale(command: NodeCommand) -> bool:
    """A command for a generation its job has left: the generation is the fencing token."""
    return command.job is not None and command.generation is not None and command.generation != command.job.generation


def ack_command(node: Node, command_id: int, ack: wire.CommandAck, *, actor: str) -> NodeCommand:
    """Record the agent's acknowledgement of one of its commands; returns the command.

    Raises ``NodeCommand.DoesNotExist`` (not this node's command), ``AckMismatch``, or
    ``StaleCommand`` (the command's generation is no longer the job's).
    """
    command = NodeCommand.objects.select_related("job").filter(node=node, pk=command_id).first()
    if command is None:
        raise NodeCommand.DoesNotExist(f"node {node.pk} has no command {command_id}")
    if ack.idempotency_key != command.idempotency_key:
        raise AckMismatch(f"command {command.pk} has idempotency key {command.idempotency_key!r}, "
                          f"the acknowledgement {ack.idempotency_key!r}")
    if (ack.job is not None and ack.job != str(command.job_id)) or (
            ack.generation is not None and ack.generation != command.generation):
        raise AckMismatch(f"command {command.pk} is for job {command.job_id} generation {command.generation}, "
                          f"the acknowledgement for job {ack.job} generation {ack.generation}")
    if _is_stale(command):
        stale = StaleCommand(command)
        # Close it so it is not re-sent; the agent stops what it still runs of that generation.
        NodeCommand.objects.filter(pk=command.pk, state__in=CommandState.OPEN).update(
            state=CommandState.EXPIRED, detail=f"acknowledged ({ack.status}) after going stale: {stale}")
        raise stale
    new_state = CommandState.FROM_ACK[ack.status]
    old_state = command.state
    # An expired command can still be acknowledged: the agent did run it, and that is a fact to keep.
    acceptable = CommandState.OPEN | {CommandState.EXPIRED}
    if old_state not in acceptable:
        return command  # a repeated acknowledgement: answered the same, changes nothing
    now = timezone.now()
    with transaction.atomic():
        won = NodeCommand.objects.filter(pk=command.pk, state=old_state).update(
            state=new_state, acked_at=now, detail=ack.detail)
        if not won:
            command.refresh_from_db()
            return command
        record_event(EventKind.NODE_COMMAND, actor=actor, node=node, job=command.job_id,
                     generation=command.generation, old_state=old_state, new_state=new_state,
                     reason=f"{command.kind} {ack.status}" + (f": {ack.detail}" if ack.detail else ""),
                     evidence={"command": command.pk, "idempotency_key": command.idempotency_key},
                     created_at=now)
        signals.send_on_commit(signals.command_acked, node=node, command_id=command.pk, kind=command.kind,
                               job_id=command.job_id, generation=command.generation, status=ack.status,
                               state=new_state, detail=ack.detail)
    command.state, command.acked_at, command.detail = new_state, now, ack.detail
    if shared_counts.client() is not None and not NodeCommand.objects.filter(
            node=node, state__in=CommandState.OPEN).exists():
        shared_counts.heartbeats_received(list(_agent_digests([node.pk])))
    return command


def expire_commands() -> int:
    """Close open commands past their deadline (nodes that stopped asking); returns how many."""
    return NodeCommand.objects.filter(state__in=CommandState.OPEN, expires_at__lte=timezone.now()).update(
        state=CommandState.EXPIRED, detail="not acknowledged before it expired")


def probe_peers_for(peers, expected_mbps: float | None = None) -> list[dict]:
    """The protocol's ProbePeer list for ``peers`` (nodes whose agent runs a probe server)."""
    expected = expected_mbps or settings.NIGHTWATCH.get("EXPECTED_PEER_MBPS", 100)
    without = [p.hostname for p in peers if not p.probe_port]
    if without:
        raise ValueError(f"no bandwidth probe port known for {', '.join(without)} (agent not registered?)")
    return [{"node": str(p.pk), "address": p.address, "port": p.probe_port, "expected_mbps": float(expected)}
            for p in peers]


def request_health_check(node: Node, *, peers=(), actor: str, expected_mbps: float | None = None) -> NodeCommand:
    """Queue an on-demand health check (GPUs, and bandwidth to each of ``peers``) for ``node``."""
    return enqueue_command(node, "health_check", payload={"peers": probe_peers_for(peers, expected_mbps)},
                           actor=actor)
