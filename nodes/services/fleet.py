"""Verbs that change nodes: registration, heartbeats, health, drains and blame.

``set_health`` is the only code that changes ``Node.health``; ``drain_node``, ``finish_drain``
and ``undrain_node`` are the only code that changes ``Node.schedulability``. Each is a
compare-and-set that appends one ``core.models.Event`` row (who, old, new, why, evidence).
The heartbeat sweeper that turns silent nodes unreachable is ``nodes.services.sweeper``: the one
other writer of ``Node.health``, which does for a batch of nodes in three queries what
``set_health`` does for one.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, connections, transaction
from django.db.models import F
from django.utils import timezone

from agents.protocol import ProtocolError, dump
from agents.protocol import agent as wire
from core.events import EventKind, record_event
from core.models import ApiToken, Event, Scope, hash_token
from core.text import clip
from nodes import health as rules
from nodes import signals
from nodes.addresses import address_problem
from nodes.choices import CommandKind, CommandState, Health, Schedulability, Transport
from nodes.models import GPU, Node, NodeCommand
from nodes.policies import LemonPolicy
from nodes.services.commands import enqueue_command, pending_commands_for
from nodes.workload import workload

log = logging.getLogger(__name__)
POLICY = "system:drain-policy"
#: Samples older than this say nothing about a node that just came back.
FRESH_SAMPLE_S = 300
#: The protocol bounds counters from below only; a database column bounds them from above.
BIGINT_MAX = 2**63 - 1
INT_MAX = 2**31 - 1
#: One answer for every dead bootstrap token: a guesser learns nothing about which it hit.
USED = "Unknown, expired or already used bootstrap token."
#: How long after a registration its agent may retry it (the answer was lost) and get its node back.
RETRY_WINDOW = timedelta(minutes=15)


def check_range(value: int | None, where: str, high: int = BIGINT_MAX) -> None:
    """Refuse (``ProtocolError``, a 400) a number no column can hold, rather than fail in the database."""
    if value is not None and value > high:
        raise ProtocolError(where, f"must be <= {high}, got {value}")


class RegistrationRefused(Exception):
    """The bootstrap token is unknown, expired or used (``status`` 401), or may not register this
    hostname: not a bootstrap token, bound to another host, or the host is registered already (403)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def thresholds() -> rules.Thresholds:
    return rules.Thresholds.from_mapping(settings.NIGHTWATCH.get("HEALTH", {}))


# --- heartbeat pacing -------------------------------------------------------------------------
#
# A heartbeat costs the same whoever sends it, so a fleet's heartbeats cost in proportion to its
# nodes: 1,088 agents at 5 s offered 218 a second, 73 % of all requests and more than 2 cores can
# serve (docs/benchmarks/fleet.md). As Nomad does (``max_heartbeats_per_second``), the interval the
# control plane asks of its agents grows with the fleet so that the fleet sends at most
# ``MAX_HEARTBEATS_PER_S``: the configured ``HEARTBEAT_INTERVAL_S`` up to that many nodes, then
# nodes / rate, never beyond ``HEARTBEAT_INTERVAL_MAX_S``. Each heartbeat answer carries the
# interval and each node's deadline is ``HEARTBEAT_MISSES`` of the interval it was asked for, so
# what a node was told and what it is judged by never differ. The price is stated, not hidden: a
# dead node is noticed after the paced timeout (65 s at 1,088 nodes and 50 a second); a rank's
# exit or an Xid does not wait for a heartbeat (they are events), and a node with commands open
# asks for them every 0.2 s while it expects a decision (``agents.agent.daemon.DECISION_POLL_S``).
#
# Only agents that follow the answer's interval (their heartbeat says which one they use now,
# ``Heartbeat.interval_s``) are paced; an older agent keeps the configured interval and is judged by it.

#: How long a web process or worker goes by one count of the fleet.
FLEET_COUNT_TTL_S = 10.0
#: Paced intervals are rounded up to this: agents hear of a change when the fleet changed, not at every node.
PACING_STEP_S = 0.5
_fleet_count: tuple[float, int] | None = None  # (monotonic time of the count, nodes)


def base_heartbeat_interval_s() -> float:
    """The configured interval: the one registration announces, and an unpaced agent's."""
    return float(settings.NIGHTWATCH["HEARTBEAT_INTERVAL_S"])


def heartbeat_interval_s() -> float:
    """The interval agents are asked to heartbeat at now (see "heartbeat pacing" above)."""
    base = base_heartbeat_interval_s()
    rate = float(settings.NIGHTWATCH["MAX_HEARTBEATS_PER_S"])
    if rate <= 0:
        return base
    ceiling = max(base, float(settings.NIGHTWATCH["HEARTBEAT_INTERVAL_MAX_S"]))
    paced = math.ceil(heartbeating_nodes() / rate / PACING_STEP_S) * PACING_STEP_S  # not a new value per node
    return min(max(base, paced), ceiling)


def heartbeat_timeout(interval_s: float | None = None) -> timedelta:
    """Missing this many heartbeats in a row makes a node unreachable (at the paced interval unless
    ``interval_s`` says which)."""
    interval = heartbeat_interval_s() if interval_s is None else interval_s
    return timedelta(seconds=interval * settings.NIGHTWATCH["HEARTBEAT_MISSES"])


def heartbeating_nodes() -> int:
    """The nodes we expect heartbeats from (those with a deadline), counted at most every
    ``FLEET_COUNT_TTL_S`` in this process: one indexed count, not one per heartbeat."""
    global _fleet_count
    now = time.monotonic()
    if _fleet_count is None or now - _fleet_count[0] >= FLEET_COUNT_TTL_S:
        _fleet_count = (now, Node.objects.filter(heartbeat_deadline__isnull=False).count())
    return _fleet_count[1]


def forget_fleet_count() -> None:
    """Count the fleet afresh at the next ask (tests, and after a bulk change of the fleet)."""
    global _fleet_count
    _fleet_count = None


# --- registration and heartbeats ----------------------------------------------------------------

@dataclass(frozen=True)
class Registration:
    node: Node
    response: wire.RegisterResponse


def bootstrap_token_ttl() -> timedelta:
    return timedelta(seconds=settings.NIGHTWATCH["BOOTSTRAP_TOKEN_TTL_S"])


def issue_bootstrap_token(*, name: str, actor: str, hostname: str = "", node: Node | None = None,
                          reason: str = "") -> tuple[ApiToken, str]:
    """A single-use bootstrap token expiring after ``BOOTSTRAP_TOKEN_TTL_S``; returns ``(token, raw)``.

    ``hostname`` binds it to one host. ``node`` makes it an operator's approval to re-register that
    node (a re-imaged machine): whoever registers with it replaces the node's agent, so it is audited.
    """
    now = timezone.now()
    expires_at = now + bootstrap_token_ttl()
    with transaction.atomic():
        token, raw = ApiToken.issue(name=name, scope=Scope.BOOTSTRAP, single_use=True, expires_at=expires_at,
                                    hostname=node.hostname if node is not None else hostname, node=node)
        if node is not None:
            record_event(EventKind.NODE_BOOTSTRAP_TOKEN, actor=actor, node=node, created_at=now,
                         reason=f"bootstrap token {token.name!r} issued to re-register {node.hostname}"
                         + (f": {reason}" if reason else ""),
                         evidence={"token": token.name, "prefix": token.prefix, "expires_at": expires_at.isoformat()})
    return token, raw


def register_agent(message: wire.Register) -> Registration:
    """Register (or, with an operator's approval, re-register) the agent of ``message.hostname``.

    1. Refuse an address peers cannot use (a 400 naming ``address``) before anything is read.
    2. Check the bootstrap token: live (401 otherwise), allowed to register this hostname (403:
       ``_check_may_register``). A refusal changes nothing and does not use the token up.
    3. Consume the token by compare-and-set: of two registrations racing with one token, exactly
       one wins; a token used once is refused for ever after.
    4. Create the node, or update it when the token was issued for it: its earlier agent tokens
       are revoked, so only the newest agent speaks for the node.
    5. Record its GPUs, issue the node's agent token and count the registration as a heartbeat.

    A retry of a registration whose answer was lost (the agent timed out) presents the used token
    with the same ``attempt`` id: within ``RETRY_WINDOW`` it gets the same node back with a new
    token (the one in the lost answer is revoked), instead of a 401 that would strand the agent.
    """
    if (problem := address_problem(message.address)) is not None:
        raise ProtocolError("address", problem)
    for i, gpu in enumerate(message.gpus):
        check_range(gpu.memory_total // 2**20, f"gpus.{i}.memory_total", INT_MAX)
    now = timezone.now()
    with transaction.atomic():
        if (retried := _retried_registration(message, now)) is not None:
            return retried
        token = _live_bootstrap_token(message.bootstrap_token, now)
        node = Node.objects.select_for_update().filter(hostname=message.hostname).first()
        _check_may_register(token, message.hostname, node)
        if not ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now, last_used_at=now):
            raise RegistrationRefused(USED, 401)
        node, previous = _node_registered(message, node, now)
        ApiToken.objects.filter(pk=token.pk).update(
            registered=node, attempt_digest=hash_token(message.attempt) if message.attempt else "")
        _record_gpus(node, message.gpus)
        _, raw = ApiToken.issue(name=f"agent {message.hostname}"[:100], scope=Scope.AGENT, node=node)
        _record_registration(node, message, actor=f"token:{token.name}", previous=previous, now=now)
        _stamp_heartbeat(node, now)
        _came_alive(node, actor=f"node:{node.hostname}")
    response = wire.RegisterResponse(node_id=str(node.pk), node_token=raw,
                                     heartbeat_interval_s=base_heartbeat_interval_s())
    return Registration(node=node, response=response)


def _retried_registration(message: wire.Register, now) -> Registration | None:
    """The registration ``message`` retries, answered again: the same node, a fresh agent token.

    Only for the agent that made it: the used bootstrap token and the attempt id it sent (random,
    never shown anywhere) must both match, for the same hostname, within ``RETRY_WINDOW``.
    """
    if not message.attempt:
        return None
    token = (ApiToken.objects.select_for_update(of=("self",))
             .filter(digest=hash_token(message.bootstrap_token), scope=Scope.BOOTSTRAP,
                     revoked_at__gt=now - RETRY_WINDOW, attempt_digest=hash_token(message.attempt),
                     registered__hostname=message.hostname)
             .select_related("registered").first())
    if token is None:
        return None
    node = token.registered
    ApiToken.objects.filter(node=node, scope=Scope.AGENT, revoked_at__isnull=True).update(revoked_at=now)
    _, raw = ApiToken.issue(name=f"agent {message.hostname}"[:100], scope=Scope.AGENT, node=node)
    record_event(EventKind.NODE_REGISTER, actor=f"token:{token.name}", node=node, created_at=now,
                 reason="the agent retried its registration (the first answer was lost): the same node, a new "
                        "agent token, the one in the lost answer revoked")
    _stamp_heartbeat(node, now)
    response = wire.RegisterResponse(node_id=str(node.pk), node_token=raw,
                                     heartbeat_interval_s=base_heartbeat_interval_s())
    return Registration(node=node, response=response)


def _live_bootstrap_token(raw: str, now) -> ApiToken:
    """The bootstrap token ``raw`` names, if unused and unexpired. One issued without an expiry
    (before bootstrap tokens expired, or by code that forgot) lives ``BOOTSTRAP_TOKEN_TTL_S``."""
    token = ApiToken.objects.usable().filter(digest=hash_token(raw)).first()
    if token is None:
        raise RegistrationRefused(USED, 401)
    if token.scope != Scope.BOOTSTRAP:
        raise RegistrationRefused("This token is not a bootstrap token; ask an operator for one.", 403)
    if token.expires_at is None and token.created_at + bootstrap_token_ttl() <= now:
        raise RegistrationRefused(USED, 401)
    return token


def _check_may_register(token: ApiToken, hostname: str, node: Node | None) -> None:
    """A token bound to a host registers only that host; an existing node is re-registered only with
    a token issued for it, so a bootstrap token can never take over a node (its launches, its token)."""
    if token.hostname and token.hostname != hostname:
        raise RegistrationRefused(f"This bootstrap token registers only {token.hostname!r}, not {hostname!r}.", 403)
    if node is not None and token.node_id != node.pk:
        raise RegistrationRefused(
            f"Node {hostname!r} is already registered. Re-registering it replaces its agent, so an operator must "
            f"approve: ask for a bootstrap token issued for that node (`manage.py nightwatch_token issue --scope "
            f"bootstrap --node {hostname} --name …` or POST /api/v1/nodes/{node.pk}/bootstrap-token).", 403)
    if node is None and token.node_id is not None:
        raise RegistrationRefused(f"This bootstrap token re-registers only {token.hostname!r}.", 403)


def _node_registered(message: wire.Register, node: Node | None, now) -> tuple[Node, dict | None]:
    """The node created or updated from ``message``, and what it was before (None when new)."""
    fields = {"address": message.address, "transport": Transport.AGENT, "agent_version": message.agent_version,
              "labels": message.labels, "probe_port": message.probe_port, "registered_at": now,
              "gpu_telemetry": message.gpu_telemetry, "gpu_telemetry_reason": message.gpu_telemetry_reason or ""}
    if node is None:
        try:
            with transaction.atomic():  # a savepoint: the outer transaction survives the refusal
                return Node.objects.create(hostname=message.hostname, **fields), None
        except IntegrityError:
            # Another registration created the same hostname since we looked: that one won.
            raise RegistrationRefused(f"Node {message.hostname!r} was registered just now by another agent.",
                                      403) from None
    previous = {"address": node.address, "agent_version": node.agent_version, "transport": node.transport}
    Node.objects.filter(pk=node.pk).update(**fields)
    for name, value in fields.items():
        setattr(node, name, value)
    ApiToken.objects.filter(node=node, scope=Scope.AGENT, revoked_at__isnull=True).update(revoked_at=now)
    return node, previous


def _record_registration(node: Node, message: wire.Register, *, actor: str, previous: dict | None, now) -> None:
    again = "" if previous is None else "re-registered (its earlier agent tokens revoked); "
    record_event(
        EventKind.NODE_REGISTER, actor=actor, node=node, created_at=now,
        reason=f"{again}agent {message.agent_version} registered with {len(message.gpus)} GPU(s)"
        + ("" if message.gpu_telemetry else f"; no GPU telemetry: {message.gpu_telemetry_reason}"),
        evidence={"address": message.address, "labels": message.labels,
                  "gpus": [dump(g) for g in message.gpus], "previous": previous},
    )


_GPU_UUID_LEN = GPU._meta.get_field("uuid").max_length or 80
_GPU_NAME_LEN = GPU._meta.get_field("name").max_length or 100


def _record_gpus(node: Node, gpus: list[wire.GpuInfo]) -> None:
    known = {g.index: g for g in GPU.objects.filter(node=node)}
    for info in gpus:
        # The wire allows longer names and uuids (what NVML reports) than the columns hold: clipped, and
        # compared clipped, so that a long uuid is not taken for a different card at every registration.
        values = {"uuid": clip(info.uuid, _GPU_UUID_LEN), "name": clip(info.name, _GPU_NAME_LEN),
                  "memory_total_mb": info.memory_total // 2**20}
        gpu = known.get(info.index)
        if gpu is None:
            GPU.objects.create(node=node, index=info.index, **values)
        elif any(getattr(gpu, k) != v for k, v in values.items()):
            # A different card in the slot (replaced hardware): its history is not this card's.
            fresh = gpu.uuid != info.uuid
            GPU.objects.filter(pk=gpu.pk).update(**values, **({"last_sample": {}, "last_sample_at": None,
                                                              "health": Health.UNKNOWN} if fresh else {}))


def _stamp_heartbeat(node: Node, now, **fields) -> None:
    deadline = now + heartbeat_timeout(base_heartbeat_interval_s())  # what registration announces
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now, heartbeat_deadline=deadline, **fields)
    node.last_heartbeat_at, node.heartbeat_deadline = now, deadline
    for name, value in fields.items():
        setattr(node, name, value)


#: The columns one heartbeat writes, in ``_HEARTBEAT_SQL``'s order.
_HEARTBEAT_FIELDS = ("last_heartbeat_at", "heartbeat_deadline", "running", "gpu_telemetry", "gpu_telemetry_reason",
                     "last_heartbeat_seq", "agent_draining", "spooled", "telemetry_dropped")


@functools.cache
def _heartbeat_sql() -> str:
    """One statement for the fleet's most frequent request: stamp the node, and read back what the
    heartbeat must act on (health and schedulability as they are now, not as the token's join saw
    them, and whether any command is open). Written once from the models' own names: the ORM's
    ``update()`` plus the open-commands query cost ~3.5 ms of query compilation per heartbeat, more than
    the database's work, and 1,024 agents send 200 heartbeats a second (docs/benchmarks/fleet.md)."""
    node, command = Node._meta, NodeCommand._meta
    q = connections[Node.objects.db].ops.quote_name
    table, pk = q(node.db_table), q(node.pk.column)
    columns = ", ".join(f"{q(node.get_field(name).column)} = %s" for name in _HEARTBEAT_FIELDS)
    states = ", ".join("%s" for _ in CommandState.OPEN)
    health, schedulability = q(node.get_field("health").column), q(node.get_field("schedulability").column)
    return (f"UPDATE {table} SET {columns} WHERE {pk} = %s RETURNING {health}, {schedulability}, "  # noqa: S608 - names from the models
            f"EXISTS (SELECT 1 FROM {q(command.db_table)} c WHERE c.{q(command.get_field('node').column)} = "
            f"{table}.{pk} AND c.{q(command.get_field('state').column)} IN ({states}))")


def _stamp_beat(node: Node, now, interval_s: float, **fields) -> bool:
    """``_stamp_heartbeat`` in one statement, the deadline ``HEARTBEAT_MISSES`` of ``interval_s``;
    refreshes ``node``'s health and schedulability and says whether the node has open commands."""
    deadline = now + heartbeat_timeout(interval_s)
    fields.update(last_heartbeat_at=now, heartbeat_deadline=deadline)
    connection = connections[Node.objects.db]
    values = [Node._meta.get_field(name).get_db_prep_save(fields[name], connection) for name in _HEARTBEAT_FIELDS]
    with connection.cursor() as cursor:
        cursor.execute(_heartbeat_sql(), [*values, node.pk, *sorted(CommandState.OPEN)])
        row = cursor.fetchone()
    if row is None:
        raise Node.DoesNotExist(f"node {node.pk} is gone")
    for name, value in fields.items():
        setattr(node, name, value)
    node.health, node.schedulability = row[0], row[1]
    return bool(row[2])


def record_heartbeat(node: Node, beat: wire.Heartbeat) -> wire.HeartbeatResponse:
    """The agent is alive: move the deadline, note what it runs, answer with its open commands (and,
    to an agent that follows it, the interval to heartbeat at)."""
    for name in ("seq", "spooled", "telemetry_dropped"):
        check_range(getattr(beat, name), name)
    paced = beat.interval_s is not None
    interval = heartbeat_interval_s() if paced else base_heartbeat_interval_s()
    commands_open = _stamp_beat(node, timezone.now(), interval, running=[dump(r) for r in beat.running],
                                gpu_telemetry=beat.gpu_telemetry, gpu_telemetry_reason=beat.gpu_telemetry_reason or "",
                                last_heartbeat_seq=beat.seq, agent_draining=beat.draining, spooled=beat.spooled,
                                telemetry_dropped=beat.telemetry_dropped)
    actor = f"node:{node.hostname}"
    if node.health in Health.AWAITING:
        _came_alive(node, actor=actor)
    if node.schedulability == Schedulability.DRAINING and not beat.running:
        finish_drain(node, actor=actor, reason="the agent runs no generation any more")
    return wire.HeartbeatResponse(commands=pending_commands_for(node) if commands_open else [],
                                  heartbeat_interval_s=interval if paced else None)


def _came_alive(node: Node, *, actor: str) -> None:
    """A node that was unknown or unreachable sent a sign of life: judge it afresh."""
    if node.health not in Health.AWAITING:
        return
    if not node.gpu_telemetry:
        # The heartbeat is all there is to go by; the reason is shown to operators as is.
        set_health(node, Health.HEALTHY, actor=actor, evidence={"gpu_telemetry": False},
                   reason=f"agent alive; no GPU telemetry ({node.gpu_telemetry_reason or 'no reason given'})")
        return
    since = timezone.now() - timedelta(seconds=FRESH_SAMPLE_S)
    samples = list(GPU.objects.filter(node=node, last_sample_at__gte=since).values_list("last_sample", flat=True))
    verdict = rules.evaluate_node(samples, thresholds(), idle=not node.running)
    if verdict.health == rules.UNKNOWN:
        set_health(node, Health.UNKNOWN, actor=actor, reason="agent alive; waiting for GPU telemetry")
    else:
        set_health(node, verdict.health, actor=actor, evidence=verdict.evidence,
                   reason="; ".join(verdict.reasons) or "agent alive; latest GPU samples are within limits")


# --- health ---------------------------------------------------------------------------------------

def set_health(node: Node, new: str, *, reason: str, evidence: dict | None = None,
               actor: str = "system:health") -> bool:
    """Move ``node`` to health ``new`` (compare-and-set); returns whether it changed.

    Appends a ``node.health`` event and, after commit, sends ``node_health_changed``. A node that
    turns unhealthy is drained when the policy says so (``NIGHTWATCH["AUTO_DRAIN_UNHEALTHY"]``).
    """
    old = node.health
    if new == old:
        return False
    now = timezone.now()
    evidence = evidence or {}
    with transaction.atomic():
        if not Node.objects.filter(pk=node.pk, health=old).update(health=new, health_reason=reason,
                                                                   health_changed_at=now):
            node.refresh_from_db(fields=["health", "health_reason", "health_changed_at"])
            return False
        event = record_event(EventKind.NODE_HEALTH, actor=actor, node=node, old_state=old, new_state=new,
                             reason=reason, evidence=evidence, created_at=now)
        node.health, node.health_reason, node.health_changed_at = new, reason, now
        signals.send_on_commit(signals.node_health_changed, node=node, old=old, new=new, evidence=evidence,
                               reasons=list(evidence.get("reasons") or [reason]), event_id=event.pk)
        if new == Health.UNHEALTHY and settings.NIGHTWATCH.get("AUTO_DRAIN_UNHEALTHY", True):
            drain_node(node, actor=POLICY, reason=f"unhealthy: {reason}")
    return True


# --- schedulability -------------------------------------------------------------------------------

def drain_node(node: Node, *, actor: str, reason: str) -> bool:
    """Take ``node`` out of scheduling; returns False if it already was out.

    It becomes ``draining`` while a generation still runs there and ``drained`` otherwise; an
    agent is told with a ``drain`` command. Stopping the generation is the orchestrator's call.
    """
    if node.schedulability != Schedulability.ACTIVE:
        return False
    busy = bool(node.running) or workload().runs_live_generation(node)
    new = Schedulability.DRAINING if busy else Schedulability.DRAINED
    with transaction.atomic():
        event = _move_schedulability(node, new, kind=EventKind.NODE_DRAIN, actor=actor, reason=reason,
                                     drain_reason=reason)
        if event is None:
            return False
        if node.transport == Transport.AGENT:
            enqueue_command(node, CommandKind.DRAIN, payload={"reason": reason[:500]}, actor=actor,
                            idempotency_key=f"drain:{event.pk}")
    return True


def finish_drain(node: Node, *, actor: str, reason: str) -> bool:
    """A draining node runs nothing any more: it is drained."""
    if node.schedulability != Schedulability.DRAINING:
        return False
    return _move_schedulability(node, Schedulability.DRAINED, kind=EventKind.NODE_DRAINED, actor=actor,
                                reason=reason) is not None


def undrain_node(node: Node, *, actor: str, reason: str) -> bool:
    """Put ``node`` back into scheduling; returns False if it was not out.

    A lemon is undrained too, but placement still keeps it out until its lemon count is cleared
    (``clear_lemon``, a separate decision): the audit row says so (``lemon_warning``)."""
    if node.schedulability == Schedulability.ACTIVE:
        return False
    warning = lemon_warning(node)
    extra = {"warning": warning, "lemon_count": node.lemon_count} if warning else {}
    with transaction.atomic():
        if _move_schedulability(node, Schedulability.ACTIVE, kind=EventKind.NODE_UNDRAIN, actor=actor,
                                reason=f"{reason} (warning: {warning})" if warning else reason, evidence=extra,
                                drain_reason="") is None:
            return False
        # A drain the agent has not picked up yet must not reach it after the undrain.
        NodeCommand.objects.filter(node=node, kind=CommandKind.DRAIN, state__in=CommandState.OPEN).update(
            state=CommandState.EXPIRED, detail=f"superseded by an undrain ({actor})")
    return True


def lemon_warning(node: Node) -> str | None:
    """Why an undrained ``node`` still takes no work, when it is a lemon; else None."""
    return LemonPolicy.current().warning(node.hostname, node.lemon_count)


def _move_schedulability(node: Node, new: str, *, kind: EventKind, actor: str, reason: str,
                         evidence: dict | None = None, **fields) -> Event | None:
    old = node.schedulability
    now = timezone.now()
    with transaction.atomic():
        if not Node.objects.filter(pk=node.pk, schedulability=old).update(
                schedulability=new, schedulability_changed_at=now, **fields):
            node.refresh_from_db(fields=["schedulability", "drain_reason", "schedulability_changed_at"])
            return None
        event = record_event(kind, actor=actor, node=node, old_state=old, new_state=new, reason=reason,
                             created_at=now, evidence={"health": node.health, **(evidence or {})})
    node.schedulability, node.schedulability_changed_at = new, now
    for name, value in fields.items():
        setattr(node, name, value)
    return event


# --- blame ----------------------------------------------------------------------------------------

def blame_node(node: Node, *, actor: str, reason: str, evidence: dict | None = None) -> int:
    """Count an incident against ``node`` (its lemon count); returns the new count."""
    with transaction.atomic():
        Node.objects.filter(pk=node.pk).update(lemon_count=F("lemon_count") + 1)
        node.refresh_from_db(fields=["lemon_count"])
        record_event(EventKind.NODE_BLAME, actor=actor, node=node, old_state=str(node.lemon_count - 1),
                     new_state=str(node.lemon_count), reason=reason, evidence=evidence)
    return node.lemon_count


def clear_lemon(node: Node, *, actor: str, reason: str) -> int:
    """An operator vouches for the node again (after a repair): its lemon count starts over, and
    placement may pick it again once it is active (undrain is a separate action). Returns the count
    it had; clearing a count that is already 0 changes and records nothing."""
    with transaction.atomic():
        old = Node.objects.select_for_update().values_list("lemon_count", flat=True).get(pk=node.pk)
        if old:
            Node.objects.filter(pk=node.pk).update(lemon_count=0)
            record_event(EventKind.NODE_LEMON_CLEARED, actor=actor, node=node, old_state=str(old), new_state="0",
                         reason=reason)
    node.lemon_count = 0
    return old
