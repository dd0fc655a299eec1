"""Recovery orchestration: from a fault signal to a new generation (or a pause), safely.

    signal ─▶ report_fault ─▶ decide (jobs.policy) ─▶ incident + drains ─▶ quiescing (stop all ranks)
                                                          │
          every node confirms its ranks are gone ◀────────┘  (exit report or stop acknowledged)
                        │
          advance_recovery ─▶ recovering ─▶ (backoff) ─▶ start_generation  ─▶ first step ─▶ resolved
                        └──▶ paused (a human decides: approve_resume or rollback_to)

Every step is a compare-and-set state transition recorded in the database, and ``advance_recovery``
only looks at what is recorded, so the sweeper (``advance_one_recovery``) can finish a recovery
that a dead worker started, and running any step twice is harmless: exactly one new generation
results. A job is never relaunched until every node of the old generation has confirmed that its
processes are gone — one active generation, always.
"""

from __future__ import annotations

import errno
import logging
import math
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Max, Q
from django.utils import timezone

from checkpoints.models import Checkpoint
from checkpoints.tasks import relieve_disk_pressure
from core.events import EventKind, record_event
from core.models import Event
from core.text import clean_json, clip, one_line
from jobs import policy, state
from jobs.choices import Decision, IncidentKind, IncidentState, JobState
from jobs.launching import candidates, end_generations, free_node_count, spec_hash, start_generation
from jobs.models import Generation, Incident, Job, StepMetric, TrainingEvent
from jobs.policies import RecoveryPolicy
from nodes import services as node_services
from nodes import transports
from nodes.choices import Health
from nodes.models import Node
from nodes.policies import LemonPolicy

log = logging.getLogger(__name__)
SYSTEM = "system:orchestrator"
RESTARTING = frozenset({Decision.RESTART, Decision.RESTART_ON_SPARE, Decision.SHRINK})
#: ``Incident.classification``'s bound; the full reason is in the incident's evidence.
CLASSIFICATION_LEN = Incident._meta.get_field("classification").max_length
#: Further signals kept in an open incident's evidence.
MAX_FURTHER = 100
#: A job in these states has a generation whose faults we act on.
WATCHED = JobState.ACTIVE - {JobState.QUIESCING}
#: A job in these states hears of a change of its nodes' health: quiescing ones too, as a lost node
#: may be the cause of the fault they stop for (``_hang_was_a_partition``), and is further evidence
#: on their incident otherwise.
HEALTH_WATCHED = JobState.ACTIVE


# --- faults -----------------------------------------------------------------------------------

def report_fault(job_id: int, signal: str, *, generation: int, nodes: tuple[str, ...] = (), detail: dict | None = None,
                 fault_at=None, actor: str = SYSTEM, **evidence) -> Incident | None:
    """Turn one fault signal into an incident and a decision; None when it is not ours to act on.

    A signal about an older generation, or about a job already quiescing for another fault, is
    fenced off (recorded on the open incident as further evidence, never acted on twice).
    """
    now = timezone.now()
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if generation != job.generation:
            return None
        if job.state not in WATCHED:
            open_incident = _open_incident(job)
            if open_incident is not None and (
                    _hang_was_a_partition(job, open_incident, signal, nodes, detail, fault_at, actor=actor)
                    or _hang_was_a_crash(job, open_incident, signal, nodes, detail, fault_at, evidence,
                                         actor=actor)):
                return open_incident
            if open_incident is not None:
                further = open_incident.evidence.setdefault("further", [])
                if len(further) < MAX_FURTHER:  # a flapping signal must not grow one row without bound
                    further.append(clean_json({"signal": signal, "nodes": list(nodes), "detail": detail or {},
                                               "at": now.isoformat()}))
                    open_incident.save(update_fields=["evidence"])
            return None
        ev = _evidence(job, signal, nodes=nodes, **evidence)
        decision = policy.decide(ev)
        incident = Incident.objects.create(
            job=job, generation=Generation.objects.filter(job=job, number=generation).first(),
            kind=decision.classification, classification=clip(one_line(decision.reason), CLASSIFICATION_LEN),
            decision=decision.action,
            # The full reason is kept here: the classification column is bounded, the error it quotes is not.
            evidence=clean_json({"signal": signal, "nodes": list(nodes), "detail": detail or {}, **_jsonable(evidence),
                                 "reason": decision.reason, "config_hash": ev.config_hash,
                                 "restarts_in_window": ev.restarts_in_window, "max_restarts": ev.max_restarts,
                                 "propose_rollback": decision.propose_rollback, "page": decision.page}),
            fault_at=fault_at or flagged_fault_time(job, signal, generation, now), detected_at=now,
        )
        blamed = set(decision.drain) | (set(nodes) if decision.classification == "hardware" else set())
        if blamed:
            incident.nodes.set(Node.objects.filter(hostname__in=blamed))
        record_event(EventKind.INCIDENT_OPEN, actor=actor, job=job, generation=generation,
                     reason=decision.reason, evidence={"incident": incident.pk, "decision": decision.action})
        if decision.action == Decision.ALERT:
            resolve_incident(incident, now=now, actor=actor, reason="alert only: nothing to recover")
            incident.refresh_from_db()
            return incident
        _drain(decision.drain, incident, actor=actor)
        _blame_lemons(incident, actor=actor)
        if signal == policy.EXIT and decision.classification != "hardware":
            blame_crashes(incident, nodes, actor=actor)
        _quiesce(job, incident, decision, actor=actor)
    transaction.on_commit(lambda: _advance_later(job_id))
    return incident


def _hang_was_a_partition(job: Job, incident: Incident, signal: str, nodes: tuple[str, ...], detail: dict | None,
                          fault_at, *, actor: str) -> bool:
    """Re-classify ``incident``, a hang its job is quiescing for, as the partition it was: one of the
    generation's nodes turned unreachable before it confirmed its ranks stopped. Returns whether it did.

    A node cut off stalls the collectives of every rank, so the hang sweep (a 2 s floor) usually
    speaks before the heartbeat sweep (a heartbeat timeout after the last heartbeat, 3 s in the
    e2e cluster, 15 s by default): the stall is the symptom, the lost node the cause. A restart
    for the hang could run beside the cut-off rank, so the decision becomes the partition's
    (escalate, page): the quiesce goes on as before, and the job pauses for a human unless every
    node confirms. The hang's own evidence is kept (``hang``), its fault time too when earlier.
    Not once the incident has quiesced or the node has confirmed: nothing of it can run then."""
    generation = incident.generation
    if (signal != policy.NODE_UNREACHABLE or incident.evidence.get("signal") != policy.HANG
            or incident.quiesced_at is not None or generation is None or generation.number != job.generation
            or set(nodes) <= set(generation.stopped_nodes)):
        return False
    decision = policy.decide(_evidence(job, signal, nodes=nodes))
    _reclassify_hang(job, incident, decision, signal, nodes, detail, fault_at, {}, actor=actor)
    Job.objects.filter(pk=job.pk).update(relaunch_after=None)
    return True


def _reclassify_hang(job: Job, incident: Incident, decision: policy.Decision, signal: str, nodes: tuple[str, ...],
                     detail: dict | None, fault_at, evidence: dict, *, actor: str) -> str:
    """Give ``incident`` (a hang) the cause's classification, decision and evidence, keeping the
    hang's own (``hang``, ``reclassified_from``) and the earlier fault time; returns the reason."""
    reason = f"{decision.reason}; first taken for a hang (no step progress since step {job.last_step})"
    hang = {k: incident.evidence.get(k) for k in ("signal", "detail", "reason", "step")}
    incident.kind, incident.decision = decision.classification, decision.action
    incident.classification = clip(one_line(reason), CLASSIFICATION_LEN)
    incident.evidence = clean_json({**incident.evidence, "signal": signal, "nodes": list(nodes),
                                    "detail": detail or {}, **_jsonable(evidence), "reason": reason,
                                    "page": decision.page, "propose_rollback": decision.propose_rollback,
                                    "reclassified_from": policy.HANG, "hang": hang})
    if fault_at is not None and (incident.fault_at is None or fault_at < incident.fault_at):
        incident.fault_at = fault_at
    incident.save(update_fields=["kind", "decision", "classification", "evidence", "fault_at"])
    record_event(EventKind.INCIDENT_OPEN, actor=actor, job=job, generation=job.generation,
                 reason=f"re-classified: {reason}", evidence={"incident": incident.pk, "decision": decision.action})
    return reason


def _hang_was_a_crash(job: Job, incident: Incident, signal: str, nodes: tuple[str, ...], detail: dict | None,
                      fault_at, evidence: dict, *, actor: str) -> bool:
    """Re-classify ``incident``, a hang its job is quiescing (or recovering) for, as the crash it was:
    an exit nobody asked for, from a rank that ended at or before the hang's verdict. Returns
    whether it did.

    A rank that dies stalls the others in their next collective, and the hang sweep (a 2 s floor)
    can speak before the exit report arrives: torchrun reports only once it has closed the rest of
    the group, and a Slurm job's end is read from the controller's next poll (``tests/slurm`` failed
    in CI on that race). The exit is the cause, the stall its symptom: the incident takes the
    crash's classification and decision (a Xid or an unhealthy node drains; a repeated failure
    pauses), as though the exit had come first; the hang does not count against the restart budget
    twice. The hang's evidence is kept (``hang``). An exit after the verdict (a rank our stop or the
    stall itself ended) is further evidence, as before, and so is one without a time."""
    generation = incident.generation
    if (signal != policy.EXIT or incident.evidence.get("signal") != policy.HANG or fault_at is None
            or fault_at > incident.detected_at or generation is None or generation.number != job.generation
            or job.state not in (JobState.QUIESCING, JobState.RECOVERING)):
        return False
    decision = policy.decide(_evidence(job, signal, nodes=nodes, excluding=incident, **evidence))
    reason = _reclassify_hang(job, incident, decision, signal, nodes, detail, fault_at, evidence, actor=actor)
    blamed = set(decision.drain) | (set(nodes) if decision.classification == "hardware" else set())
    if blamed:
        incident.nodes.add(*Node.objects.filter(hostname__in=blamed))
        _drain(decision.drain, incident, actor=actor)
        _blame_lemons(incident, actor=actor)
    elif decision.classification != "hardware":
        blame_crashes(incident, nodes, actor=actor)
    if not decision.restarts:
        Job.objects.filter(pk=job.pk).update(relaunch_after=None)
        if job.state == JobState.RECOVERING:  # quiesced already: a quiescing job pauses once all confirm
            _move(job, JobState.PAUSED, actor, reason, pause_reason=reason)
    return True


#: What the hooks flag, and the training event (or step report) that carries the flag's own time.
_FLAG_EVENTS = {policy.SPIKE: "spike", policy.INCONSISTENCY: "inconsistency", policy.DIVERGENCE: "divergence"}


def flagged_fault_time(job: Job, signal: str, generation: int, now):
    """When a fault the hooks flagged happened, by the hooks' clock: the first NaN step of the
    generation, or the newest event of the flag's kind, never after ``now`` (a node clock ahead);
    ``now`` for a signal with no earlier evidence (the verdict is the fault's first sign)."""
    at = None
    if signal == policy.NAN:
        at = (StepMetric.objects.filter(job=job, generation=generation, nan=True).order_by("step")
              .values_list("reported_at", flat=True).first())
    elif signal in _FLAG_EVENTS:
        at = (TrainingEvent.objects.filter(job=job, generation=generation, kind=_FLAG_EVENTS[signal])
              .order_by("-reported_at").values_list("reported_at", flat=True).first())
    return min(at, now) if at is not None else now


def partition_threshold() -> int:
    """How many nodes lost contact within the partition window make a suspected partition: at least
    ``PARTITION_NODES``, and ``PARTITION_FRACTION`` of the nodes that heartbeat. On a fleet of 1,024
    nodes two unrelated deaths in two minutes are ordinary (a node fails every few hours there, and
    not evenly), and pausing every job that loses a node next, paging a human, is not what a
    partition rule is for; a leaf switch's 16-32 nodes still are one."""
    knobs = settings.NIGHTWATCH
    heartbeating = Node.objects.filter(heartbeat_deadline__isnull=False).count()
    return max(knobs["PARTITION_NODES"], math.ceil(knobs["PARTITION_FRACTION"] * heartbeating))


def _evidence(job: Job, signal: str, *, nodes: tuple[str, ...], excluding: Incident | None = None,
              **given) -> policy.Evidence:
    """What ``policy.decide`` weighs; ``excluding``: an incident being re-classified, which is not a
    restart of its own window nor a failure of its own history."""
    rp = RecoveryPolicy.of(job)
    window_start = timezone.now() - timedelta(minutes=rp.window_minutes)
    if job.breaker_reset_at and job.breaker_reset_at > window_start:
        window_start = job.breaker_reset_at
    earlier = Incident.objects.filter(job=job).exclude(pk=getattr(excluding, "pk", None))
    restarts = earlier.filter(detected_at__gte=window_start, decision__in=RESTARTING).count()
    history = tuple(
        policy.PastFailure(i.evidence.get("signature"), i.evidence.get("error_line"), i.evidence.get("step"),
                           i.evidence.get("config_hash", ""))
        for i in earlier.filter(evidence__signal=policy.EXIT).order_by("detected_at")
    )
    lost_window = timezone.now() - timedelta(seconds=settings.NIGHTWATCH["PARTITION_WINDOW_S"])
    # A node already found unhealthy (and so drained) that then goes silent is being repaired or
    # powered off, as expected: its silence says nothing of the network, and two such nodes in the
    # window would otherwise pause every job that loses a node next as a partition.
    lost = (Event.objects.filter(kind=EventKind.NODE_HEALTH, new_state=Health.UNREACHABLE, created_at__gte=lost_window)
            .exclude(old_state=Health.UNHEALTHY))
    gen_nodes = set(Generation.objects.filter(job=job, number=job.generation).values_list("nodes__hostname",
                                                                                           flat=True))
    unhealthy = tuple(sorted(Node.objects.filter(hostname__in=set(nodes) | gen_nodes, health=Health.UNHEALTHY)
                             .values_list("hostname", flat=True)))
    spares = [n for n in candidates(job) if n.hostname not in gen_nodes]
    return policy.Evidence(
        signal=signal, config_hash=spec_hash(job), nodes=tuple(nodes), unhealthy_nodes=unhealthy,
        spike_limit=rp.loss_spike_limit,
        nodes_lost_in_window=lost.values("node").distinct().count(),
        partition_threshold=partition_threshold(),
        restarts_in_window=restarts, max_restarts=restart_allowance(job, rp)[0],
        backoff_base_s=rp.backoff_seconds, spares_available=len(spares),
        allow_shrink=rp.allow_shrink, history=history,
        **{k: v for k, v in given.items() if k in _EVIDENCE_FIELDS},
    )


def restart_allowance(job: Job, rp: RecoveryPolicy) -> tuple[int, int]:
    """The automatic restarts the job may make in its window now, and how many approved retry storms
    in a row (without a clean run between them) reduced it.

    An approval resets the breaker's window; were the whole budget granted again, a storm that
    still rages would run it out and page again. So each approved storm halves the allowance
    (``max_restarts``, then 1/2, 1/4, never below 1) until the job runs clean: ``clean_run_minutes``
    from an approval to the next restart-worthy fault (or to now).

    1. The job's storms, newest first; none (the usual case): the whole budget, one query.
    2. For each: the first approval after it (paused → recovering: a resume or a rollback), and the
       first fault after that approval. A clean run between them ends the chain.
    """
    storms = list(Incident.objects.filter(job=job, kind="retry_storm").order_by("-detected_at")
                  .values_list("detected_at", flat=True)[:8])
    if not storms or not rp.max_restarts:
        return rp.max_restarts, 0
    approvals = sorted(Event.objects.filter(job=job, kind=EventKind.JOB_STATE, old_state=JobState.PAUSED,
                                            new_state=JobState.RECOVERING, created_at__gt=storms[-1])
                       .values_list("created_at", flat=True))
    faults = sorted(Incident.objects.filter(Q(decision__in=RESTARTING) | Q(kind="retry_storm"), job=job,
                                            detected_at__gt=storms[-1]).values_list("detected_at", flat=True))
    clean, now, reduced = timedelta(minutes=rp.clean_run_minutes), timezone.now(), 0
    for storm in storms:
        approval = next((a for a in approvals if a > storm), None)
        if approval is None:
            break
        if next((f for f in faults if f > approval), now) - approval >= clean:
            break
        reduced += 1
    return max(1, rp.max_restarts >> reduced), reduced


_EVIDENCE_FIELDS = {"signature", "error_line", "step", "consecutive_spikes", "spike_verdict", "since_step", "rise",
                    "lost_fraction", "remaining_s", "restart_cost_s"}


def _jsonable(evidence: dict) -> dict:
    return {k: v for k, v in evidence.items() if k in _EVIDENCE_FIELDS}


def _drain(hostnames, incident: Incident, *, actor: str) -> None:
    for node in Node.objects.filter(hostname__in=hostnames):
        node_services.drain_node(node, actor=actor, reason=f"incident {incident.pk}: {incident.classification}")


def _blame_lemons(incident: Incident, *, actor: str) -> None:
    """A node blamed in repeated incidents (any job) inside the window is kept out until cleared."""
    lemons = LemonPolicy.current()
    since = timezone.now() - timedelta(seconds=lemons.window_s)
    for node in incident.nodes.all():
        node_services.blame_node(node, actor=actor, reason=f"incident {incident.pk}")
        blamed = Incident.objects.filter(nodes=node, detected_at__gte=since).count()
        if blamed >= lemons.incidents:
            node_services.drain_node(
                node, actor=actor, reason=f"lemon: blamed in {blamed} incidents; kept out until an operator clears it"
            )


def blame_crashes(incident: Incident, hostnames, *, actor: str) -> None:
    """Crashes of several *different* jobs on one node within the window point at the node, not at
    the programs (``nodes.policies.LemonPolicy``): from the ``crash_jobs``-th job on, each further
    job that crashes there blames it once, and it is drained as suspect.

    The node named is the one whose exit report opened the incident (for a multi-node job, the
    first to report), or whose agent told of the rank a crash replaced in process (``jobs.inprocess``:
    those count too, or a node that kills a rank of every job now and then would never be found
    once the jobs restart in process). Crash incidents do not name nodes in ``Incident.nodes`` (that
    is hardware blame, which the lemon page counts), so they are found by the hostnames in their
    evidence; a day's crash incidents of the whole fleet are few."""
    lemons = LemonPolicy.current()
    since = timezone.now() - timedelta(seconds=lemons.crash_window_s)
    crashed = Q(evidence__signal=policy.EXIT) | Q(evidence__signal=policy.IN_PROCESS_RESTART, kind=IncidentKind.CRASH)
    crashes = list(Incident.objects.filter(crashed, detected_at__gte=since)
                   .exclude(kind="hardware").exclude(pk=incident.pk)
                   .values_list("job_id", "evidence__nodes")[:10_000])
    for node in Node.objects.filter(hostname__in=set(hostnames)):
        earlier = {job for job, named in crashes if isinstance(named, list) and node.hostname in named}
        if incident.job_id in earlier:
            continue  # this job crashed here before: it was counted then
        jobs = sorted(earlier | {incident.job_id})
        if len(jobs) < lemons.crash_jobs:
            continue
        node_services.blame_node(node, actor=actor, evidence={"incident": incident.pk, "jobs": jobs},
                                 reason=f"incident {incident.pk}: crashes of {len(jobs)} different jobs on this node "
                                        f"within {lemons.crash_window_s // 3600} h")
        node_services.drain_node(node, actor=actor,
                                 reason=f"suspect: crashes of {len(jobs)} different jobs (jobs "
                                        f"{', '.join(map(str, jobs))}) within {lemons.crash_window_s // 3600} h")


def _quiesce(job: Job, incident: Incident, decision: policy.Decision, *, actor: str) -> None:
    """Stop every rank of the generation on every node; the recovery continues once all confirm."""
    now = timezone.now()
    if job.state != JobState.QUIESCING:
        state.transition(job, JobState.QUIESCING, actor=actor, reason=decision.reason,
                         evidence={"incident": incident.pk}, generation=job.generation)
    relaunch_after = now + timedelta(seconds=decision.backoff_s) if decision.backoff_s else None
    Job.objects.filter(pk=job.pk).update(
        quiesce_deadline=now + timedelta(seconds=settings.NIGHTWATCH["QUIESCE_TIMEOUT_S"]),
        relaunch_after=relaunch_after,
    )
    # A hung rank cannot act on SIGTERM (it may be stopped, or stuck in a collective): a long grace
    # would only add to the downtime. Anything else gets time to flush and exit cleanly.
    stop_generation(job, reason=decision.reason, grace_s=HUNG_GRACE_S if decision.classification == "hang" else 10.0)


#: SIGTERM grace when stopping a generation that hangs.
HUNG_GRACE_S = 2.0


def stop_generation(job: Job, *, reason: str, grace_s: float = 10.0) -> None:
    """Queue a stop of the current generation on each of its nodes that has not confirmed yet,
    through the nodes' transport (stop commands to agents, or ``scancel`` of the Slurm job)."""
    generation = Generation.objects.filter(job=job, number=job.generation).first()
    if generation is None:
        return
    remaining = list(generation.nodes.exclude(hostname__in=generation.stopped_nodes))
    if remaining:
        transports.for_nodes(remaining).stop(job, generation.number, remaining, grace_s=grace_s, reason=reason)


def full_reason(incident: Incident) -> str:
    """The incident's reason in full (its classification may be clipped)."""
    reason = incident.evidence.get("reason") if isinstance(incident.evidence, dict) else None
    return reason if isinstance(reason, str) and reason else incident.classification


def _open_incident(job: Job) -> Incident | None:
    return Incident.objects.filter(job=job, state=IncidentState.OPEN).order_by("-detected_at").first()


# --- confirmations and progress ----------------------------------------------------------------

def confirm_stopped(job_id: int, generation: int, hostname: str, *, exit_detail: dict | None = None) -> None:
    """A node's processes of ``generation`` are gone (its exit report, or its stop acknowledged).

    Only the confirmation that completes the generation's set moves the recovery on: before it,
    ``advance_recovery`` can do nothing a confirmation would change (a quiescing job waits for all
    of them; its deadline is the sweep's). One ``advance_job`` per stop, not one per node: a
    512-node job's recovery queued over 500 of them, each locking the job to find it still waiting,
    ahead of every other job's verdicts."""
    with transaction.atomic():
        row = Generation.objects.select_for_update().filter(job_id=job_id, number=generation).first()
        if row is None or hostname in row.stopped_nodes:
            return
        row.stopped_nodes = [*row.stopped_nodes, hostname]
        if exit_detail:
            for failed in exit_detail.get("ranks", []):
                row.exit_codes[str(failed.get("rank"))] = failed.get("exit_code", failed.get("signal"))
        row.save(update_fields=["stopped_nodes", "exit_codes"])
        if not all_stopped(row):
            return
        # Also when the job already paused (an escalation): the incident's quiesce time and the
        # generation's end are facts that goodput accounting needs, whenever they happen.
        now = timezone.now()
        end_generations(Generation.objects.filter(pk=row.pk), now)
        Incident.objects.filter(job_id=job_id, generation=row, state=IncidentState.OPEN,
                                quiesced_at__isnull=True).update(quiesced_at=now)
    transaction.on_commit(lambda: _advance_later(job_id))


def agent_return_window() -> timedelta:
    """A node whose agent is heard from again this soon after it was declared unreachable, confirming
    that nothing of the generation runs there, had a crash, not a partition: an agent restart (a
    kill of the agent with its ranks, an OOM, an upgrade) takes seconds; a partition lasts
    (``AGENT_RETURN_WINDOW_S``, 60 s by default)."""
    return timedelta(seconds=settings.NIGHTWATCH["AGENT_RETURN_WINDOW_S"])


def _returned_node_crashed(job_id: int, generation: int, hostname: str, detail: dict) -> bool:
    """Turn a partition incident into a crash when its only lost node came back quickly and
    reported that the generation had ended there on its own (the exit report of an agent that
    restarted and found its torchrun gone; not a stop we asked for, which would mean the ranks
    ran on through the silence: that stays a partition for a human).

    A lost node is a partition because a restart could run beside ranks still alive there (split
    brain). Once the node's agent answers within ``agent_return_window()`` of the verdict and
    confirms its ranks are gone, that risk is over: the fault is judged as the crash it was, by the
    policy (restart, within the budget, or pause for a repeat), and a job already paused for the
    partition resumes without an on-call (``_resume_returned``, once the node's confirmation is
    recorded). Not when another node was lost too, or the node is unhealthy. Returns whether it
    re-classified."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None or job.generation != generation or job.state not in (JobState.QUIESCING, JobState.PAUSED):
            return False
        incident = _open_incident(job)
        evidence = incident.evidence if incident is not None else {}
        if (incident is None or evidence.get("signal") != policy.NODE_UNREACHABLE
                or evidence.get("nodes") != [hostname]
                or any(f.get("nodes") not in ([], [hostname]) for f in evidence.get("further", []))
                or timezone.now() - incident.detected_at > agent_return_window()):
            return False
        gen_nodes = set(Generation.objects.filter(job=job, number=generation).values_list("nodes__hostname",
                                                                                           flat=True))
        if (Node.objects.filter(hostname__in=gen_nodes - {hostname}, health=Health.UNREACHABLE).exists()
                or Node.objects.filter(hostname=hostname, health=Health.UNHEALTHY).exists()):
            return False
        signature = detail.get("signature")
        if signature in (None, "unknown"):
            signature = "signal"  # the agent died with its ranks: a kill from outside, not the program
        ev = _evidence(job, policy.EXIT, nodes=(hostname,), signature=signature,
                       error_line=detail.get("error_line"), step=job.last_step)
        decision = policy.decide(ev)
        reason = f"{hostname}'s agent came back and confirmed nothing runs: {decision.reason}"
        incident.kind, incident.decision = decision.classification, decision.action
        incident.classification = reason[:200]
        incident.evidence = {**evidence, "reclassified_from": "partition", "reason": reason,
                             "returned": {"node": hostname, "at": timezone.now().isoformat(),
                                          "signature": detail.get("signature")}}
        incident.save(update_fields=["kind", "decision", "classification", "evidence"])
        record_event(EventKind.INCIDENT_OPEN, actor=f"node:{hostname}", job=job, generation=generation,
                     reason=f"re-classified: {reason}", evidence={"incident": incident.pk,
                                                                 "decision": decision.action})
        if decision.backoff_s:
            Job.objects.filter(pk=job.pk).update(relaunch_after=timezone.now()
                                                 + timedelta(seconds=decision.backoff_s))
    return True


def _resume_returned(job_id: int, generation: int, hostname: str) -> None:
    """A job paused for a partition that ``_returned_node_crashed`` re-classified as a crash to
    restart goes on recovering once every node has confirmed (an agent back after the quiesce
    deadline, or after the pause)."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        incident = _open_incident(job) if job is not None else None
        if (job is None or job.generation != generation or job.state != JobState.PAUSED or incident is None
                or incident.decision not in RESTARTING
                or incident.evidence.get("reclassified_from") != "partition"
                or not all_stopped(Generation.objects.filter(job=job, number=generation).first())):
            return
        _move(job, JobState.RECOVERING, f"node:{hostname}", incident.classification)
    transaction.on_commit(lambda: _advance_later(job_id))


def all_stopped(generation: Generation | None) -> bool:
    if generation is None:
        return True
    return set(generation.nodes.values_list("hostname", flat=True)) <= set(generation.stopped_nodes)


def advance_recovery(job_id: int, *, actor: str = SYSTEM) -> bool:
    """Move a quiescing or recovering job one step further, if what is recorded allows; returns
    whether it did something. Safe to call any time, from anywhere, any number of times."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return False
    now = timezone.now()
    generation = Generation.objects.filter(job=job, number=job.generation).first()
    incident = _open_incident(job)
    if job.state == JobState.QUIESCING:
        if all_stopped(generation):
            Incident.objects.filter(pk=getattr(incident, "pk", None), quiesced_at__isnull=True).update(quiesced_at=now)
            end_generations(Generation.objects.filter(pk=getattr(generation, "pk", None)), now)
            if incident is not None and incident.decision in RESTARTING:
                return _move(job, JobState.RECOVERING, actor, "every rank confirmed stopped")
            if incident is None and job.resize_to:  # an operator's resize: resume on the new shape now
                return _move(job, JobState.RECOVERING, actor,
                             f"every rank confirmed stopped: resuming on {job.resize_to['nnodes']} node(s) × "
                             f"{job.resize_to['nproc_per_node']} process(es)")
            reason = full_reason(incident) if incident else "paused by an operator"
            return _move(job, JobState.PAUSED, actor, reason, pause_reason=reason)
        if job.quiesce_deadline and now > job.quiesce_deadline:
            missing = sorted(set(generation.nodes.values_list("hostname", flat=True)) - set(generation.stopped_nodes))
            reason = f"could not confirm that ranks stopped on {', '.join(missing)}: escalating"
            if incident is not None:
                Incident.objects.filter(pk=incident.pk).update(decision=Decision.ESCALATE)
            return _move(job, JobState.PAUSED, actor, reason, pause_reason=reason)
        return False
    if job.state == JobState.RECOVERING:
        if job.relaunch_after and now < job.relaunch_after:
            return False
        reason = f"recovering from incident {incident.pk}: {incident.classification}" if incident else "resuming"
        try:
            return start_generation(job, actor=actor, reason=reason, restart=True) is not None
        except state.TransitionConflict:
            return False  # someone else relaunched it meanwhile
    return False


def _move(job: Job, new_state: str, actor: str, reason: str, **fields) -> bool:
    try:
        state.transition(job, new_state, actor=actor, reason=reason, expect_state=job.state, **fields)
        return True
    except state.TransitionConflict:
        return False


def _advance_later(job_id: int) -> None:
    # Deferred: jobs.tasks sits above the orchestrator (its tasks run these functions) and imports
    # this module at its top, so importing it here at module level would be a cycle.
    from jobs.tasks import advance_job

    advance_job.delay(job_id)


def record_first_step(job: Job, generation: int) -> None:
    """The resumed generation trained a step: the open incidents are over. Each records its lost
    work: the steps its generation trained past the step this generation restored
    (``restored_step``)."""
    now = timezone.now()
    restored_step = restored_step_of(job, generation)
    ended = Incident.objects.filter(job=job, state=IncidentState.OPEN, relaunched_at__isnull=False,
                                    generation__number__lt=generation).select_related("generation")
    for incident in ended:
        reached = (StepMetric.objects.filter(job=job, generation=incident.generation.number)
                   .aggregate(m=Max("step"))["m"] if incident.generation else None) or restored_step
        resolve_incident(incident, now=now, actor=SYSTEM, reason=f"generation {generation} trained a step",
                         first_step_at=now, lost_steps=max(0, reached - restored_step),
                         restored_step=restored_step)


def restored_step_of(job: Job, generation: int) -> int:
    """The step ``generation`` restored: what its hooks said they resumed from (the ``resumed``
    event's step), which is newer than the disk checkpoint the relaunch named
    (``Generation.resumed_from``) when they restored an in-memory snapshot; that checkpoint's step
    when they said nothing (older hooks, a lost event); 0 for a start from scratch."""
    said = (TrainingEvent.objects.filter(job=job, generation=generation, kind="resumed")
            .aggregate(m=Max("step"))["m"])
    if said is not None:
        return said
    resumed = Generation.objects.filter(job=job, number=generation).select_related("resumed_from").first()
    return resumed.resumed_from.step if resumed and resumed.resumed_from else 0


def resolve_incident(incident: Incident, *, now, actor: str, reason: str, **outcome) -> bool:
    """Close an open incident (with ``outcome``: further fields of the row) and log it in the audit
    log, where the timeline and the dashboard see it end. Only the call that closes it logs: a
    concurrent one finds it resolved already and returns False."""
    restored_step = outcome.pop("restored_step", None)
    closed = Incident.objects.filter(pk=incident.pk, state=IncidentState.OPEN).update(
        state=IncidentState.RESOLVED, resolved_at=now, **outcome)
    if closed:
        record_event(EventKind.INCIDENT_RESOLVED, actor=actor, job=incident.job_id, reason=reason,
                     generation=incident.generation.number if incident.generation else None,
                     evidence={"incident": incident.pk, "decision": incident.decision,
                               "lost_steps": outcome.get("lost_steps"), "restored_step": restored_step})
    return bool(closed)


# --- periodic one-shots (beat, tests and management commands call the same functions) ---------
# (the hang sweep's is jobs.progress.expire_one_progress_deadline)

def start_one_pending() -> bool:
    """Try to place the pending job that has waited longest among those the free nodes could take;
    returns whether one was launched.

    Placing loads every free node, so it is tried only for a job that enough of them could take
    (one COUNT first): while the fleet is full, each sweep costs two queries, not a load of every
    free node for each of up to 20 waiting jobs."""
    pending = list(Job.objects.filter(state=JobState.PENDING).order_by("created_at")[:20])
    if not pending:
        return False
    free = free_node_count()
    for job in pending:
        if free < job.nnodes and not (free and RecoveryPolicy.of(job).allow_shrink):
            continue  # start_generation would find too few nodes and leave it pending
        try:
            if start_generation(job, actor=SYSTEM, reason="first launch", restart=False) is not None:
                return True
        except state.TransitionConflict:
            continue  # launched by someone else meanwhile
    return False


def advance_one_recovery() -> bool:
    """Re-drive the recovery that has waited longest (a dead worker's, or a finished backoff)."""
    now = timezone.now()
    stuck = Job.objects.filter(
        Q(state=JobState.QUIESCING) | Q(state=JobState.RECOVERING, relaunch_after__isnull=True)
        | Q(state=JobState.RECOVERING, relaunch_after__lte=now)
    ).order_by("state_changed_at")
    return any(advance_recovery(job.pk) for job in stuck[:20])


# --- what the nodes and the hooks tell us ------------------------------------------------------

def handle_exit(job_id: int, generation: int, hostname: str, detail: dict) -> None:
    """A node's torchrun of ``generation`` ended. Confirm the stop, then decide what it means.

    - a stop we asked for, a pause, a stale-generation exit: confirmation only;
    - every node exited 0: the job completed;
    - otherwise: a crash, classified with the signature and error line the agent found.
    """
    signature = detail.get("signature")
    requested = detail.get("requested_stop") or signature in policy.REQUESTED_SIGNATURES
    # Before the confirmation, whose recovery step must already see the crash, not the partition.
    returned = not requested and _returned_node_crashed(job_id, generation, hostname, detail)
    confirm_stopped(job_id, generation, hostname, exit_detail=detail)
    if returned:
        _resume_returned(job_id, generation, hostname)
    if requested:
        return
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return
    clean = detail.get("exit_code") == 0 and not detail.get("ranks")
    if clean:
        generation_row = Generation.objects.filter(job=job, number=generation).first()
        if generation == job.generation and all_stopped(generation_row) and job.state in WATCHED:
            _move(job, JobState.COMPLETED, f"node:{hostname}", "every rank exited 0")
        return
    report_fault(job_id, policy.EXIT, generation=generation, nodes=(hostname,), actor=f"node:{hostname}",
                 signature=signature, error_line=detail.get("error_line"), step=job.last_step,
                 fault_at=exit_fault_time(job, generation, detail),
                 detail={k: detail.get(k) for k in ("exit_code", "ranks", "root_cause_rank", "signature",
                                                    "error_line", "log_tail", "xids")})


#: The exit report's times of the failure, earliest evidence first: the agent finding a rank gone,
#: torchrun's own log time of closing the worker group, the agent seeing that (or, for a generation
#: that ended while no agent watched, its log's last write), and the control plane's receipt.
EXIT_FAULT_STAMPS = ("rank_exited_at", "torchrun_failed_at", "ended_at", "exited_at")


def exit_fault_time(job: Job, generation: int, detail: dict):
    """When the generation failed on the node, from the earliest evidence (``EXIT_FAULT_STAMPS``),
    never before the generation started or the last step its ranks reported (they were alive
    then: a node clock behind ours), never after now. None without such evidence."""
    stamps = [t for t in (detail.get(k) for k in EXIT_FAULT_STAMPS)
              if isinstance(t, int | float) and not isinstance(t, bool) and t > 0]
    if not stamps:
        return None
    now = timezone.now()
    at = datetime.fromtimestamp(min(stamps), tz=UTC)
    row = Generation.objects.filter(job=job, number=generation).first()
    alive = StepMetric.objects.filter(job=job, generation=generation).aggregate(m=Max("reported_at"))["m"]
    floors = [t for t in (row.started_at if row else None, alive) if t is not None]
    return min(max([at, *floors]), now)


def handle_node_health(hostname: str, new_health: str, reasons: list, *, fault_at: float | None = None) -> None:
    """A node turned unhealthy or unreachable: every live generation on it is affected. An
    unreachable node's fault dates from its last heartbeat (the last sign of life), not from the
    verdict a heartbeat timeout later; an unhealthy one's from ``fault_at`` when the node's report
    dated it (a critical Xid, by the node's clock), else from the verdict."""
    signal = {Health.UNHEALTHY: policy.NODE_UNHEALTHY, Health.UNREACHABLE: policy.NODE_UNREACHABLE}.get(new_health)
    if signal is None:
        return
    last_heard = None
    if new_health == Health.UNREACHABLE:
        last_heard = Node.objects.filter(hostname=hostname).values_list("last_heartbeat_at", flat=True).first()
    affected = Generation.objects.filter(nodes__hostname=hostname, ended_at__isnull=True,
                                         job__state__in=HEALTH_WATCHED).select_related("job")
    for generation in affected:
        if generation.number == generation.job.generation:
            at = last_heard or (_node_dated(generation, fault_at) if fault_at is not None else None)
            report_fault(generation.job_id, signal, generation=generation.number, nodes=(hostname,),
                         detail={"health": new_health, "reasons": reasons}, fault_at=at)


def _node_dated(generation: Generation, at: float):
    """A node's own time of its fault, never before the generation started nor after now (its clock
    apart from ours). Unlike an exit's, not floored at the ranks' last step: a node's ranks may
    report steps after its GPU failed (the ones in flight)."""
    moment = datetime.fromtimestamp(at, tz=UTC)
    if generation.started_at is not None:
        moment = max(moment, generation.started_at)
    return min(moment, timezone.now())


def handle_hook_flags(job: Job, generation: int, *, nan: bool, spikes: int, inconsistent: dict | None,
                      spike: dict | None = None, divergence: dict | None = None) -> None:
    """The hooks flagged NaN, a rank that disagrees with the others, a pausing loss spike or a
    divergence (``jobs.detection``). A disagreeing rank takes precedence over loss spikes and
    divergence: when it arrives while the job is already stopping for one, that incident is
    re-classified as corruption naming the rank (the loss that moved was that rank's own)."""
    if nan:
        report_fault(job.pk, policy.NAN, generation=generation, detail={"last_step": job.last_step})
    elif inconsistent:
        if report_fault(job.pk, policy.INCONSISTENCY, generation=generation, detail=inconsistent) is None:
            _spike_was_a_bad_rank(job, generation, inconsistent)
    elif divergence:
        report_fault(job.pk, policy.DIVERGENCE, generation=generation, detail=divergence,
                     since_step=divergence.get("since_step"), rise=divergence.get("rise"))
    elif spikes or spike:  # a spike the hooks (or, for older hooks, the run-length limit) said pauses
        report_fault(job.pk, policy.SPIKE, generation=generation, consecutive_spikes=spikes,
                     spike_verdict=(spike or {}).get("action", ""),
                     detail={"last_step": job.last_step, **(spike or {})})


def _spike_was_a_bad_rank(job: Job, generation: int, inconsistent: dict) -> None:
    with transaction.atomic():
        incident = (Incident.objects.select_for_update(of=("self",))
                    .filter(Q(generation__number=generation) | Q(generation__isnull=True), job=job,
                            evidence__signal__in=[policy.SPIKE, policy.DIVERGENCE],
                            state=IncidentState.OPEN).order_by("-detected_at").first())
        if incident is None:
            return
        rank, node = inconsistent.get("suspect_rank"), inconsistent.get("suspect_node")
        incident.kind = IncidentKind.CORRUPTION
        incident.classification = (f"rank {rank} (node {node}) disagrees with the other ranks: the loss it "
                                   "stopped for was that rank's own (possible silent data corruption)")[:200]
        incident.evidence = {**incident.evidence, "signal": policy.INCONSISTENCY, "detail": inconsistent,
                             "spike": incident.evidence.get("detail"),
                             "reclassified_from": incident.evidence.get("signal")}
        incident.save(update_fields=["kind", "classification", "evidence"])


def handle_save_failed(job_id: int, generation: int, failure: dict) -> Incident | None:
    """The hooks reported a failed checkpoint save (``checkpoint_failed``): training went on.

    A ``checkpoint`` incident says why ("no space left on device", "permission denied"), in its
    classification and evidence, and pages (``jobs.policy``). A failure for the same cause before
    any checkpoint committed again is the same condition: it is added to that incident's evidence
    (``further``), not paged again. ``failure``: the event's detail plus ``step`` and ``time``.

    A save that failed because another rank went away in its collectives (``peer_lost``, from the
    hooks' ``lost_peer``) says nothing about the storage: that rank's exit, or the hang that
    follows, is the incident, and a page for the save would be a false one (the e2e test of a
    worker killed mid-recovery found two incidents for one SIGKILL). The event stays on the
    job's timeline.
    """
    if failure.get("peer_lost") is True:
        log.info("job %s generation %s: the save at step %s failed because a rank went away (%s): no checkpoint "
                 "incident", job_id, generation, failure.get("step"), failure.get("reason"))
        return None
    reason = str(failure.get("reason") or "unknown cause")[:200]
    step = failure.get("step")
    failed_at = failure.get("time")
    fault_at = datetime.fromtimestamp(failed_at, tz=UTC) if isinstance(failed_at, int | float) else None
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None or generation != job.generation:
            return None
        previous = (Incident.objects.filter(job=job, kind=IncidentKind.CHECKPOINT,
                                            evidence__signal=policy.CHECKPOINT_FAILED)
                    .order_by("-detected_at", "-pk").first())
        if (previous is not None and (previous.evidence.get("detail") or {}).get("reason") == reason
                and not Checkpoint.objects.filter(job=job, created_at__gt=previous.detected_at).exists()):
            further = previous.evidence.setdefault("further", [])
            if len(further) < 100:
                further.append({"signal": policy.CHECKPOINT_FAILED, "step": step, "generation": generation,
                                "at": timezone.now().isoformat()})
                previous.save(update_fields=["evidence"])
            return previous
        if failure.get("errno") == errno.ENOSPC or reason == "no space left on device":
            # Retention frees space now (torn saves, the oldest unprotected checkpoints), not at its next sweep.
            transaction.on_commit(lambda: relieve_disk_pressure.delay(job_id))
        return report_fault(job_id, policy.CHECKPOINT_FAILED, generation=generation, detail=failure,
                            error_line=reason, step=step if isinstance(step, int) else None, fault_at=fault_at,
                            actor="hooks")


def handle_launch_refused(job_id: int, generation: int, hostname: str, reason: str, *,
                          job_problem: bool = False) -> None:
    """A node refused to launch: nothing runs there. A failed health check is the node's: replace
    it. A failed pre-flight of the job itself (``job_problem``: its entrypoint is not there, its
    checkpoint directory takes no write; ``agents.preflight``) would fail on every node and every
    restart alike: the job pauses with the reason, and no restart is spent on it."""
    confirm_stopped(job_id, generation, hostname)
    if job_problem:
        report_fault(job_id, policy.LAUNCH_PREFLIGHT, generation=generation, nodes=(hostname,),
                     actor=f"node:{hostname}", error_line=reason,
                     signature="checkpoint_dir" if "checkpoint directory" in reason else "entrypoint",
                     detail={"launch_refused": reason})
        return
    report_fault(job_id, policy.NODE_UNHEALTHY, generation=generation, nodes=(hostname,), actor=f"node:{hostname}",
                 detail={"launch_refused": reason})
