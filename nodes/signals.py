"""What the nodes app tells the rest of the control plane (the jobs orchestrator connects here).

Every signal but one is sent by ``nodes.services`` only, **after the transaction that recorded it
has committed** (so a receiver sees the rows and may enqueue Celery tasks with their keys), once per
fact: a replayed agent event or a repeated acknowledgement sends nothing. Signals are sent with
``send_robust``: a failing receiver is logged and never turns an agent's request into a 500,
because the agent would retry, the retry would be a duplicate, and the fact would be lost.

All keyword arguments are plain JSON-able values except ``node`` (a ``nodes.models.Node``) and
the times of ``fleet_contact_restored``; ``sender`` is always ``Node``. Receivers must accept
``**kwargs`` (more may be added).
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.dispatch import Signal

from nodes.models import Node

log = logging.getLogger(__name__)

#: A generation's processes ended on a node (agent events ``exited`` and ``stopped``).
#: ``node``; ``job_id`` (int, or None when the agent named a job we do not know); ``generation``
#: (int or None); ``kind`` ("exited": it ended on its own, "stopped": the agent stopped it on
#: command); ``detail`` (dict, ``agents.protocol.agent.ExitReport`` as JSON: exit_code, ranks,
#: root_cause_rank, signature, error_line, log_tail, requested_stop, xids …); ``time`` (datetime,
#: by the agent's clock); ``record_id`` (the ``AgentEventRecord`` pk, the evidence).
generation_exited = Signal()

#: The agent started torchrun for a generation (agent event ``launched``). ``node``, ``job_id``,
#: ``generation``, ``detail`` (``LaunchedDetail`` as JSON: pid, log_path, command), ``time``, ``record_id``.
generation_launched = Signal()

#: The agent refused to launch a generation because the node failed its pre-launch health check
#: (agent event ``launch_refused``): the node must not be used for that generation.
#: ``node``, ``job_id``, ``generation``, ``detail`` (``HealthReport`` as JSON: ok, reason, checks,
#: bandwidth), ``reason`` (str, the failed checks in words), ``time``, ``record_id``.
launch_refused = Signal()

#: An on-demand health check finished (agent event ``health_check``). ``node``, ``job_id`` and
#: ``generation`` (None unless the check was for a job), ``ok`` (bool), ``detail`` (``HealthReport``
#: as JSON), ``time``, ``record_id``. Bandwidth results are already stored in ``NodePairBandwidth``.
health_checked = Signal()

#: The agent confirmed a drain (agent event ``drain_ack``). ``node``, ``detail`` (``DrainAck`` as
#: JSON: reason, running), ``running`` (list of {job, generation, pids, started_at}), ``time``, ``record_id``.
drain_acked = Signal()

#: ``Node.health`` changed (``nodes.services.set_health``). ``node``, ``old`` and ``new`` (``Health``
#: values), ``reasons`` (list of str), ``evidence`` (dict), ``event_id`` (the ``core.Event`` pk).
node_health_changed = Signal()

#: Nodes turned unreachable together (the heartbeat sweeper's batch, ``nodes.services.sweeper``),
#: sent instead of ``node_health_changed`` for each so that a receiver queues one task for the
#: batch. ``new`` (``Health.UNREACHABLE``); ``changes`` (list of dicts: ``node``, ``old``,
#: ``reasons`` and ``event_id`` as in ``node_health_changed``).
nodes_health_changed = Signal()

#: Contact is back after a fleet-wide silence (``nodes.services.silence``) or an overload hold
#: (``nodes.services.overload``): deadlines that ran out while no node could reach us start over.
#: The one signal sent *inside* the transaction that records the restore, with ``send``: a receiver
#: restarts the deadlines of its own work in the same transaction (both start over, or neither) and
#: returns how many it moved (an int), which the ``fleet.silence`` or ``fleet.overload`` event
#: counts as the job deadlines. ``now`` (datetime); ``grace`` (timedelta, one heartbeat timeout:
#: restart no deadline sooner than this); ``silent_since`` (datetime: when the silence or the hold began).
fleet_contact_restored = Signal()

#: The agent acknowledged a command for the first time (``nodes.services.ack_command``).
#: ``node``, ``command_id`` (int), ``kind`` ("launch", "stop", "drain", "health_check"), ``job_id``
#: and ``generation`` (None for commands not tied to a job), ``status`` ("done", "refused",
#: "failed"), ``state`` (the command's new ``CommandState``), ``detail`` (str, the agent's words).
command_acked = Signal()


def send_on_commit(signal: Signal, **kwargs) -> None:
    """Send ``signal`` (sender ``Node``) once the current transaction commits; log failing receivers."""
    transaction.on_commit(lambda: _send(signal, kwargs))


def _send(signal: Signal, kwargs: dict) -> None:
    for receiver, result in signal.send_robust(sender=Node, **kwargs):
        if isinstance(result, Exception):
            log.error("receiver %r of a nodes signal failed", receiver, exc_info=result)
