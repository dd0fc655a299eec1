"""What deserves an alert, at which severity, and whether its condition still holds.

Each function reads the current rows and returns ``AlertSpec``s: the alert as it should be now.
``alerts.services.apply`` turns a spec into a new alert, a follow-up, a resolution or nothing, so
evaluating the same thing twice (a signal and the sweeper) is harmless.

    pages (a human is needed)                    notifies only
    circuit breaker open (retry storm)           automatic recovery (restart, spare, shrink)
    job paused awaiting approval (any pause      node drained
      or escalation decided for an incident)     straggler, a single loss spike (notice)
    suspected partition                          job paused by an operator
    node blamed repeatedly (lemon)               MFU / GPU utilisation low, downtime ratio high
    checkpoint failed verification
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from alerts import messages
from alerts.choices import Rule, Severity
from checkpoints.choices import CheckpointState
from checkpoints.models import Checkpoint
from checkpoints.services import latest_verified_checkpoint
from jobs import efficiency
from jobs.choices import Decision, IncidentKind, IncidentState, JobState
from jobs.efficiency_math import below_expected
from jobs.models import Incident

#: Decisions that stop the job until a human acts.
HUMAN_DECISIONS = frozenset({Decision.PAUSE, Decision.ESCALATE})
#: Rules whose alert is about one incident (re-evaluated from it).
INCIDENT_RULES = frozenset({Rule.BREAKER_OPEN, Rule.PAUSED, Rule.PARTITION, Rule.RECOVERY, Rule.STRAGGLER,
                            Rule.NOTICE})
EFFICIENCY_RULES = frozenset({Rule.MFU_LOW, Rule.GPU_UTIL_LOW, Rule.DOWNTIME_HIGH})


@dataclass(frozen=True)
class AlertSpec:
    key: str
    rule: str
    severity: str
    firing: bool
    title: str = ""
    summary: str = ""
    evidence: dict = field(default_factory=dict)
    link: str = ""
    job_id: int | None = None
    incident_id: int | None = None
    node_id: int | None = None
    #: What a follow-up would report; a change while firing is a follow-up.
    revision: str = ""
    #: One notification, nothing to resolve later (born resolved).
    notify_only: bool = False
    #: A human has acted (the paused job was resumed) while the condition still holds.
    acknowledged: bool = False
    #: Already cleared when first evaluated (a late task): still announce it once, resolved.
    announce_if_missed: bool = False


# --- incidents ----------------------------------------------------------------------------------

def incident_rule(incident) -> str:
    if incident.kind == IncidentKind.RETRY_STORM:
        return Rule.BREAKER_OPEN
    if incident.kind == IncidentKind.PARTITION:
        return Rule.PARTITION
    if incident.kind == IncidentKind.CHECKPOINT:
        return Rule.CHECKPOINT_CORRUPT
    if incident.kind == IncidentKind.STRAGGLER:
        return Rule.STRAGGLER
    if incident.decision == Decision.ALERT:
        return Rule.NOTICE
    if incident.decision in HUMAN_DECISIONS:
        return Rule.PAUSED
    return Rule.RECOVERY


def for_incident(incident) -> AlertSpec:
    """One alert per incident. It pages when the decision needs a human (pause, escalate — the
    breaker, a partition), else it notifies an automatic recovery; a decision to only alert (a
    straggler, one spike) is a single notification."""
    job = incident.job
    needs_human = incident.decision in HUMAN_DECISIONS or bool((incident.evidence or {}).get("page"))
    severity = Severity.PAGE if needs_human else Severity.INFO
    rule = incident_rule(incident)
    job_state = job.state if job else ""
    clear = job is not None and (job_state in JobState.TERMINAL or job_state == JobState.RUNNING)
    firing = incident.state == IncidentState.OPEN and not clear
    further = len((incident.evidence or {}).get("further", []))
    where = f"{job.name} (job {job.pk})" if job else "cluster"
    title = f"{where}: {Rule(rule).label} — {incident.get_kind_display()}"
    lines = [f"{incident.classification or incident.get_kind_display()}.",
             f"Decision: {incident.get_decision_display() if incident.decision else 'none yet'}."]
    if job is not None:
        lines.append(f"Job state: {job_state}" + (f" ({job.pause_reason})" if job.pause_reason else "") + ".")
        if job_state == JobState.PAUSED:
            lines.append(f"Waiting for an on-call: approve the resume (POST /api/v1/jobs/{job.pk}/approve) "
                         "or roll back.")
    if further:
        lines.append(f"{further} further fault signal(s) arrived while this incident was open.")
    nodes = sorted(incident.nodes.values_list("hostname", flat=True))
    evidence = {
        "incident": {"id": incident.pk, "kind": incident.kind, "classification": incident.classification,
                     "decision": incident.decision, "state": incident.state, "nodes": nodes,
                     "fault_at": _iso(incident.fault_at), "detected_at": _iso(incident.detected_at),
                     "quiesced_at": _iso(incident.quiesced_at), "relaunched_at": _iso(incident.relaunched_at),
                     "resolved_at": _iso(incident.resolved_at), "evidence": incident.evidence},
        "job": _job_facts(job),
    }
    # A human decision also shows what each step of the job looked like to the on-call.
    revision = f"{incident.state}:{incident.decision}:{further}" + (f":{job_state}" if needs_human else "")
    return AlertSpec(
        key=f"incident-{incident.pk}", rule=rule, severity=severity, firing=firing, title=title[:300],
        summary=" ".join(lines), evidence=evidence, revision=revision,
        link=messages.job_link(job.pk, incident.pk) if job else messages.public_url("/"),
        job_id=job.pk if job else None, incident_id=incident.pk,
        notify_only=incident.decision == Decision.ALERT, announce_if_missed=True,
        # Paused for a human, and no longer paused: someone approved a resume or a rollback.
        acknowledged=needs_human and job is not None and job_state in (JobState.INITIALIZING, JobState.RECOVERING),
    )


def _job_facts(job) -> dict | None:
    if job is None:
        return None
    checkpoint = latest_verified_checkpoint(job)
    return {"id": job.pk, "name": job.name, "state": job.state, "generation": job.generation,
            "restart_count": job.restart_count, "pause_reason": job.pause_reason, "last_step": job.last_step,
            "last_step_at": _iso(job.last_step_at),
            "latest_verified_checkpoint": {"id": checkpoint.pk, "step": checkpoint.step} if checkpoint else None}


def _iso(value) -> str | None:
    return value.isoformat() if value else None


def open_incident(job):
    return Incident.objects.filter(job=job, state=IncidentState.OPEN).order_by("-detected_at").first()


# --- job state events ----------------------------------------------------------------------------

def operator_pause(job, event) -> AlertSpec:
    """A pause with no incident behind it: someone chose it; nobody needs waking."""
    return AlertSpec(
        key=f"job-{job.pk}-pause-{event.pk}", rule=Rule.OPERATOR_PAUSE, severity=Severity.INFO,
        firing=job.state == JobState.PAUSED, title=f"{job.name} (job {job.pk}): paused by {event.actor}",
        summary=event.reason or "paused", link=messages.job_link(job.pk), job_id=job.pk,
        evidence={"event": {"id": event.pk, "actor": event.actor, "reason": event.reason,
                            "at": _iso(event.created_at)}, "job": _job_facts(job)},
        revision=job.state,
    )


# --- nodes ---------------------------------------------------------------------------------------

def drain(node, event) -> AlertSpec:
    return AlertSpec(
        key=f"node-{node.pk}-drain-{event.pk}", rule=Rule.DRAIN, severity=Severity.INFO, firing=True,
        notify_only=True, title=f"node {node.hostname} drained by {event.actor}", summary=event.reason,
        link=messages.node_link(node.hostname), node_id=node.pk,
        evidence={"event": {"id": event.pk, "actor": event.actor, "old": event.old_state, "new": event.new_state,
                            "reason": event.reason, "at": _iso(event.created_at)},
                  "node": {"hostname": node.hostname, "health": node.health, "lemon_count": node.lemon_count}},
    )


def lemon(node) -> AlertSpec:
    """Blamed in LEMON_INCIDENTS incidents within the window (the orchestrator's own count): a
    human must look at the hardware; it clears when an operator clears the lemon count."""
    since = timezone.now() - timedelta(seconds=settings.NIGHTWATCH["LEMON_WINDOW_S"])
    incidents = list(Incident.objects.filter(nodes=node, detected_at__gte=since).order_by("detected_at")
                     .values("id", "job_id", "kind", "classification", "detected_at"))
    threshold = settings.NIGHTWATCH["LEMON_INCIDENTS"]
    firing = node.lemon_count > 0 and len(incidents) >= threshold
    return AlertSpec(
        key=f"node-{node.pk}-lemon", rule=Rule.LEMON, severity=Severity.PAGE, firing=firing,
        title=f"node {node.hostname} blamed in {len(incidents)} incidents: kept out until cleared",
        summary=(f"{node.hostname} was blamed in {len(incidents)} incidents (threshold {threshold}) and is "
                 f"{node.schedulability}. Repair it, then clear its lemon count."),
        link=messages.node_link(node.hostname), node_id=node.pk, revision=str(len(incidents)),
        evidence={"node": {"hostname": node.hostname, "health": node.health, "schedulability": node.schedulability,
                           "lemon_count": node.lemon_count, "drain_reason": node.drain_reason},
                  "incidents": [{**i, "detected_at": _iso(i["detected_at"])} for i in incidents]},
    )


# --- checkpoints ---------------------------------------------------------------------------------

def corrupt_checkpoint(checkpoint) -> AlertSpec:
    """A checkpoint failed verification. It clears when the checkpoint verifies again (a storage
    fault cleared), a newer checkpoint of the job verifies, or the job ends."""
    job = checkpoint.job
    newer = Checkpoint.objects.filter(job=job, step__gt=checkpoint.step, state=CheckpointState.VERIFIED).exists()
    firing = checkpoint.state == CheckpointState.CORRUPT and not newer and job.state not in JobState.TERMINAL
    return AlertSpec(
        key=f"checkpoint-{checkpoint.pk}", rule=Rule.CHECKPOINT_CORRUPT, severity=Severity.PAGE, firing=firing,
        title=f"{job.name} (job {job.pk}): checkpoint at step {checkpoint.step} failed verification",
        summary=f"{checkpoint.state_reason or 'failed verification'} ({checkpoint.location}). Recovery will "
                "not restore it; the previous verified checkpoint means more lost work.",
        link=messages.job_link(job.pk), job_id=job.pk, revision=checkpoint.state_reason[:200],
        evidence={"checkpoint": {"id": checkpoint.pk, "step": checkpoint.step, "location": checkpoint.location,
                                 "state": checkpoint.state, "reason": checkpoint.state_reason,
                                 "replica_state": checkpoint.replica_state},
                  "job": _job_facts(job)},
    )


# --- efficiency ----------------------------------------------------------------------------------

def efficiency_alerts(job, figures: dict | None = None) -> list[AlertSpec]:
    """The three efficiency alerts of ``job`` as they should be now (info: they notify, never page),
    judged on the jobs app's figures (``jobs.efficiency.snapshot``; ``figures`` when the caller has them)."""
    figures = figures if figures is not None else efficiency.snapshot(job)
    conf = efficiency.settings_()
    running = job.state == JobState.RUNNING
    link = messages.job_link(job.pk)
    name = f"{job.name} (job {job.pk})"
    mfu, expected, margin = figures["mfu"], figures["expected_mfu"], figures["mfu_margin"]
    mfu_low = running and below_expected(mfu, expected, margin)
    util = figures["gpu_utilization_pct"]
    util_low = running and util is not None and util < conf["GPU_UTILIZATION_MIN_PCT"]
    ratio = figures["downtime_ratio"]
    downtime_high = (job.state not in JobState.TERMINAL and figures["wall_s"] >= conf["DOWNTIME_MIN_WALL_S"]
                     and ratio > conf["DOWNTIME_RATIO_MAX"])
    evidence = {k: figures[k] for k in ("mfu", "expected_mfu", "mfu_margin", "tokens_per_step", "step_s",
                                        "flops_per_token", "parameters", "peak_tflops", "achieved_tflops",
                                        "gpu_utilization_pct", "downtime_ratio", "badput_s", "wall_s", "cost")}

    def pct(value):
        return f"{100 * value:.2f}%" if value is not None else "unknown"

    return [
        AlertSpec(key=f"job-{job.pk}-mfu", rule=Rule.MFU_LOW, severity=Severity.INFO, firing=mfu_low,
                  title=f"{name}: MFU {pct(mfu)} is below the expected {pct(expected)}",
                  summary=(f"MFU {pct(mfu)} ({figures['tokens_per_s'] or 0:.0f} tokens/s at "
                           f"{figures['step_s'] or 0:.3f} s/step) is more than {100 * margin:.0f}% below the "
                           f"expected {pct(expected)}."),
                  evidence=evidence, link=link, job_id=job.pk, revision=""),
        AlertSpec(key=f"job-{job.pk}-gpu-util", rule=Rule.GPU_UTIL_LOW, severity=Severity.INFO, firing=util_low,
                  title=f"{name}: GPU utilisation {util or 0:.0f}% while running",
                  summary=(f"Mean GPU utilisation over the last {conf['UTILIZATION_WINDOW_S']} s is "
                           f"{util or 0:.1f}%, below {conf['GPU_UTILIZATION_MIN_PCT']}%."),
                  evidence=evidence, link=link, job_id=job.pk),
        AlertSpec(key=f"job-{job.pk}-downtime", rule=Rule.DOWNTIME_HIGH, severity=Severity.INFO,
                  firing=downtime_high, title=f"{name}: downtime {pct(ratio)} of wall time",
                  summary=(f"Faults cost {figures['downtime_s']:.0f} s of {figures['wall_s']:.0f} s "
                           f"(detection, restart, paused): above {pct(conf['DOWNTIME_RATIO_MAX'])}."),
                  evidence=evidence, link=link, job_id=job.pk),
    ]
