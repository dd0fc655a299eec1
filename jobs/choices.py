"""Status enums of the jobs app. Groups name the states code reasons about."""

from django.db import models


class JobState(models.TextChoices):
    PENDING = "pending"
    INITIALIZING = "initializing"
    RUNNING = "running"
    QUIESCING = "quiescing"
    RECOVERING = "recovering"
    PAUSED = "paused"
    FAILED = "failed"
    COMPLETED = "completed"
    CANCELLED = "cancelled"


JobState.TERMINAL = frozenset({JobState.FAILED, JobState.COMPLETED, JobState.CANCELLED})
#: a generation's processes may be alive on nodes in these states
JobState.ACTIVE = frozenset({JobState.INITIALIZING, JobState.RUNNING, JobState.QUIESCING})


class GenerationState(models.TextChoices):
    """Whether a generation has stepped yet; its end is ``Generation.ended_at``, not a state."""

    STARTING = "starting"
    RUNNING = "running"


class IncidentKind(models.TextChoices):
    CRASH = "crash", "rank or node exited"
    HANG = "hang", "no step progress"
    HARDWARE = "hardware", "node health bad"
    DETERMINISTIC = "deterministic", "same failure repeats"
    NUMERICAL = "numerical", "NaN or loss spikes"
    CORRUPTION = "corruption", "silent corruption across ranks"
    PARTITION = "partition", "partition or infrastructure"
    STRAGGLER = "straggler", "slow rank"
    RETRY_STORM = "retry_storm", "restart budget exhausted"
    CHECKPOINT = "checkpoint", "checkpoint failed verification"


class IncidentState(models.TextChoices):
    OPEN = "open"
    RESOLVED = "resolved"


class Decision(models.TextChoices):
    RESTART = "restart", "restart from the latest verified checkpoint"
    RESTART_ON_SPARE = "restart_on_spare", "drain the node and restart on a spare"
    RESTART_IN_PROCESS = "restart_in_process", "the node replaced the rank in process"
    SHRINK = "shrink", "restart on fewer nodes"
    PAUSE = "pause", "pause and ask a human"
    ESCALATE = "escalate", "pause and escalate"
    ALERT = "alert", "alert only"
