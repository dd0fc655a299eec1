"""The audit log's vocabulary: every kind of ``Event`` row, the evidence each kind carries, and
``record_event()``, the one function that appends a row.

A kind is an ``EventKind``, never a bare string, and its evidence is checked against the kind's
``TypedDict`` (every key optional, none unknown, each of its declared type) before the row is
written: a writer that drifts from the shape fails in its own tests instead of leaving rows that
the alerts, timelines and goodput cannot read.
"""

from __future__ import annotations

import functools
import types
import typing
from datetime import datetime
from typing import Any, TypedDict

from django.db import models
from django.utils import timezone

from core.models import Event
from core.text import clean, clip


class EventKind(models.TextChoices):
    JOB_LAUNCH = "job.launch"
    JOB_STATE = "job.state"
    JOB_EFFICIENCY_TARGET = "job.efficiency_target"
    JOB_CHECKPOINT_REQUEST = "job.checkpoint_request"
    JOB_REPORTS_REFUSED = "job.reports_refused"
    JOB_RESIZE = "job.resize"
    INCIDENT_OPEN = "incident.open"
    INCIDENT_RESOLVED = "incident.resolved"
    NODE_REGISTER = "node.register"
    NODE_BOOTSTRAP_TOKEN = "node.bootstrap_token"  # noqa: S105 (a kind, not a secret)
    NODE_COMMAND = "node.command"
    NODE_HEALTH = "node.health"
    NODE_DRAIN = "node.drain"
    NODE_DRAINED = "node.drained"
    NODE_UNDRAIN = "node.undrain"
    NODE_BLAME = "node.blame"
    NODE_LEMON_CLEARED = "node.lemon_cleared"
    FLEET_SILENCE = "fleet.silence"
    FLEET_OVERLOAD = "fleet.overload"
    SLURM_REACHABLE = "slurm.reachable"
    SLURM_UNREACHABLE = "slurm.unreachable"
    SLURM_SUBMIT = "slurm.submit"
    SLURM_REFUSED = "slurm.refused"
    SLURM_ENDED = "slurm.ended"
    TOKEN_ROTATE = "token.rotate"  # noqa: S105 (a kind, not a secret)
    CHECKPOINT_COMMIT = "checkpoint.commit"
    CHECKPOINT_INTERVAL = "checkpoint.interval"
    CHECKPOINT_VERIFY = "checkpoint.verify"
    CHECKPOINT_PIN = "checkpoint.pin"
    CHECKPOINT_UNPIN = "checkpoint.unpin"
    CHECKPOINT_DELETE = "checkpoint.delete"
    CHECKPOINT_DELETE_FAILED = "checkpoint.delete_failed"
    CHECKPOINT_REPLICA = "checkpoint.replica"
    CHECKPOINT_RESTORE_FROM_REPLICA = "checkpoint.restore_from_replica"
    STORAGE_TORN_REMOVED = "storage.torn_removed"
    STORAGE_PRESSURE = "storage.pressure"
    ALERT_CHANNEL = "alert.channel"
    ALERT_CHANNEL_TEST = "alert.channel.test"


#: Kinds that move markers on a job's chart (restarts, checkpoints).
CHART_KINDS = frozenset({EventKind.JOB_STATE} | {k for k in EventKind if k.startswith("checkpoint.")})
#: Kinds that change a node's schedulability (``nodes.services.fleet``).
SCHEDULABILITY_KINDS = frozenset({EventKind.NODE_DRAIN, EventKind.NODE_DRAINED, EventKind.NODE_UNDRAIN})


# --- evidence shapes (every key optional: writers send the ones that apply) -------------------------

class JobLaunchEvidence(TypedDict, total=False):
    spec: dict[str, Any]


class JobStateEvidence(TypedDict, total=False):
    nodes: list[str]  # a generation's placement
    resume_from: str | None
    shrunk: bool
    incident: int  # quiescing for this incident
    force: bool  # an approved resume
    checkpoint: int  # a rollback's restore point
    skip_data: list[int] | None


class CheckpointRequestEvidence(TypedDict, total=False):
    last_step: int | None  # the step reached when asked: how far the checkpoint that answers it lags


class ResizeEvidence(TypedDict, total=False):
    old_nnodes: int
    old_nproc_per_node: int
    nnodes: int
    nproc_per_node: int
    last_step: int | None  # the step reached when asked
    state: str  # running: pause at a checkpoint, then resume; paused: the next resume takes the new size


class EfficiencyTargetEvidence(TypedDict, total=False):
    expected_mfu: float | None
    mfu_margin: float | None
    flops_per_token: float | None


class IncidentOpenEvidence(TypedDict, total=False):
    incident: int
    decision: str


class IncidentResolvedEvidence(TypedDict, total=False):
    incident: int
    decision: str
    lost_steps: int | None  # steps trained past the restore point, redone after the restart
    restored_step: int | None  # the restore point: the step the resumed generation's hooks restored


class NodeRegisterEvidence(TypedDict, total=False):
    address: str
    labels: dict[str, Any]
    gpus: list[dict[str, Any]]
    previous: dict[str, Any] | None


class BootstrapTokenEvidence(TypedDict, total=False):
    token: str
    prefix: str
    expires_at: str


class NodeCommandEvidence(TypedDict, total=False):
    command: int
    idempotency_key: str


class NodeHealthEvidence(TypedDict, total=False):
    reasons: list[str]
    gpus: dict[str, str]  # GPU index -> its own health
    gpu_telemetry: bool
    xid: dict[str, Any]
    fault_at: float  # when the node says the fault happened (a critical Xid's time, epoch seconds)
    command: list[str]  # the Slurm command that failed
    last_heartbeat_at: str
    deadline: str
    slurm_state: str
    flags: list[str]


class SchedulabilityEvidence(TypedDict, total=False):
    health: str
    warning: str  # an undrained lemon: placement still keeps it out until its count is cleared
    lemon_count: int


class NodeBlameEvidence(TypedDict, total=False):
    incident: int
    jobs: list[int]  # crash blame: the different jobs that crashed on the node inside the window


class NoEvidence(TypedDict, total=False):
    pass


class TornSaveEvidence(TypedDict, total=False):
    """Retention removed a save directory that was never committed (a torn save)."""

    location: str
    generation: int | None  # the generation that wrote it
    size_bytes: int
    idle_s: float  # since its last write


class StoragePressureEvidence(TypedDict, total=False):
    """Retention found the job's checkpoint file system short of space, and what it deleted."""

    directory: str
    free_bytes: int
    total_bytes: int
    target_bytes: int  # free space retention works towards
    out_of_space: bool  # a save failed with ENOSPC since the last commit
    deleted: list[int]  # checkpoints deleted for space, oldest first
    released_permanent: list[int]  # of them, permanent ones retention itself had promoted
    freed_bytes: int
    still_short: bool  # nothing more may be deleted and the target is not reached


class ReportsRefusedEvidence(TypedDict, total=False):
    """A report batch refused as implausible (``jobs.plausibility``): how many records, why."""

    records: int  # refused records in the batch (the batch's other records were not stored either)
    reason: str  # the first refused record's reason code
    reasons: dict[str, int]  # reason code -> records
    examples: list[dict[str, Any]]  # the first few: rank, step, reason, detail


class FleetSilenceEvidence(TypedDict, total=False):
    silent: int
    expected: int
    oldest_missed_deadline: str | None
    silent_since: str
    deadlines_reset: dict[str, int]


class FleetOverloadEvidence(TypedDict, total=False):
    window_s: float
    heartbeats_refused: int | None
    refused: int | None
    late_heartbeats: int | None
    queue_depth: int | None
    since: str
    holding: bool  # the sweepers hold (heartbeats late or queued); False: refused callers are spared one by one
    deadlines_reset: dict[str, int]


class SlurmControllerEvidence(TypedDict, total=False):
    cluster: str
    last_error: str
    command: list[str]


class SlurmSubmitEvidence(TypedDict, total=False):
    slurm_job_id: int
    adopted: bool
    excluded: list[str]


class SlurmRefusedEvidence(TypedDict, total=False):
    command: list[str]


class SlurmEndedEvidence(TypedDict, total=False):
    exit_code: int | None
    slurm: dict[str, Any]


class TokenRotateEvidence(TypedDict, total=False):
    old_prefix: str
    new_prefix: str


class CheckpointCommitEvidence(TypedDict, total=False):
    checkpoint: int
    step: int
    blocking_s: float | None
    total_s: float | None
    size_bytes: int | None


class CheckpointIntervalEvidence(TypedDict, total=False):
    job: int
    computed_at: str
    save_cost_s: float | None
    total_save_s: float | None
    cost_samples: int
    mtbf_s: float
    mtbf_source: str
    failures: int
    exposure_s: float
    gpus: int
    gpu_mtbf_hours: float
    interval_s: float | None
    step_time_s: float | None
    step_samples: int
    interval_steps: int | None
    explanation: str


class CheckpointEvidence(TypedDict, total=False):
    """Every row about one checkpoint names it; deletions and copies name where it lay."""

    checkpoint: int
    step: int
    location: str
    replica_location: str
    size_bytes: int | None


class AlertChannelEvidence(TypedDict, total=False):
    channel: int
    name: str
    kind: str
    min_severity: str
    fields: list[str]


class AlertChannelTestEvidence(TypedDict, total=False):
    channel: int
    delivery: int


EVIDENCE: dict[EventKind, type] = {
    EventKind.JOB_LAUNCH: JobLaunchEvidence,
    EventKind.JOB_STATE: JobStateEvidence,
    EventKind.JOB_EFFICIENCY_TARGET: EfficiencyTargetEvidence,
    EventKind.JOB_CHECKPOINT_REQUEST: CheckpointRequestEvidence,
    EventKind.JOB_REPORTS_REFUSED: ReportsRefusedEvidence,
    EventKind.JOB_RESIZE: ResizeEvidence,
    EventKind.INCIDENT_OPEN: IncidentOpenEvidence,
    EventKind.INCIDENT_RESOLVED: IncidentResolvedEvidence,
    EventKind.NODE_REGISTER: NodeRegisterEvidence,
    EventKind.NODE_BOOTSTRAP_TOKEN: BootstrapTokenEvidence,
    EventKind.NODE_COMMAND: NodeCommandEvidence,
    EventKind.NODE_HEALTH: NodeHealthEvidence,
    EventKind.NODE_DRAIN: SchedulabilityEvidence,
    EventKind.NODE_DRAINED: SchedulabilityEvidence,
    EventKind.NODE_UNDRAIN: SchedulabilityEvidence,
    EventKind.NODE_BLAME: NodeBlameEvidence,
    EventKind.NODE_LEMON_CLEARED: NoEvidence,
    EventKind.FLEET_SILENCE: FleetSilenceEvidence,
    EventKind.FLEET_OVERLOAD: FleetOverloadEvidence,
    EventKind.SLURM_REACHABLE: SlurmControllerEvidence,
    EventKind.SLURM_UNREACHABLE: SlurmControllerEvidence,
    EventKind.SLURM_SUBMIT: SlurmSubmitEvidence,
    EventKind.SLURM_REFUSED: SlurmRefusedEvidence,
    EventKind.SLURM_ENDED: SlurmEndedEvidence,
    EventKind.TOKEN_ROTATE: TokenRotateEvidence,
    EventKind.CHECKPOINT_COMMIT: CheckpointCommitEvidence,
    EventKind.CHECKPOINT_INTERVAL: CheckpointIntervalEvidence,
    EventKind.CHECKPOINT_VERIFY: CheckpointEvidence,
    EventKind.CHECKPOINT_PIN: CheckpointEvidence,
    EventKind.CHECKPOINT_UNPIN: CheckpointEvidence,
    EventKind.CHECKPOINT_DELETE: CheckpointEvidence,
    EventKind.CHECKPOINT_DELETE_FAILED: CheckpointEvidence,
    EventKind.CHECKPOINT_REPLICA: CheckpointEvidence,
    EventKind.CHECKPOINT_RESTORE_FROM_REPLICA: CheckpointEvidence,
    EventKind.STORAGE_TORN_REMOVED: TornSaveEvidence,
    EventKind.STORAGE_PRESSURE: StoragePressureEvidence,
    EventKind.ALERT_CHANNEL: AlertChannelEvidence,
    EventKind.ALERT_CHANNEL_TEST: AlertChannelTestEvidence,
}


class EvidenceError(ValueError):
    """Evidence that does not fit its kind's shape: a writer's bug, raised before anything is written."""


def check_evidence(kind: EventKind, evidence: dict[str, Any]) -> None:
    """Raise ``EvidenceError`` unless every key of ``evidence`` is declared for ``kind`` with its type."""
    hints = _hints(kind)
    for key, value in evidence.items():
        if key not in hints:
            raise EvidenceError(f"{kind}: unknown evidence key {key!r} (known: {', '.join(sorted(hints)) or 'none'})")
        if not _fits(value, hints[key]):
            raise EvidenceError(f"{kind}: evidence {key!r} is {value!r}, not {hints[key]}")


@functools.cache
def _hints(kind: EventKind) -> dict[str, Any]:
    # Resolving the annotations is most of the check's cost: a batch of 1,000 events paid it 1,000 times.
    return typing.get_type_hints(EVIDENCE[kind])


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_fits(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
    if isinstance(value, bool):  # a bool is an int to isinstance(); not to a shape
        return hint is bool
    if hint is float:
        return isinstance(value, int | float)
    return isinstance(value, hint)


def record_event(kind: EventKind, *, actor: str, reason: str = "", job: models.Model | int | None = None,
                 node: models.Model | None = None, generation: int | None = None, old_state: str = "",
                 new_state: str = "",
                 evidence: dict[str, Any] | None = None, created_at: datetime | None = None) -> Event:
    """Append one row to the audit log. ``job`` is a job or its primary key."""
    kind = EventKind(kind)
    evidence = evidence or {}
    check_evidence(kind, evidence)
    job_ref = {"job_id": job} if isinstance(job, int) or job is None else {"job": job}
    return Event.objects.create(kind=kind, reason=clean(reason), node=node, generation=generation,
                                evidence=evidence, created_at=created_at or timezone.now(),
                                **_bounded(actor, old_state, new_state), **job_ref)


def record_events(kind: EventKind, rows: list[dict[str, Any]]) -> list[Event]:
    """Append one row per item of ``rows`` (``record_event``'s keyword arguments, ``kind`` aside) in
    one INSERT: the same fact about many nodes at once (the heartbeat sweeper's batch). A bulk
    insert sends no ``post_save``, so it is for kinds no receiver watches row by row."""
    kind = EventKind(kind)
    events = []
    for row in rows:
        evidence = row.get("evidence") or {}
        check_evidence(kind, evidence)
        events.append(Event(kind=kind, reason=clean(row.get("reason", "")), node=row.get("node"),
                            job_id=row.get("job"), generation=row.get("generation"),
                            **_bounded(row["actor"], row.get("old_state", ""), row.get("new_state", "")),
                            evidence=evidence, created_at=row.get("created_at") or timezone.now()))
    return Event.objects.bulk_create(events)


def _bounded(actor: str, old_state: str, new_state: str) -> dict[str, str]:
    """The bounded columns of a row, clipped: ``node:<a 253-character hostname>`` is longer than the
    actor column, and an audit row that cannot be written would lose the change it records."""
    return {"actor": clip(actor, _ACTOR_LEN), "old_state": clip(old_state, _STATE_LEN),
            "new_state": clip(new_state, _STATE_LEN)}


_ACTOR_LEN = Event._meta.get_field("actor").max_length
_STATE_LEN = Event._meta.get_field("old_state").max_length
