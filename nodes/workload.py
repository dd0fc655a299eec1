"""What the nodes app asks about the work placed on its nodes; the jobs app answers.

``nodes`` sits below ``jobs`` and imports nothing from it, yet two of its verbs need an answer
only the jobs app can give: refusing an agent's events for jobs that exist but are not placed on
the agent's node, and telling a node that still runs a live generation (it drains) from an idle
one (it is drained at once). The jobs app registers its answers at ``AppConfig.ready()``
(``jobs.receivers.WORKLOAD``). Which generations are placed on a node needs no answer: it is the
reverse relation ``Node.generations``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from django.core.exceptions import ImproperlyConfigured

from nodes.models import Node


class Workload(Protocol):
    def existing_jobs(self, job_ids: Collection[int]) -> set[int]:
        """Those of ``job_ids`` that name a job (events naming no known job are kept, unlinked)."""

    def runs_live_generation(self, node: Node) -> bool:
        """Whether a generation of a job that is still active runs (has not ended) on ``node``."""


_answers: Workload | None = None


def register(answers: Workload) -> None:
    """Called once, by the jobs app's ``ready()``."""
    global _answers
    _answers = answers


def workload() -> Workload:
    if _answers is None:
        raise ImproperlyConfigured("nothing answers nodes.workload: the jobs app registers it at ready()")
    return _answers

