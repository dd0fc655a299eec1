"""The interface every transport implements: launch a generation, stop it.

Both are called inside the caller's database transaction (``start_generation``, ``report_fault``),
so a transport only *records* what must happen and leaves side effects outside the database
(a process, a ``sbatch``) to after the commit: either the generation and its launch both exist,
or neither does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Launch:
    """One generation to start: the job, its number, its nodes in rank order, and for each node
    the launch payload (``agents.protocol.agent.LaunchPayload`` as a dict)."""

    job: object  # jobs.models.Job
    generation: int
    nodes: list  # [nodes.models.Node], rank order
    payloads: list[dict]


class NodeTransport(Protocol):
    name: str

    def launch(self, launch: Launch) -> None:
        """Queue the start of ``launch`` on its nodes (idempotent per job and generation)."""

    def stop(self, job, generation: int, nodes: list, *, grace_s: float, reason: str) -> None:
        """Queue the stop of ``generation`` on ``nodes`` (those not yet confirmed stopped).

        Confirmation comes back as an exit (``nodes.signals.generation_exited`` with kind
        ``stopped``) or an acknowledged stop command, which the orchestrator counts."""
