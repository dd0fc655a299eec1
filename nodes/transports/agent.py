"""Agents pull their commands with each heartbeat: launch and stop are queued ``NodeCommand`` rows."""

from __future__ import annotations

from nodes import services
from nodes.transports.base import Launch


class AgentTransport:
    name = "agent"

    def launch(self, launch: Launch) -> None:
        job, number = launch.job, launch.generation
        for node, payload in zip(launch.nodes, launch.payloads, strict=True):
            services.enqueue_command(node, "launch", job=job, generation=number, payload=payload,
                                     idempotency_key=f"launch:{job.pk}:{number}:{node.pk}")

    def stop(self, job, generation: int, nodes: list, *, grace_s: float, reason: str) -> None:
        for node in nodes:
            services.enqueue_command(node, "stop", job=job, generation=generation,
                                     idempotency_key=f"stop:{job.pk}:{generation}:{node.pk}",
                                     payload={"grace_s": grace_s, "reason": reason[:500]})
