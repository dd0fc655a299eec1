"""Who admission control turned away lately: nodes and job generations whose requests were refused.

A 503 is our failure, not the caller's: the agent or the training hooks behind a refused request
are alive and trying (``core.admission`` records the SHA-256 of each refused request's bearer
token in ``core.shared_counts``). The sweepers ask this module before they call a node unreachable
or a job hung, so that a control plane shedding load judges each caller by whether it tried, not
by whether we let it in: a node that died during an overload is still found a heartbeat timeout
after its last attempt, and a live one whose heartbeats were refused is not.

Digests are mapped to tokens that exist and are usable, so a made-up or revoked bearer names
nobody; a stolen token could only keep its own node or generation looking alive, which it could
do by heartbeating anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from core import shared_counts
from core.models import ApiToken, Scope


@dataclass(frozen=True)
class Refused:
    """The last refusal of each node's agent and of each (job, generation)'s hooks, within the window."""

    nodes: dict[int, datetime] = field(default_factory=dict)
    generations: dict[tuple[int, int], datetime] = field(default_factory=dict)


def refused_since(seconds: float, *, now: datetime) -> Refused | None:
    """Callers refused during the ``seconds`` before ``now``; None when the record cannot be read
    (no Redis, or Redis down: the caller must not assume nobody was refused). One Redis round
    trip, and one indexed query when anyone was refused."""
    digests = shared_counts.refused_callers(seconds, now=now.timestamp())
    if digests is None:
        return None
    if not digests:
        return Refused()
    nodes: dict[int, datetime] = {}
    generations: dict[tuple[int, int], datetime] = {}
    rows = (ApiToken.objects.usable().filter(digest__in=digests, scope__in=(Scope.AGENT, Scope.JOB))
            .values_list("digest", "scope", "node_id", "job_id", "generation"))
    for digest, scope, node_id, job_id, generation in rows:
        at = datetime.fromtimestamp(digests[digest], tz=UTC)
        if scope == Scope.AGENT:
            nodes[node_id] = max(at, nodes.get(node_id, at))
        else:
            generations[(job_id, generation)] = max(at, generations.get((job_id, generation), at))
    return Refused(nodes=nodes, generations=generations)
