"""Agents pull their commands with each heartbeat: launch and stop are queued ``NodeCommand`` rows,
one per node, queued for the whole generation at once."""

from __future__ import annotations

from nodes import services
from nodes.transports.base import Launch


class AgentTransport:
    name = "agent"

    def launch(self, launch: Launch) -> None:
        job, number = launch.job, launch.generation
        services.enqueue_commands("launch", [services.Order(node, payload, f"launch:{job.pk}:{number}:{node.pk}")
                                             for node, payload in zip(launch.nodes, launch.payloads, strict=True)],
                                  job=job, generation=number)

    def stop(self, job, generation: int, nodes: list, *, grace_s: float, reason: str) -> None:
        payload = {"grace_s": grace_s, "reason": reason[:500]}
        services.enqueue_commands("stop", [services.Order(node, payload, f"stop:{job.pk}:{generation}:{node.pk}")
                                           for node in nodes], job=job, generation=generation)
