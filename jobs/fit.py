"""Placement explains itself: whether a job can ever fit the fleet, and why a pending one waits.

``refusal`` is asked at launch: a spec the registered fleet can never hold (more nodes than are
registered, more GPUs per node than any node has) is refused with a 422 naming the field, unless
the request says ``"queue": true`` (nodes are on their way). Before any node has registered there
is no fleet to judge by, and nothing is refused. ``waiting`` is asked by the job's
status (API, dashboard, CLI) while it is pending: how many nodes placement could use now, how many
it needs, and what keeps the others out (drained, lemons, unhealthy or unreachable, running other
jobs) — counted in the database (a handful of COUNT queries), never loaded.

The judgements are pure functions of a ``Fleet`` snapshot (``never_fits``, ``waiting_reason``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from django.db.models import Count, Max, Q

from jobs.choices import JobState
from jobs.launching import free_node_count
from jobs.models import Job
from jobs.policies import RecoveryPolicy
from nodes.choices import Health, Schedulability
from nodes.models import Node
from nodes.policies import LemonPolicy
from nodes.transports import TRANSPORTS


@dataclass(frozen=True)
class Fleet:
    """What placement has to choose from, counted once."""

    registered: int  # nodes of a transport that can launch, in any state
    usable: int  # placement's candidates now: active, usably healthy, not a lemon, running no other job
    drained: int  # draining or drained (lemons counted as lemons)
    lemons: int  # lemon count at the threshold: kept out until cleared
    unhealthy: int  # active and not a lemon, but unhealthy, unreachable or not yet judged
    busy: int  # would be usable, but run another job's live generation
    max_gpus: int | None  # the most GPUs a registered node reports; None: no node reports GPUs


def fleet() -> Fleet:
    lemon = LemonPolicy.current().incidents
    nodes = Node.objects.filter(transport__in=list(TRANSPORTS))
    not_lemon = Q(lemon_count__lt=lemon)
    counts = nodes.aggregate(
        registered=Count("pk"),
        lemons=Count("pk", filter=~not_lemon),
        drained=Count("pk", filter=not_lemon & ~Q(schedulability=Schedulability.ACTIVE)),
        unhealthy=Count("pk", filter=not_lemon & Q(schedulability=Schedulability.ACTIVE)
                        & ~Q(health__in=Health.USABLE)),
    )
    usable = free_node_count()
    schedulable = nodes.filter(not_lemon, schedulability=Schedulability.ACTIVE, health__in=Health.USABLE).count()
    max_gpus = (nodes.annotate(gpu_count=Count("gpus")).filter(gpu_count__gt=0)
                .aggregate(m=Max("gpu_count"))["m"])
    return Fleet(usable=usable, busy=max(0, schedulable - usable), max_gpus=max_gpus, **counts)


def never_fits(*, nnodes: int, nproc_per_node: int, accelerator: str, fleet: Fleet,
               allow_shrink: bool = False) -> dict[str, str]:
    """Why the registered fleet can never hold this spec, by field; empty when it can (now or later).

    No verdict before any node registered: a fresh control plane is set up before its agents, and a
    job launched then waits for them (its status says so)."""
    problems: dict[str, str] = {}
    if not fleet.registered:
        return problems
    if fleet.registered < nnodes and not allow_shrink:
        problems["nnodes"] = (f"{nnodes} nodes needed, but {fleet.registered} node(s) are registered: it could never "
                              "be placed. Send \"queue\": true to wait for nodes that are still to register.")
    if accelerator == "gpu" and fleet.max_gpus is not None and nproc_per_node > fleet.max_gpus:
        problems["nproc_per_node"] = (f"{nproc_per_node} GPUs per node needed, but no registered node has more than "
                                      f"{fleet.max_gpus}. Send \"queue\": true to wait for bigger nodes.")
    return problems


def waiting_reason(*, nnodes: int, fleet: Fleet, allow_shrink: bool = False) -> str:
    """One sentence: "not enough healthy nodes: have 2, need 4096 (of 3 registered: 1 drained, …)"."""
    kept_out = [(fleet.drained, "drained or draining"), (fleet.lemons, "lemons (kept out until cleared)"),
                (fleet.unhealthy, "unhealthy, unreachable or not yet judged"), (fleet.busy, "running other jobs")]
    why = ", ".join(f"{count} {what}" for count, what in kept_out if count)
    shrink = " (its policy allows a smaller start, but none is free)" if allow_shrink and not fleet.usable else ""
    return (f"not enough healthy nodes: have {fleet.usable}, need {nnodes}{shrink}"
            f" (of {fleet.registered} registered{': ' + why if why else ''})")


def refusal(spec: dict) -> dict[str, str]:
    """``never_fits`` for a validated launch spec."""
    return never_fits(nnodes=spec.get("nnodes", 1), nproc_per_node=spec.get("nproc_per_node", 1),
                      accelerator=spec.get("accelerator", "gpu"), fleet=fleet(),
                      allow_shrink=bool((spec.get("recovery_policy") or {}).get("allow_shrink")))


def waiting(job: Job) -> dict | None:
    """Why a pending job waits, for its status; None for a job that is not waiting for nodes."""
    if job.state != JobState.PENDING:
        return None
    snapshot = fleet()
    shrink = RecoveryPolicy.of(job).allow_shrink
    never = never_fits(nnodes=job.nnodes, nproc_per_node=job.nproc_per_node, accelerator=job.accelerator,
                       fleet=snapshot, allow_shrink=shrink)
    reason = waiting_reason(nnodes=job.nnodes, fleet=snapshot, allow_shrink=shrink)
    if snapshot.usable >= job.nnodes or (shrink and snapshot.usable):
        # Enough nodes are free: the next placement sweep takes it (seconds).
        reason = f"enough healthy nodes are free (have {snapshot.usable}, need {job.nnodes}): placing it shortly"
    if never:
        reason += "; as the fleet stands it can never be placed: " + " ".join(never.values())
    return {"reason": reason, "have": snapshot.usable, "need": job.nnodes, "never_fits": never,
            "fleet": {k: v for k, v in asdict(snapshot).items() if k != "usable"}}
