"""Starting a generation: place it on healthy nodes, pick the restore point, send launch commands.

``start_generation`` is the one way a job gets processes: the first launch, an automatic
restart, an approved resume and a rollback all end here, inside one transaction that bumps the
generation (the fencing token), records which nodes run it and from which checkpoint, and queues
its launch through the nodes' transport (``nodes.transports``: one command per agent, or one
Slurm batch job) — so either all of that happened or none of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import DurationField, ExpressionWrapper, F, Max
from django.utils import timezone

from checkpoints.models import Checkpoint
from checkpoints.paths import checkpoint_dir
from checkpoints.policies import CheckpointPolicy
from checkpoints.services import restore_point
from core.tokens import revoke_generation_tokens
from jobs import state
from jobs.choices import IncidentState, JobState
from jobs.models import Generation, Incident, Job
from jobs.placement import Candidate, place
from jobs.policies import RecoveryPolicy
from nodes import transports
from nodes.choices import Health, Schedulability
from nodes.models import Node
from nodes.policies import LemonPolicy
from nodes.services import probe_peers_for
from nodes.transports import TRANSPORTS

log = logging.getLogger(__name__)

#: With history, a new generation may take this many times the job's slowest earlier start.
STARTUP_HISTORY_FACTOR = 3


def startup_timeout_s(job: Job) -> float:
    """How long a generation of ``job`` launched now may take to report its first step before it
    counts as hung.

    A fixed start-up allowance must cover the slowest job of the cluster, so a job whose
    generations start in seconds would sit for minutes on a rank that hung while starting. The
    job's own history says what "too slow" means for it:

    1. ``recovery_policy.startup_timeout_s``, when the job sets it.
    2. Else, when earlier generations of the job reached their first step: 3 × the slowest of
       those starts (launch → first step report, ``Generation.started_at`` → ``first_step_at``),
       never below ``STARTUP_TIMEOUT_FLOOR_S`` (one quick start says little about the next, which
       may restore a bigger checkpoint on a colder node).
    3. Else ``STARTUP_TIMEOUT_S``.
    """
    configured = RecoveryPolicy.of(job).startup_timeout_s
    if configured:
        return float(configured)
    start = ExpressionWrapper(F("first_step_at") - F("started_at"), output_field=DurationField())
    slowest = (Generation.objects.filter(job=job, first_step_at__isnull=False)
               .aggregate(slowest=Max(start))["slowest"])
    if slowest is None:
        return float(settings.NIGHTWATCH["STARTUP_TIMEOUT_S"])
    return max(float(settings.NIGHTWATCH["STARTUP_TIMEOUT_FLOOR_S"]),
               STARTUP_HISTORY_FACTOR * slowest.total_seconds())


def spec_hash(job: Job) -> str:
    """What "the same config" means when deciding that a failure repeats deterministically."""
    spec = {"entrypoint": job.entrypoint, "args": job.args, "nproc_per_node": job.nproc_per_node,
            "nccl_profile": job.nccl_profile}
    if job.module:  # only then: the hashes of script jobs stay what they were
        spec["module"] = job.module
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def candidates(job: Job) -> list[Node]:
    """Nodes that may take this job now: active (not drained, not a lemon), usably healthy,
    reachable by a transport that can launch, and not running another job's live generation."""
    return list(_free_nodes(exclude_job=job))


def free_node_count() -> int:
    """How many nodes run no live generation and may take one: the candidates of any job that is not
    running, counted in the database (one query) instead of loaded."""
    return _free_nodes(exclude_job=None).count()


def _free_nodes(*, exclude_job: Job | None):
    # Not null: a live generation whose node was deleted yields a NULL here, and NOT IN (..., NULL)
    # is never true, so that one generation made every node of the fleet look busy.
    busy = Generation.objects.filter(job__state__in=JobState.ACTIVE, ended_at__isnull=True, nodes__isnull=False)
    if exclude_job is not None:
        busy = busy.exclude(job=exclude_job)
    # A lemon stays out even when undrained: only clearing its count lets it back (nodes.policies).
    return (Node.objects.filter(schedulability=Schedulability.ACTIVE, health__in=Health.USABLE,
                                transport__in=list(TRANSPORTS), lemon_count__lt=LemonPolicy.current().incidents)
            .exclude(pk__in=busy.values("nodes")))


def one_transport(pool: list[Node], *, previous: set[str], nnodes: int) -> list[Node]:
    """The candidates of the one transport this generation will use: a generation runs entirely
    on agents or entirely as one Slurm job. The previous generation's transport comes first, then
    the first (in ``TRANSPORTS`` order) with enough nodes, then the largest."""
    groups = {kind: [n for n in pool if n.transport == kind] for kind in TRANSPORTS}
    before = {n.transport for n in pool if n.hostname in previous}

    def rank(kind: str) -> tuple:
        short = len(groups[kind]) < nnodes
        return kind not in before, short, -len(groups[kind]) if short else 0

    return groups[min(groups, key=rank)]  # min() keeps TRANSPORTS order among equals


@dataclass(frozen=True)
class Resume:
    """A human's decision to resume a paused job: applied in the same transaction as the launch,
    so nothing (the sweeper included) ever sees the job between ``paused`` and the new generation."""

    reason: str
    evidence: dict
    updates: dict  # Job fields to set with it (breaker reset, rollback branch…)


def start_generation(job: Job, *, actor: str, reason: str, restart: bool,
                     resume_from: Checkpoint | None = None, resume: Resume | None = None) -> Generation | None:
    """Launch the job's next generation; returns it, or None when no node can take it (paused).

    1. Place: previous nodes first, spares last; shrink only when the policy allows.
    2. Restore point: the checkpoint given (a rollback), else the newest one of the active
       branch that re-verifies on disk now.
    3. In one transaction: enter ``initializing`` (bumps the generation), record the generation,
       queue its launch through the nodes' one transport (a command per agent, or a Slurm batch
       job), and stamp open incidents as relaunched.
    """
    job.refresh_from_db()
    resized = job.resize_to
    if resized:  # a resize asked for (jobs.services.resize_job): this generation takes the new shape
        job.nnodes, job.nproc_per_node = resized["nnodes"], resized["nproc_per_node"]
    pool = candidates(job)
    previous = set(
        Generation.objects.filter(job=job, number=job.generation).values_list("nodes__hostname", flat=True)
    )
    pool = one_transport(pool, previous=previous, nnodes=job.nnodes)
    placement = place([Candidate(n.hostname, n.is_spare, n.hostname in previous) for n in pool],
                      nnodes=job.nnodes, allow_shrink=RecoveryPolicy.of(job).allow_shrink)
    if not placement.ok:
        if resume is not None:
            raise state.TransitionConflict(f"job {job.pk}: no healthy node is free to resume on "
                                           f"({job.nnodes} needed, {len(pool)} free)")
        _wait_for_nodes(job, actor=actor, free=len(pool))
        return None
    by_name = {n.hostname: n for n in pool}
    nodes = [by_name[h] for h in placement.hostnames]
    checkpoint = resume_from if resume_from is not None else restore_point(job)
    startup_s = startup_timeout_s(job)
    now = timezone.now()
    with transaction.atomic():
        if resume is not None:
            state.transition(job, JobState.RECOVERING, actor=actor, reason=resume.reason, evidence=resume.evidence,
                             expect_state=JobState.PAUSED)
            Job.objects.filter(pk=job.pk).update(**resume.updates)
            for name, value in resume.updates.items():  # the launch payload below reads them
                setattr(job, name, value)
        moved = state.transition(
            job, JobState.INITIALIZING, actor=actor, restart=restart,
            expect_state=frozenset({JobState.PENDING, JobState.RECOVERING}),
            reason=reason + (f" on {len(nodes)} of {job.nnodes} nodes" if placement.shrunk else ""),
            evidence={"nodes": list(placement.hostnames), "resume_from": checkpoint.location if checkpoint else None,
                      "shrunk": placement.shrunk},
        )
        number = moved.job.generation
        end_generations(Generation.objects.filter(job=job).exclude(number=number), now)
        generation = Generation.objects.create(job=job, number=number, world_size=len(nodes) * job.nproc_per_node,
                                               resumed_from=checkpoint, started_at=now)
        generation.nodes.set(nodes)
        Job.objects.filter(pk=job.pk).update(
            progress_deadline=now + timedelta(seconds=startup_s), quiesce_deadline=None,
            relaunch_after=None, pause_requested_at=None,
            **({"nnodes": job.nnodes, "nproc_per_node": job.nproc_per_node, "resize_to": None} if resized else {}),
        )
        # The nodes' transport queues the launch: agent commands, or one Slurm batch job.
        transports.for_nodes(nodes).launch(transports.Launch(
            job=job, generation=number, nodes=nodes,
            payloads=[_launch_payload(job, number, rank, nodes, checkpoint) for rank in range(len(nodes))]))
        Incident.objects.filter(job=job, state=IncidentState.OPEN, relaunched_at__isnull=True).update(
            relaunched_at=now
        )
    log.info("job %s generation %s launched on %s from %s", job.pk, number, placement.hostnames,
             checkpoint.location if checkpoint else "scratch")
    return generation


def end_generations(generations, now) -> int:
    """Stamp the end of those of ``generations`` (a queryset) that have not ended, and revoke their
    job tokens: the one place a generation ends, so that no token outlives it. Returns how many
    ended now."""
    ending = list(generations.filter(ended_at__isnull=True).values_list("pk", "job_id", "number"))
    if not ending:
        return 0
    ended = Generation.objects.filter(pk__in=[pk for pk, _, _ in ending], ended_at__isnull=True).update(ended_at=now)
    for _, job_id, number in ending:
        revoke_generation_tokens(job_id, [number])
    return ended


def _launch_payload(job: Job, number: int, node_rank: int, nodes: list[Node], checkpoint: Checkpoint | None) -> dict:
    host = nodes[0].address
    # Before it starts, each node probes its bandwidth to the job's other nodes and refuses to
    # launch on a pair below the expected ratio (agents without a probe server are not probed).
    peers = [n for n in nodes if n.pk != nodes[node_rank].pk and n.probe_port]
    return _snapshot_fields(job) | _inprocess_fields(job) | {
        "probe_peers": probe_peers_for(peers),
        "script": job.entrypoint or None,
        "module": job.module or None,
        "nnodes": len(nodes),
        "nproc_per_node": job.nproc_per_node,
        "node_rank": node_rank,
        "rdzv_endpoint": f"{host}:{job.rdzv_port}",
        "rdzv_id": f"nw-{job.pk}-g{number}",
        "rdzv_is_host": node_rank == 0,
        "args": list(job.args),
        "nccl_env": dict(job.nccl_profile),
        "hooks_url": settings.NIGHTWATCH["PUBLIC_URL"],
        "ckpt_dir": checkpoint_dir(job),
        "resume_from": checkpoint.location if checkpoint else None,
        "require_gpu": job.accelerator == "gpu",
        "skip_data": [list(r) for r in job.skip_data],
    }


def _snapshot_fields(job: Job) -> dict:
    """The launch's snapshot fields, only when the job's policy turns snapshots on: the hooks then
    restore a snapshot of any generation since the job's branch began (a relaunch after a crash
    loses at most ``snapshot_every`` steps), never one from before a rollback. Left out otherwise,
    so an agent that predates them still takes the launch (``agents.protocol.agent``)."""
    every = CheckpointPolicy.of(job).snapshot_every
    return {"snapshot_every": every, "branch_generation": job.branch_since_generation} if every else {}


def _inprocess_fields(job: Job) -> dict:
    """The launch's in-process restart budget, only when the job's policy turns them on (an agent
    that predates the field still takes every other launch)."""
    budget = RecoveryPolicy.of(job).inprocess_restarts
    return {"inprocess_restarts": budget} if budget else {}


def _wait_for_nodes(job: Job, *, actor: str, free: int) -> None:
    """No node can take the job now. A job that never ran waits, pending, for the sweeper's next
    try (nodes register and heal on their own); a job that lost its nodes pauses for a human."""
    reason = f"waiting for nodes: {job.nnodes} needed, {free} healthy and free"
    if job.state in (JobState.PAUSED, JobState.PENDING):
        log.info("job %s %s", job.pk, reason)
        return
    try:
        state.transition(job, JobState.PAUSED, actor=actor, reason=reason, pause_reason=reason)
    except state.TransitionError:
        log.warning("job %s could not be paused while waiting for nodes", job.pk)
