"""GPU nodes, their GPUs, telemetry history, the agent command queue and agent evidence."""

from __future__ import annotations

import json

from django.db import models
from django.utils import timezone

from nodes.choices import CommandKind, CommandState, Health, Schedulability, SlurmAllocationState, Transport


class Node(models.Model):
    """A machine that runs ranks of training jobs.

    ``health`` is what telemetry and heartbeats say; ``schedulability`` is what operators and
    the drain policy say. A node takes new work only when it is active and usably healthy.
    """

    hostname = models.CharField(max_length=253, unique=True)
    address = models.CharField(max_length=255, help_text="Address other nodes and the control plane reach it on.")
    transport = models.CharField(max_length=8, choices=Transport.choices, default=Transport.AGENT)
    health = models.CharField(max_length=12, choices=Health.choices, default=Health.UNKNOWN, db_index=True)
    schedulability = models.CharField(max_length=12, choices=Schedulability.choices,
                                      default=Schedulability.ACTIVE, db_index=True)
    drain_reason = models.TextField(blank=True)
    labels = models.JSONField(default=dict, blank=True)
    is_spare = models.BooleanField(default=False, help_text="Held back to replace a failed node.")
    # How often this node was blamed for an incident; a lemon is kept out until cleared.
    lemon_count = models.PositiveIntegerField(default=0)
    agent_version = models.CharField(max_length=40, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # Missed by then means unreachable; indexed for the sweeper.
    heartbeat_deadline = models.DateTimeField(null=True, blank=True, db_index=True)
    created_at = models.DateTimeField(default=timezone.now)
    # --- written by nodes.services only -------------------------------------------------
    health_reason = models.TextField(blank=True, help_text="Why the node has its current health.")
    health_changed_at = models.DateTimeField(null=True, blank=True)
    schedulability_changed_at = models.DateTimeField(null=True, blank=True)
    registered_at = models.DateTimeField(null=True, blank=True)
    # What the agent said in its last heartbeat. ``running`` decides whether the node is idle
    # (the free-memory rule) and when a draining node has finished draining.
    running = models.JSONField(default=list, blank=True, help_text="Generations the agent runs.")
    gpu_telemetry = models.BooleanField(default=True)
    gpu_telemetry_reason = models.TextField(blank=True, help_text="Why the agent has no GPU telemetry.")
    probe_port = models.PositiveIntegerField(null=True, blank=True, help_text="Bandwidth probe server port.")
    last_heartbeat_seq = models.BigIntegerField(null=True, blank=True)
    # The agent's own drain flag; differs from ``schedulability`` after an undrain until the agent restarts.
    agent_draining = models.BooleanField(default=False)
    spooled = models.PositiveBigIntegerField(default=0, help_text="Records waiting in the agent's disk spool.")
    telemetry_dropped = models.PositiveBigIntegerField(default=0, help_text="Samples the agent's spool dropped.")

    class Meta:
        ordering = ["hostname"]
        permissions = [("drain_node", "Can drain and undrain nodes")]

    def __str__(self):
        return self.hostname

    @property
    def is_schedulable(self) -> bool:
        return self.schedulability == Schedulability.ACTIVE and self.health in Health.USABLE


class GPU(models.Model):
    """One accelerator of a node, with its latest health reading."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=80, blank=True)
    name = models.CharField(max_length=100, blank=True)
    memory_total_mb = models.PositiveIntegerField(null=True, blank=True)
    health = models.CharField(max_length=12, choices=Health.choices, default=Health.UNKNOWN)
    last_sample = models.JSONField(default=dict, blank=True)
    last_sample_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_node_index")]

    def __str__(self):
        return f"{self.node.hostname}/gpu{self.index}"


class PerGpuField(models.Field):
    """One value per GPU of a node, at the GPU's index (``None`` where that GPU said nothing).

    A PostgreSQL array of ``base_type`` (``smallint``, ``integer``, ``real``): eight readings in
    one row cost one tuple header and one index entry instead of eight. Elsewhere (SQLite, the
    embedded demo) the same list as JSON text. Values arrive already clamped to ``base_type``'s range.
    """

    def __init__(self, *args, base_type: str = "smallint", **kwargs):
        self.base_type = base_type
        super().__init__(*args, **kwargs)

    def deconstruct(self):
        name, path, args, kwargs = super().deconstruct()
        kwargs["base_type"] = self.base_type
        return name, path, args, kwargs

    def db_type(self, connection):
        return f"{self.base_type}[]" if connection.vendor == "postgresql" else "text"

    def from_db_value(self, value, expression, connection):
        return json.loads(value) if isinstance(value, str) else value

    def get_db_prep_value(self, value, connection, prepared=False):
        if value is None or connection.vendor == "postgresql":
            return value
        return json.dumps(value)


class NodeGpuSample(models.Model):
    """The GPUs of one node at one moment, as the agent's telemetry reported them: raw history.

    Only what an operator charts is kept here (the full reading of each GPU, which the health
    rules judge, is ``GPU.last_sample``); ``NodeGpuMinute`` keeps it longer, a minute at a time.
    One row per (node, time) with a value per GPU (``PerGpuField``): ~40 bytes per GPU sample
    where a row per GPU cost ~136 (docs/architecture.md, "Telemetry storage"). ``gpus`` is the
    bitmask of the GPUs the row holds, so that a batch split between GPUs, or replayed, merges
    into the row and is counted once.

    On PostgreSQL the table is range-partitioned by ``time`` (an hour a partition, plus a
    default one) and retention drops whole partitions (``nodes.services.partitions``). The key
    includes ``time``, as a partitioned table's key must; its leading ``node`` serves a node's
    history over a time range.
    """

    pk = models.CompositePrimaryKey("node", "time")
    # No index of its own: the key (node, time) leads with it.
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="samples", db_index=False)
    time = models.DateTimeField()
    gpus = models.BigIntegerField(help_text="Bit i set: GPU i is in this row.")
    temperature_c = PerGpuField(null=True)
    utilization_pct = PerGpuField(null=True)
    memory_used_mib = PerGpuField(base_type="integer", null=True)
    power_w = PerGpuField(null=True)
    sm_clock_mhz = PerGpuField(null=True)
    # New errors since the GPU's sample before (Xids, uncorrected ECC, NVLink); NULL when no GPU of
    # the row counted one, which costs a bit instead of an array.
    xid_errors = PerGpuField(base_type="integer", null=True)
    ecc_uncorrected_errors = PerGpuField(base_type="integer", null=True)
    nvlink_errors = PerGpuField(base_type="integer", null=True)

    class Meta:
        ordering = ["node", "time"]

    def __str__(self):
        return f"{self.node_id} at {self.time:%Y-%m-%d %H:%M:%S}"


class NodeGpuMinute(models.Model):
    """The GPUs of one node over one closed minute: the rollup of their raw samples, kept for months.

    Laid out like ``NodeGpuSample`` (a value per GPU, ``gpus`` the bitmask of those present), for
    the same reason: a row per GPU and minute cost ~168 bytes a GPU-minute, this ~91 (docs/
    architecture.md, "Telemetry storage"). Written by ``nodes.services.rollup``, always recomputed
    from the raw rows, so writing a minute twice gives the same row. ``samples``: how many samples
    each GPU had in the minute; means are over the samples that had the value; error counts are
    the errors counted in the minute, NULL when no GPU counted any. Partitioned by day on PostgreSQL.
    """

    pk = models.CompositePrimaryKey("node", "minute")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="minutes", db_index=False)
    minute = models.DateTimeField()
    gpus = models.BigIntegerField(help_text="Bit i set: GPU i is in this row.")
    samples = PerGpuField()
    temperature_min = PerGpuField(null=True)
    temperature_mean = PerGpuField(base_type="real", null=True)
    temperature_max = PerGpuField(null=True)
    utilization_min = PerGpuField(null=True)
    utilization_mean = PerGpuField(base_type="real", null=True)
    utilization_max = PerGpuField(null=True)
    memory_used_mib_min = PerGpuField(base_type="integer", null=True)
    memory_used_mib_mean = PerGpuField(base_type="real", null=True)
    memory_used_mib_max = PerGpuField(base_type="integer", null=True)
    power_min = PerGpuField(null=True)
    power_mean = PerGpuField(base_type="real", null=True)
    power_max = PerGpuField(null=True)
    xid_errors = PerGpuField(base_type="integer", null=True)
    ecc_uncorrected_errors = PerGpuField(base_type="integer", null=True)
    nvlink_errors = PerGpuField(base_type="integer", null=True)

    class Meta:
        ordering = ["node", "minute"]

    def __str__(self):
        return f"{self.node_id} at {self.minute:%Y-%m-%d %H:%M}"


class NodeCommand(models.Model):
    """Something the agent of ``node`` must do, pulled with its heartbeats, at least once.

    Re-sent in every heartbeat answer until the agent acknowledges it; the agent runs an
    ``idempotency_key`` once. ``expires_at`` is the sweeper's deadline: a command nobody
    acknowledged by then is expired rather than re-sent forever.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="commands")
    kind = models.CharField(max_length=16, choices=CommandKind.choices)
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.CASCADE, related_name="commands")
    generation = models.PositiveIntegerField(null=True, blank=True)
    idempotency_key = models.CharField(max_length=128)
    payload = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=12, choices=CommandState.choices, default=CommandState.PENDING)
    created_by = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)
    delivery_count = models.PositiveIntegerField(default=0)
    acked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(db_index=True)
    detail = models.TextField(blank=True, help_text="The agent's acknowledgement detail, or why it expired.")

    class Meta:
        ordering = ["created_at", "pk"]
        constraints = [
            models.UniqueConstraint(fields=["node", "idempotency_key"], name="nodecommand_node_key"),
        ]
        # Every heartbeat asks for the node's open commands.
        indexes = [models.Index(fields=["node", "state"], name="nodecommand_node_state")]

    def __str__(self):
        job = f" job {self.job_id} gen {self.generation}" if self.job_id else ""
        return f"{self.kind}{job} -> {self.node_id} ({self.state})"


class AgentEventRecord(models.Model):
    """An event the agent reported (exit reports, health checks, Xids …): the evidence store.

    Unique on (node, key): the agent replays its spool after an outage, and a key seen before
    is acknowledged without being stored or acted on twice.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="agent_events")
    key = models.CharField(max_length=128)
    kind = models.CharField(max_length=24, db_index=True)
    time = models.DateTimeField(help_text="When it happened, by the agent's clock.")
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.SET_NULL,
                            related_name="agent_events")
    # The job id as the agent sent it, kept even when it names no job we know.
    job_ref = models.CharField(max_length=64, blank=True)
    generation = models.PositiveBigIntegerField(null=True, blank=True)
    detail = models.JSONField(default=dict, blank=True)
    received_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["time", "pk"]
        constraints = [models.UniqueConstraint(fields=["node", "key"], name="agentevent_node_key")]
        # The orchestrator gathers a generation's exit reports from every node.
        indexes = [models.Index(fields=["job", "generation"], name="agentevent_job_generation")]

    def __str__(self):
        return f"{self.kind} from {self.node_id} at {self.time:%Y-%m-%d %H:%M:%S}"


class NodePairBandwidth(models.Model):
    """The latest bandwidth probe from ``source`` to ``peer``: a pair below the expected ratio is flagged."""

    source = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="bandwidth_out")
    peer = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="bandwidth_in")
    address = models.CharField(max_length=253)
    expected_mbps = models.FloatField()
    mbps = models.FloatField(null=True, blank=True)
    ok = models.BooleanField()
    error = models.TextField(blank=True)
    measured_at = models.DateTimeField()

    class Meta:
        ordering = ["source", "peer"]
        constraints = [models.UniqueConstraint(fields=["source", "peer"], name="bandwidth_source_peer")]

    def __str__(self):
        return f"{self.source_id}->{self.peer_id}: {self.mbps} MB/s ({'ok' if self.ok else 'slow'})"


# --- Slurm (``nodes.transports.slurm``) ------------------------------------------------------------

class SlurmController(models.Model):
    """Whether Slurm's controller answered lately: the degraded state operators see when it does not.

    One row per configured cluster. ``retry_after`` is the back-off of the periodic one-shots: a
    controller that is down is asked again only after it, so a dead Slurm costs one timed-out call
    per back-off period, never a crash loop.
    """

    cluster = models.CharField(max_length=64, unique=True)
    reachable = models.BooleanField(default=True)
    last_error = models.TextField(blank=True)
    last_contact_at = models.DateTimeField(null=True, blank=True)
    failing_since = models.DateTimeField(null=True, blank=True)
    consecutive_failures = models.PositiveIntegerField(default=0)
    retry_after = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"slurm {self.cluster}: {'reachable' if self.reachable else 'unreachable'}"


class SlurmAllocation(models.Model):
    """One generation of a job as one Slurm batch job: what was asked, Slurm's id, how it ended.

    Keyed by (job, generation): the generation is the fencing token, so a resubmission is always
    a new generation and a new row — Slurm's own requeue (which would restart from scratch) is off.
    Created in the transaction that starts the generation; ``sbatch`` runs after the commit.
    """

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="slurm_allocations")
    generation = models.PositiveIntegerField()
    state = models.CharField(max_length=12, choices=SlurmAllocationState.choices,
                             default=SlurmAllocationState.SUBMITTING, db_index=True)
    hostnames = models.JSONField(default=list, help_text="The nodes placement chose, in rank order.")
    excluded = models.JSONField(default=list, blank=True, help_text="Nodes passed to --exclude.")
    payload = models.JSONField(default=dict, help_text="The validated launch payload the script is built from.")
    script = models.TextField(blank=True, help_text="The batch script as submitted (holds no secret).")
    output_path = models.CharField(max_length=1000, blank=True)
    slurm_job_id = models.PositiveBigIntegerField(null=True, blank=True, db_index=True)
    slurm_state = models.CharField(max_length=32, blank=True)
    slurm_reason = models.CharField(max_length=200, blank=True)
    exit_code = models.IntegerField(null=True, blank=True, help_text="The batch script's exit status.")
    exit_signal = models.PositiveSmallIntegerField(null=True, blank=True)
    # The hooks of this generation report with this token; revoked when the generation ends.
    token = models.ForeignKey("core.ApiToken", null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    submitted_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_sent_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, help_text="Why the last sbatch/scancel for it failed.")

    class Meta:
        ordering = ["job", "generation"]
        constraints = [models.UniqueConstraint(fields=["job", "generation"], name="slurmallocation_job_generation")]

    def __str__(self):
        return f"job {self.job_id} gen {self.generation} -> slurm {self.slurm_job_id or '?'} ({self.state})"

    @property
    def job_name(self) -> str:
        """The Slurm job name: how a resubmission after a lost answer finds the job it already made."""
        return f"nw-{self.job_id}-g{self.generation}"


class SlurmNodeMirror(models.Model):
    """What Slurm last said about a node, and the drain state both sides last agreed on.

    ``agreed_drained`` is the memory that prevents ping-pong: a side whose drain state differs
    from it changed since, and its change is copied to the other side; then both agree again.
    """

    node = models.OneToOneField(Node, on_delete=models.CASCADE, related_name="slurm")
    slurm_state = models.CharField(max_length=32, blank=True)
    slurm_flags = models.JSONField(default=list, blank=True)
    slurm_reason = models.TextField(blank=True)
    slurm_reason_by = models.CharField(max_length=64, blank=True)
    agreed_drained = models.BooleanField(default=False)
    seen_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)

    def __str__(self):
        return f"{self.node.hostname}: slurm {self.slurm_state} {'+'.join(self.slurm_flags)}"
