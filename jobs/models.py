"""Jobs, their generations, incidents, and the append-only event log."""

from __future__ import annotations

import json

from django.db import models
from django.utils import timezone

from agents.protocol.hooks import PHASES
from core.models import Event  # noqa: F401 (re-exported: 38 test modules import it from here)
from jobs.choices import Decision, GenerationState, IncidentKind, IncidentState, JobState


class Job(models.Model):
    """A training job: its launch spec, its policies, and where it stands.

    ``state``, ``generation`` and ``restart_count`` are only ever changed by ``jobs.state``;
    ``generation`` is the fencing token every report, checkpoint and agent command must carry.
    """

    name = models.CharField(max_length=100)
    # --- spec: what to run --------------------------------------------------------------
    # Exactly one of entrypoint and module is set (agents.protocol.agent.validate_launch_target).
    entrypoint = models.CharField(max_length=500, blank=True,
                                  help_text="Training script (.py), relative to the nodes' code directory.")
    module = models.CharField(max_length=200, blank=True,
                              help_text="Or a module of the code directory, run as `python -m`.")
    args = models.JSONField(default=list, blank=True)
    nnodes = models.PositiveSmallIntegerField(default=1)
    nproc_per_node = models.PositiveSmallIntegerField(default=1)
    nccl_profile = models.JSONField(default=dict, blank=True, help_text="NCCL/Gloo environment variables.")
    accelerator = models.CharField(max_length=8, choices=[("gpu", "GPU (nccl)"), ("cpu", "CPU (gloo)")],
                                   default="gpu", help_text="A CPU job may run on nodes without GPU telemetry.")
    rdzv_port = models.PositiveIntegerField(default=29400, help_text="c10d rendezvous port on the first node.")
    checkpoint_policy = models.JSONField(default=dict, blank=True)
    recovery_policy = models.JSONField(default=dict, blank=True)
    # --- where it stands ----------------------------------------------------------------
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.PENDING, db_index=True)
    generation = models.PositiveIntegerField(default=0)
    restart_count = models.PositiveIntegerField(default=0)
    state_changed_at = models.DateTimeField(default=timezone.now)
    pause_reason = models.TextField(blank=True)
    last_step = models.BigIntegerField(null=True, blank=True)
    last_step_at = models.DateTimeField(null=True, blank=True)
    # No step by then while running means a hang; the sweeper's index.
    progress_deadline = models.DateTimeField(null=True, blank=True, db_index=True)
    # When rank 0's reporter last said nothing of it waited behind its batch (ReportBatch.newest_step_age_s),
    # and how old that batch's newest step was: refusals of the generation's reports before then held no
    # step back (jobs.progress._spare_refused), and a hang dates from that step (hang_fault_time).
    progress_caught_up_at = models.DateTimeField(null=True, blank=True)
    progress_caught_up_age_s = models.FloatField(null=True, blank=True)
    # --- control the hooks poll: set by operators and policies, read by train.py ---------
    checkpoint_requested_at = models.DateTimeField(null=True, blank=True,
                                                   help_text="Checkpoint now; cleared by the next commit.")
    pause_requested_at = models.DateTimeField(null=True, blank=True,
                                              help_text="Checkpoint, then exit with EXIT_PAUSED.")
    recommended_interval_steps = models.PositiveIntegerField(null=True, blank=True,
                                                             help_text="Pushed when the policy is 'auto'.")
    resize_to = models.JSONField(null=True, blank=True,
                                 help_text='A resize asked for ({"nnodes", "nproc_per_node"}): the next generation '
                                           "starts with that shape (jobs.services.resize_job).")
    # --- recovery bookkeeping (written by jobs.orchestrator) ------------------------------
    # Stop commands were sent; by then every node must have confirmed, or we escalate.
    quiesce_deadline = models.DateTimeField(null=True, blank=True, db_index=True)
    # Do not relaunch before this (exponential backoff between automatic restarts).
    relaunch_after = models.DateTimeField(null=True, blank=True)
    # The active lineage branch: the checkpoint a rollback started it from, and the first
    # generation on it. Restores only consider checkpoints of the active branch.
    branch_root = models.ForeignKey("checkpoints.Checkpoint", null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="+")
    branch_since_generation = models.PositiveIntegerField(default=0)
    # Global sample ranges [start, end) a rollback chose to skip (PaLM-style, around a spike).
    skip_data = models.JSONField(default=list, blank=True)
    # The breaker's window starts afresh when an on-call approves a resume.
    breaker_reset_at = models.DateTimeField(null=True, blank=True)
    created_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        permissions = [
            ("operate_job", "Can cancel, pause and roll back jobs"),
            ("approve_resume", "Can approve resuming a paused job"),
        ]
        indexes = [
            # The hang sweep's "what expired" (jobs.progress.expire_one_progress_deadline, states as in
            # its PROGRESS_WATCHED): a finished or paused job keeps its last deadline, and without the
            # condition every sweep would walk past all of them, oldest first, to find a live one.
            models.Index(fields=["progress_deadline"], name="job_watched_progress_deadline",
                         condition=models.Q(state__in=[JobState.INITIALIZING, JobState.RUNNING])),
        ]

    def __str__(self):
        return f"{self.name} (#{self.pk}, {self.state}, gen {self.generation})"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def is_terminal(self) -> bool:
        return self.state in JobState.TERMINAL


class Generation(models.Model):
    """One launch of a job: which nodes ran it, from which checkpoint, and how it ended."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="generations")
    number = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=GenerationState.choices, default=GenerationState.STARTING)
    nodes = models.ManyToManyField("nodes.Node", blank=True, related_name="generations")
    world_size = models.PositiveIntegerField()
    resumed_from = models.ForeignKey(
        "checkpoints.Checkpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="resumed_generations"
    )
    started_at = models.DateTimeField(default=timezone.now)
    first_step = models.BigIntegerField(null=True, blank=True)
    first_step_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    exit_reason = models.CharField(max_length=200, blank=True)
    exit_codes = models.JSONField(default=dict, blank=True, help_text="rank -> exit code")
    # Hostnames whose processes of this generation are confirmed gone (exit report or stop ack).
    stopped_nodes = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["job", "number"]
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="generation_job_number")]

    def __str__(self):
        return f"{self.job.name} gen {self.number}"


class Incident(models.Model):
    """A fault and what Nightwatch did about it, with the times goodput accounting needs."""

    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="incidents")
    generation = models.ForeignKey(Generation, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="incidents")
    kind = models.CharField(max_length=16, choices=IncidentKind.choices)
    classification = models.CharField(max_length=200, blank=True, help_text="The rule that matched, in words.")
    state = models.CharField(max_length=16, choices=IncidentState.choices, default=IncidentState.OPEN,
                             db_index=True)
    decision = models.CharField(max_length=24, choices=Decision.choices, blank=True)
    evidence = models.JSONField(default=dict, blank=True)
    nodes = models.ManyToManyField("nodes.Node", blank=True, related_name="incidents")
    fault_at = models.DateTimeField(null=True, blank=True)
    detected_at = models.DateTimeField(default=timezone.now)
    quiesced_at = models.DateTimeField(null=True, blank=True)
    relaunched_at = models.DateTimeField(null=True, blank=True)
    first_step_at = models.DateTimeField(null=True, blank=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    lost_steps = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-detected_at"]

    def __str__(self):
        return f"{self.get_kind_display()} on {self.job or 'cluster'} at {self.detected_at:%Y-%m-%d %H:%M:%S}"


class StepMetric(models.Model):
    """One optimizer step of a job, as the training hooks reported it: rank 0's report of every
    step speaks for the job; another rank has a row only for a step it flagged (NaN, spike,
    skipped, inconsistent). Rank timings are in ``NodeWindow``.

    Unique on (job, generation, rank, step): replays after an outage are recognised, not doubled.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="step_metrics")
    generation = models.PositiveIntegerField()
    rank = models.PositiveIntegerField()
    step = models.BigIntegerField()
    loss = models.FloatField(null=True, blank=True, help_text="Null when the loss was not finite (see nan).")
    grad_norm = models.FloatField(null=True, blank=True)
    world_size = models.PositiveIntegerField()
    data_cursor = models.BigIntegerField()
    samples = models.PositiveIntegerField(default=0)
    tokens = models.PositiveBigIntegerField(default=0)
    phases = models.JSONField(default=dict, blank=True)
    skipped = models.BooleanField(default=False)
    spike = models.BooleanField(default=False)
    nan = models.BooleanField(default=False)
    inconsistent = models.BooleanField(default=False)
    reported_at = models.DateTimeField(help_text="End of the step, by the rank's clock.")
    received_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["job", "generation", "step", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["job", "generation", "rank", "step"], name="stepmetric_unique"),
        ]

    def __str__(self):
        return f"job {self.job_id} gen {self.generation} rank {self.rank} step {self.step}"


class PhaseTimesField(models.Field):
    """Seconds per step phase (``{"compute": 0.41, ...}``, keys from ``agents.protocol.hooks.PHASES``).

    On PostgreSQL a ``real[]`` in ``PHASES`` order (NULL where a phase was not reported): 40 bytes
    where the same figures as ``jsonb`` cost ~110, a third of a node window's row (issue 18's fleet
    run: node windows were 2.5 GB a day at 1,024 nodes). ``real`` keeps 7 significant digits, plenty
    for a mean phase time, and reads come back rounded to them, so what was written is what is read.
    Elsewhere (SQLite, the embedded demo) the same list as JSON text.
    """

    def db_type(self, connection):
        return "real[]" if connection.vendor == "postgresql" else "text"

    def from_db_value(self, value, expression, connection):
        return self.to_python(value)

    def to_python(self, value):
        if isinstance(value, str):
            value = json.loads(value)
        if value is None or isinstance(value, dict):  # a row written before the field was an array
            return value
        return {name: float(f"{seconds:.7g}") for name, seconds in zip(PHASES, value, strict=False)
                if seconds is not None}

    def get_db_prep_value(self, value, connection, prepared=False):
        if value is None:
            return None
        unknown = set(value) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown step phases {sorted(unknown)}: expected some of {list(PHASES)}")
        values = [value.get(name) for name in PHASES]
        return values if connection.vendor == "postgresql" else json.dumps(values)


class NodeWindow(models.Model):
    """The step times of one node's ranks over the steps between two cross-rank exchanges, with
    the node's slowest rank (``agents.protocol.hooks.NodeWindow``): a row per node and window,
    whatever the number of ranks.

    Keyed by (job, generation, node, last_step, reported_at): a replay after an outage carries
    the same exchange time and is recognised. ``node`` is torchrun's node rank within the
    generation. On PostgreSQL the table is range-partitioned by ``reported_at`` (an hour a
    partition, as the raw telemetry) and retention drops whole partitions (``jobs.windows``); the
    key includes ``reported_at``, as a partitioned table's key must.
    """

    pk = models.CompositePrimaryKey("job", "generation", "node", "last_step", "reported_at")
    # No index of its own: the key leads with it.
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="node_windows", db_index=False)
    generation = models.PositiveIntegerField()
    node = models.PositiveIntegerField()
    first_step = models.BigIntegerField()
    last_step = models.BigIntegerField()
    ranks = models.PositiveIntegerField()
    step_median_s = models.FloatField()
    step_max_s = models.FloatField()
    slowest_rank = models.PositiveIntegerField()
    slowest_s = models.FloatField()
    slowest_phases = PhaseTimesField(default=dict, blank=True)
    phases = PhaseTimesField(default=dict, blank=True)
    reported_at = models.DateTimeField(help_text="The exchange that closed the window, by rank 0's clock.")
    received_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["job", "generation", "last_step", "node"]
        # The skew view's "newest windows of a generation".
        indexes = [models.Index(fields=["job", "generation", "last_step"], name="nodewindow_newest")]

    def __str__(self):
        return f"job {self.job_id} gen {self.generation} node {self.node} steps {self.first_step}-{self.last_step}"


class TrainingEvent(models.Model):
    """Something the hooks noticed inside train.py: a resume, a skipped step, a spike, a NaN…"""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="training_events")
    generation = models.PositiveIntegerField()
    rank = models.PositiveIntegerField()
    step = models.BigIntegerField()
    kind = models.CharField(max_length=32, db_index=True)
    key = models.CharField(max_length=200)
    message = models.TextField(blank=True)
    detail = models.JSONField(default=dict, blank=True)
    reported_at = models.DateTimeField()
    received_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["job", "reported_at", "pk"]
        constraints = [models.UniqueConstraint(fields=["job", "generation", "key"], name="trainingevent_key")]

    def __str__(self):
        return f"{self.kind} at step {self.step} (rank {self.rank})"


class EfficiencyTarget(models.Model):
    """What a job is expected to achieve, and overrides of what its hooks report.

    Moved from alerts with the efficiency figures (issue 22); the table keeps its old name.
    """

    job = models.OneToOneField(Job, on_delete=models.CASCADE, related_name="efficiency_target")
    expected_mfu = models.FloatField(null=True, blank=True,
                                     help_text="0-1. The MFU alert fires below this less the margin.")
    mfu_margin = models.FloatField(null=True, blank=True,
                                   help_text="Relative margin, e.g. 0.2 = alert below 80% of the expected MFU. "
                                             "Default: NIGHTWATCH['EFFICIENCY']['MFU_MARGIN'].")
    flops_per_token = models.FloatField(null=True, blank=True,
                                        help_text="Overrides the hooks' figure (default 6 x parameters).")

    class Meta:
        db_table = "alerts_efficiencytarget"

    def __str__(self):
        return f"efficiency target of job {self.job_id}"


class LogStream(models.Model):
    """One node's share of a generation's training output (``jobs.logs``): how far it has arrived,
    what it holds and what was dropped to stay within the per-generation cap."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_streams")
    generation = models.PositiveIntegerField()
    hostname = models.CharField(max_length=255)
    #: The next line number expected from the node (every line before it arrived or was dropped).
    next_line = models.BigIntegerField(default=0)
    bytes = models.BigIntegerField(default=0, help_text="Characters of the lines still stored.")
    dropped = models.BigIntegerField(default=0, help_text="Lines dropped: by the agent's buffer or the cap.")
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "generation", "hostname"], name="one_log_stream")]

    def __str__(self) -> str:
        return f"job {self.job_id} generation {self.generation} on {self.hostname}"


class LogLine(models.Model):
    """A line of a generation's torchrun output as the node's agent shipped it (sanitised text). The
    id is the follow cursor: lines arrive in id order."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_lines")
    generation = models.PositiveIntegerField()
    stream = models.ForeignKey(LogStream, on_delete=models.CASCADE, related_name="lines")
    line = models.BigIntegerField(help_text="Line number in the node's output of the generation.")
    rank = models.IntegerField(null=True, blank=True, help_text="The rank that printed it, when the line says so.")
    text = models.TextField()
    received_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        indexes = [models.Index(fields=["job", "generation", "id"], name="log_line_job_generation"),
                   models.Index(fields=["job", "id"], name="log_line_job")]

    def __str__(self) -> str:
        return f"job {self.job_id} generation {self.generation} line {self.line}"


class PoolPrice(models.Model):
    """Price of one accelerator-hour in a node pool (``Node.labels['pool']``).

    Moved from alerts with the efficiency figures (issue 22); the table keeps its old name.
    """

    pool = models.CharField(max_length=100, unique=True)
    price_per_gpu_hour = models.DecimalField(max_digits=10, decimal_places=4)
    currency = models.CharField(max_length=3, default="USD")

    class Meta:
        db_table = "alerts_poolprice"
        ordering = ["pool"]

    def __str__(self):
        return f"{self.pool}: {self.price_per_gpu_hour} {self.currency}/GPU-h"
