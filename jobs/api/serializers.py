"""Job representations and the launch spec, validated field by field."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path

from rest_framework import serializers

from agents.protocol.agent import (
    MAX_INPROCESS_RESTARTS,
    MAX_MODULE,
    MAX_SCRIPT,
    MAX_SNAPSHOT_EVERY,
    LaunchSpecError,
    module_problem,
    script_problem,
    validate_nccl_profile,
)
from checkpoints.paths import OutsideRoot, checkpoint_root, confine, confine_directory, replica_roots
from checkpoints.policies import CheckpointPolicy
from core.models import Event
from jobs.models import Generation, Incident, Job
from jobs.policies import RecoveryPolicy
from jobs.progress import PROGRESS_TIMEOUT_MIN_OVERRIDE_S


class StrictSerializer(serializers.Serializer):
    """Refuses keys it does not know, naming them: a misspelt policy field must not fall back to
    its default in silence, and nothing that was sent is dropped."""

    def to_internal_value(self, data):
        if isinstance(data, Mapping):
            known = [name for name, f in self.fields.items() if not f.read_only]
            unknown = {str(key): [_unknown(str(key), known)] for key in data if key not in known}
            if unknown:
                raise serializers.ValidationError(unknown)
        return super().to_internal_value(data)


def _unknown(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"Unknown field; did you mean {close[0]!r}?" if close else f"Unknown field; known: {', '.join(known)}."


def _text(**kwargs) -> serializers.CharField:
    """A string taken as sent: never trimmed (NUL is refused by DRF's CharField)."""
    return serializers.CharField(trim_whitespace=False, **kwargs)


#: The defaults each policy serializer fills in: the policy classes', written there once.
_CHECKPOINT = CheckpointPolicy()
_RECOVERY = RecoveryPolicy()


class CheckpointPolicySerializer(StrictSerializer):
    dir = _text(max_length=1000, required=False,
                help_text="Checkpoint directory shared by the nodes and the control plane, inside "
                          "NIGHTWATCH_CHECKPOINT_ROOT. Default: <checkpoint root>/job-<id>.")
    replica_dir = _text(max_length=1000, required=False,
                        help_text="Second storage location for verified checkpoints.")
    interval = serializers.ChoiceField(choices=["fixed", "auto"], default=_CHECKPOINT.interval,
                                       help_text="auto: follow the Young/Daly recommendation.")
    interval_steps = serializers.IntegerField(
        min_value=1, max_value=10_000_000, allow_null=True, default=_CHECKPOINT.interval_steps,
        help_text="With interval fixed: save every this many steps (the control plane tells the hooks, overriding "
                  "the script's checkpoint_every from the first report's answer on). Null: the script's "
                  "checkpoint_every. Refused with interval auto, whose interval is the Young/Daly recommendation.")
    keep_last = serializers.IntegerField(min_value=1, max_value=1000, default=_CHECKPOINT.keep_last)
    permanent_every_hours = serializers.IntegerField(min_value=0, max_value=24 * 30,
                                                     default=_CHECKPOINT.permanent_every_hours,
                                                     help_text="0 disables permanent checkpoints.")
    min_free_percent = serializers.IntegerField(
        min_value=0, max_value=90, default=_CHECKPOINT.min_free_percent,
        help_text="Disk pressure below this much free space (percent of the checkpoint file system, and at least "
                  "room for two saves): retention deletes the oldest unprotected checkpoints first.")
    release_permanent_under_pressure = serializers.BooleanField(
        default=_CHECKPOINT.release_permanent_under_pressure,
        help_text="Under disk pressure, permanent checkpoints retention promoted itself (the first one, then one "
                  "every permanent_every_hours) may be deleted too, oldest first; never one an operator pinned.")
    snapshot_every = serializers.IntegerField(
        min_value=0, max_value=MAX_SNAPSHOT_EVERY, default=_CHECKPOINT.snapshot_every,
        help_text="In-memory snapshots, copied to a partner rank, every this many steps: a relaunch after a crash "
                  "resumes from the newest one of the job's lineage branch (a rollback never does), losing at most "
                  "this many steps. 0: the script's own Hooks(snapshot_every=), off unless it sets one.")

    def validate_dir(self, value):
        # Confined like every checkpoint path (realpath: neither ".." nor a symlink inside the root may
        # lead out of it), and never shared: a job whose directory holds, or lies in, another job's could
        # commit, verify and prune that job's checkpoints as its own.
        try:
            confine(value, [checkpoint_root()], what="dir")
        except OutsideRoot as exc:
            raise serializers.ValidationError(str(exc)) from None
        if (other := _job_sharing(value)) is not None:
            raise serializers.ValidationError(f"Overlaps job {other}'s checkpoint directory; give each job its own.")
        return value

    def validate(self, attrs):
        attrs = super().validate(attrs)
        if attrs.get("interval") == "auto" and attrs.get("interval_steps") is not None:
            raise serializers.ValidationError({"interval_steps": [
                "interval_steps applies to interval: fixed; with interval: auto the interval is the Young/Daly "
                "recommendation (GET /jobs/{id}/checkpoints/interval). Drop one of the two."]})
        return attrs

    def validate_replica_dir(self, value):
        try:
            confine_directory(value, replica_roots(), what="replica_dir")
        except OutsideRoot as exc:
            raise serializers.ValidationError(str(exc)) from None
        return value


#: The default checkpoint directory of a job (``<root>/job-<id>``), reserved for that job.
_DEFAULT_DIR = re.compile(r"job-\d+")


def _job_sharing(directory: str) -> int | None:
    """A job whose checkpoint directory is ``directory``, holds it, or lies inside it; else None.

    A new job has no id yet, so every default directory (``<root>/job-<id>``) belongs to another one."""
    real = os.path.realpath(directory)
    first = Path(os.path.relpath(real, os.path.realpath(checkpoint_root()))).parts[0]
    if _DEFAULT_DIR.fullmatch(first):
        return int(first.removeprefix("job-"))
    for job in Job.objects.filter(checkpoint_policy__has_key="dir").only("pk", "checkpoint_policy"):
        theirs = os.path.realpath(CheckpointPolicy.of(job).dir)
        if os.path.commonpath([real, theirs]) in (real, theirs):
            return job.pk
    return None


STARTUP_TIMEOUT_RANGE = ("Must be between 10 and 86400 seconds (24 h), or null to derive it from the job's "
                         "earlier starts.")


class RecoveryPolicySerializer(StrictSerializer):
    max_restarts = serializers.IntegerField(min_value=0, max_value=1000, default=_RECOVERY.max_restarts,
                                            help_text="Automatic restarts allowed per window.")
    window_minutes = serializers.IntegerField(min_value=1, max_value=7 * 24 * 60, default=_RECOVERY.window_minutes)
    backoff_seconds = serializers.IntegerField(min_value=0, max_value=3600, default=_RECOVERY.backoff_seconds)
    allow_shrink = serializers.BooleanField(default=_RECOVERY.allow_shrink,
                                            help_text="Restart on fewer nodes when no spare is free.")
    # Below the derived rule's floor (8 s): an operator may trade a crash reported as a hang for speed.
    progress_timeout_s = serializers.IntegerField(min_value=PROGRESS_TIMEOUT_MIN_OVERRIDE_S, max_value=24 * 3600,
                                                  allow_null=True, default=_RECOVERY.progress_timeout_s,
                                                  help_text="No step within this long = hang. Null: derive from "
                                                            "the job's rhythm: 3 × the p99 of recent step times "
                                                            "(checkpoint saves included) + 1 s, at least 5 s.")
    startup_timeout_s = serializers.IntegerField(
        min_value=10, max_value=24 * 3600, allow_null=True, default=_RECOVERY.startup_timeout_s,
        error_messages={"min_value": STARTUP_TIMEOUT_RANGE, "max_value": STARTUP_TIMEOUT_RANGE,
                        "invalid": "A whole number of seconds is required. " + STARTUP_TIMEOUT_RANGE},
        help_text="A new generation that reports no first step within this long is hung (the restore is "
                  "included). Null: 3 × the job's slowest earlier start, at least NIGHTWATCH_STARTUP_TIMEOUT_FLOOR_S "
                  "(60), or NIGHTWATCH_STARTUP_TIMEOUT_S (180) before the job has one. Once the ranks report "
                  "that they restored (or started from scratch), progress_timeout_s applies.")
    loss_spike_limit = serializers.IntegerField(min_value=1, max_value=1000,
                                                default=_RECOVERY.loss_spike_limit,
                                                help_text="Consecutive loss-spike steps before pausing.")
    clean_run_minutes = serializers.IntegerField(
        min_value=1, max_value=7 * 24 * 60, default=_RECOVERY.clean_run_minutes,
        help_text="After an on-call approves a resume from a retry storm, the restart budget is halved for each "
                  "such storm in a row (max_restarts, then 1/2, 1/4, at least 1) until the job runs this many "
                  "minutes without an automatic restart.")
    max_steps = serializers.IntegerField(min_value=1, max_value=10**15, allow_null=True, default=_RECOVERY.max_steps,
                                         help_text="The job's configured end: step reports past it are refused "
                                                   "(422). Null: no end.")
    max_step_jump = serializers.IntegerField(min_value=1, max_value=10**12, default=_RECOVERY.max_step_jump,
                                             help_text="Step reports more than max(this, 10 × the reports in their "
                                                       "batch) past the job's last step are refused (422).")
    inprocess_restarts = serializers.IntegerField(
        min_value=0, max_value=MAX_INPROCESS_RESTARTS, default=_RECOVERY.inprocess_restarts,
        help_text="A rank that crashes (killed by a signal) on a healthy node is replaced in its generation up to "
                  "this many times per rank and generation, the other ranks keeping their interpreters; 0: off. "
                  "Needs agents with warm_workers and a script that calls agents.hooks.inprocess.")


class JobSpecSerializer(StrictSerializer, serializers.ModelSerializer):
    """What a launch request may contain. Policies are stored with their defaults filled in.

    The script rules are the agent's own (``agents.protocol.agent``), checked on both ends: the
    node refuses a launch whose script or module is not a file of its code directory.
    """

    name = _text(max_length=100)
    entrypoint = _text(max_length=MAX_SCRIPT, required=False,
                       help_text="Training script: a relative path to a .py file inside the nodes' code "
                                 "directory, such as examples/train.py. Give this or module.")
    module = _text(max_length=MAX_MODULE, required=False,
                   help_text="Or a module of the code directory, run as `python -m` (torchrun --module), "
                             "such as pkg.train.")
    args = serializers.ListField(child=_text(max_length=1000, allow_blank=True), max_length=200, default=list,
                                 help_text="Passed verbatim after the script: never split, trimmed or read "
                                           "by a shell.")
    nnodes = serializers.IntegerField(min_value=1, max_value=4096, default=1)
    nproc_per_node = serializers.IntegerField(min_value=1, max_value=64, default=1)
    rdzv_port = serializers.IntegerField(min_value=1024, max_value=65535, default=29400)
    nccl_profile = serializers.DictField(child=_text(max_length=256), default=dict)
    checkpoint_policy = CheckpointPolicySerializer(default=dict)
    recovery_policy = RecoveryPolicySerializer(default=dict)
    queue = serializers.BooleanField(
        default=False, write_only=True,
        help_text="Accept a spec the registered fleet cannot hold yet (more nodes than are registered, more GPUs "
                  "per node than any node has) and keep it pending until nodes that fit register. Without it such "
                  "a spec is refused with 422, naming the field.")

    class Meta:
        model = Job
        fields = ["name", "entrypoint", "module", "args", "nnodes", "nproc_per_node", "accelerator", "rdzv_port",
                  "nccl_profile", "checkpoint_policy", "recovery_policy", "queue"]

    def validate_name(self, value):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", value):
            raise serializers.ValidationError("Use letters, digits, '.', '_' and '-', starting with a letter or digit.")
        return value

    def validate_entrypoint(self, value):
        if problem := script_problem(value):
            raise serializers.ValidationError(problem[0].upper() + problem[1:] + ".")
        return value

    def validate_module(self, value):
        if problem := module_problem(value):
            raise serializers.ValidationError(problem[0].upper() + problem[1:] + ".")
        return value

    def validate_nccl_profile(self, value):
        # The agent applies the same rules before it launches: one definition, both ends.
        try:
            return validate_nccl_profile(value)
        except LaunchSpecError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def validate(self, attrs):
        if ("entrypoint" in attrs) == ("module" in attrs):
            raise serializers.ValidationError({"entrypoint": "Give exactly one of entrypoint (a .py file) and "
                                                             "module (run as python -m)."})
        return attrs

    def to_internal_value(self, data):
        values = super().to_internal_value(data)
        # Nested serializers with default=dict skip validation; run them so defaults are filled.
        for name, nested in (("checkpoint_policy", CheckpointPolicySerializer),
                             ("recovery_policy", RecoveryPolicySerializer)):
            serializer = nested(data=values.get(name) or {})
            if not serializer.is_valid():
                raise serializers.ValidationError({name: serializer.errors})
            values[name] = dict(serializer.validated_data)
        return values


class GenerationSerializer(serializers.ModelSerializer):
    nodes = serializers.SlugRelatedField(many=True, read_only=True, slug_field="hostname")

    class Meta:
        model = Generation
        fields = ["number", "state", "nodes", "world_size", "resumed_from", "started_at", "first_step",
                  "first_step_at", "ended_at", "exit_reason", "exit_codes"]


class JobSerializer(serializers.ModelSerializer):
    world_size = serializers.IntegerField(read_only=True)

    class Meta:
        model = Job
        fields = ["id", "name", "entrypoint", "module", "args", "nnodes", "nproc_per_node", "world_size", "accelerator",
                  "rdzv_port", "nccl_profile",
                  "checkpoint_policy", "recovery_policy", "state", "generation", "restart_count",
                  "state_changed_at", "pause_reason", "last_step", "last_step_at", "recommended_interval_steps",
                  "resize_to", "created_by", "created_at"]
        read_only_fields = fields


class EventSerializer(serializers.ModelSerializer):
    class Meta:
        model = Event
        fields = ["id", "created_at", "kind", "actor", "generation", "old_state", "new_state", "reason", "evidence"]
        read_only_fields = fields


class ReasonSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=2000, help_text="Why; recorded in the audit log.")


class ResizeSerializer(StrictSerializer):
    """A new world size: the same bounds as a launch (``JobSpecSerializer``)."""

    nnodes = serializers.IntegerField(min_value=1, max_value=4096, help_text="Nodes of the next generation.")
    nproc_per_node = serializers.IntegerField(min_value=1, max_value=64,
                                              help_text="Processes (ranks) per node of the next generation.")
    reason = serializers.CharField(max_length=2000, help_text="Why; recorded in the audit log.")

    def validate(self, attrs):
        job = self.context.get("job")
        if job is not None and (attrs["nnodes"], attrs["nproc_per_node"]) == (job.nnodes, job.nproc_per_node) \
                and not job.resize_to:
            raise serializers.ValidationError({"nnodes": [
                f"job {job.pk} already runs on {job.nnodes} node(s) × {job.nproc_per_node} process(es); "
                "give another nnodes or nproc_per_node"]})
        return attrs


class ApproveSerializer(ReasonSerializer):
    force = serializers.BooleanField(default=False, help_text="Resume even though some node of the old generation "
                                                              "has not confirmed its ranks stopped (it is dead).")


class RollbackSerializer(ApproveSerializer):
    checkpoint = serializers.IntegerField(min_value=1, help_text="Id of a verified checkpoint of this job.")
    skip_data = serializers.ListField(child=serializers.IntegerField(min_value=0), min_length=2, max_length=2,
                                      required=False, help_text="Global sample range [start, end) to skip.")

    def validate_skip_data(self, value):
        if value[0] >= value[1]:
            raise serializers.ValidationError("start must be below end")
        return value


class IncidentSerializer(serializers.ModelSerializer):
    generation = serializers.IntegerField(source="generation.number", read_only=True, allow_null=True)
    nodes = serializers.SlugRelatedField(many=True, read_only=True, slug_field="hostname")

    class Meta:
        model = Incident
        fields = ["id", "job", "generation", "kind", "classification", "state", "decision", "evidence", "nodes",
                  "fault_at", "detected_at", "quiesced_at", "relaunched_at", "first_step_at", "resolved_at",
                  "lost_steps"]
        read_only_fields = fields


class IncidentSummarySerializer(serializers.ModelSerializer):
    """An incident in a job's live status: what happened and what was decided, without evidence."""

    generation = serializers.IntegerField(source="generation.number", read_only=True, allow_null=True)

    class Meta:
        model = Incident
        fields = ["id", "generation", "kind", "classification", "state", "decision", "detected_at", "resolved_at"]
        read_only_fields = fields


class WaitingSerializer(serializers.Serializer):
    reason = serializers.CharField(help_text='e.g. "not enough healthy nodes: have 2, need 4096 (of 3 registered: '
                                             '1 drained or draining)"')
    have = serializers.IntegerField(help_text="Nodes placement could use now.")
    need = serializers.IntegerField()
    never_fits = serializers.DictField(child=serializers.CharField(),
                                       help_text="By field: why the fleet as registered can never hold the job.")
    fleet = serializers.DictField(help_text="registered, drained, lemons, unhealthy, busy, max_gpus")


class JobStatusSerializer(serializers.Serializer):
    """What a CI pipeline polls while it waits: state, step, generation, open incidents."""

    id = serializers.IntegerField()
    name = serializers.CharField()
    state = serializers.CharField()
    terminal = serializers.BooleanField(help_text="completed, failed or cancelled: nothing more will happen.")
    needs_human = serializers.BooleanField(help_text="Paused: waits for an operator to resume, approve or roll back.")
    pause_reason = serializers.CharField(allow_blank=True)
    generation = serializers.IntegerField()
    restart_count = serializers.IntegerField()
    last_step = serializers.IntegerField(allow_null=True)
    last_step_at = serializers.DateTimeField(allow_null=True)
    state_changed_at = serializers.DateTimeField()
    ettr = serializers.FloatField(help_text="Goodput so far: productive time / wall time.")
    open_incidents = serializers.IntegerField()
    recent_incidents = IncidentSummarySerializer(many=True, help_text="The five most recent, newest first.")
    waiting = WaitingSerializer(allow_null=True, help_text="A pending job: why it waits for nodes. Null otherwise.")


class GoodputSerializer(serializers.Serializer):
    ettr = serializers.FloatField(help_text="Productive training time / wall time.")
    wall_s = serializers.FloatField()
    productive_s = serializers.FloatField()
    badput_s = serializers.DictField(child=serializers.FloatField(),
                                     help_text="startup, detection, restart, paused, lost_work, checkpoint_stall")
