"""Verbs that change nodes. Views and the orchestrator call these; nothing else writes node state.

``fleet``: registration, heartbeats, health, drains and blame; ``sweeper``: the heartbeat sweeper
(and ``silence``, the fleet-silence watch it asks first); ``commands``: the agent command queue;
``ingest``: telemetry and agent events.
"""

from nodes.services.commands import (
    AckMismatch,
    Order,
    StaleCommand,
    ack_command,
    enqueue_command,
    enqueue_commands,
    expire_commands,
    pending_commands_for,
    probe_peers_for,
    request_health_check,
)
from nodes.services.fleet import (
    Registration,
    RegistrationRefused,
    blame_node,
    clear_lemon,
    drain_node,
    finish_drain,
    issue_bootstrap_token,
    lemon_warning,
    record_heartbeat,
    register_agent,
    set_health,
    thresholds,
    undrain_node,
)
from nodes.services.ingest import Ingested, ingest_telemetry, record_agent_events
from nodes.services.retention import prune_telemetry
from nodes.services.sweeper import expire_batch, expire_heartbeats, expire_one_heartbeat

__all__ = [
    "probe_peers_for",
    "request_health_check",
    "StaleCommand",
    "AckMismatch", "Ingested", "Registration", "RegistrationRefused", "ack_command", "blame_node", "clear_lemon",
    "drain_node", "enqueue_command", "enqueue_commands", "Order", "expire_batch", "expire_commands",
    "expire_heartbeats", "expire_one_heartbeat",
    "finish_drain",
    "ingest_telemetry", "issue_bootstrap_token", "lemon_warning", "pending_commands_for", "prune_telemetry",
    "record_agent_events",
    "record_heartbeat",
    "register_agent", "set_health", "thresholds", "undrain_node",
]
