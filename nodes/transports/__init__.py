"""How a generation reaches its nodes: one small interface, one module per kind, one map.

``jobs.launching`` and ``jobs.orchestrator`` call ``for_nodes(nodes).launch(...)`` / ``.stop(...)``
and never care whether an agent pulls a command or Slurm runs a batch job. What comes back —
exits, stop confirmations — always arrives the same way: ``nodes.signals.generation_exited``
(and ``command_acked``), which ``jobs.receivers`` turns into the orchestrator's entry points.
"""

from __future__ import annotations

from collections.abc import Iterable

from nodes.choices import Transport
from nodes.transports.agent import AgentTransport
from nodes.transports.base import Launch, NodeTransport
from nodes.transports.slurm import SlurmTransport

#: Transports that can run a generation. SSH nodes are reachable for bootstrap only: not placed.
TRANSPORTS: dict[str, NodeTransport] = {
    Transport.AGENT: AgentTransport(),
    Transport.SLURM: SlurmTransport(),
}


class MixedTransports(ValueError):
    """A generation's nodes must all be reached the same way (one batch job, or agents only)."""


def for_nodes(nodes: Iterable) -> NodeTransport:
    """The transport that runs a generation on ``nodes`` (all of one kind)."""
    kinds = {n.transport for n in nodes}
    if len(kinds) != 1:
        raise MixedTransports(f"a generation's nodes use {len(kinds)} transports ({', '.join(sorted(kinds))})")
    kind = kinds.pop()
    try:
        return TRANSPORTS[kind]
    except KeyError:
        raise MixedTransports(f"nodes of transport {kind!r} cannot run a generation") from None


__all__ = ["TRANSPORTS", "Launch", "MixedTransports", "NodeTransport", "for_nodes"]
