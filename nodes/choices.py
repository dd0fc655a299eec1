"""Status enums of the nodes app. Groups name the states code reasons about."""

from django.db import models


class Transport(models.TextChoices):
    AGENT = "agent", "node agent"
    SSH = "ssh", "SSH (agentless)"
    SLURM = "slurm", "Slurm"


class Health(models.TextChoices):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"
    UNREACHABLE = "unreachable"


Health.USABLE = frozenset({Health.HEALTHY, Health.DEGRADED})
#: A heartbeat (or a registration) decides again from these; telemetry alone cannot revive an
#: unreachable node, because the heartbeat deadline is what defines reachability.
Health.AWAITING = frozenset({Health.UNKNOWN, Health.UNREACHABLE})


class Schedulability(models.TextChoices):
    """Whether new generations may be placed on the node (the operator's and policy's say)."""

    ACTIVE = "active"
    DRAINING = "draining", "draining (finishing its current generation)"
    DRAINED = "drained"


Schedulability.OUT = frozenset({Schedulability.DRAINING, Schedulability.DRAINED})


class CommandKind(models.TextChoices):
    """What the agent is asked to do (``agents.protocol.agent.COMMAND_KINDS``)."""

    LAUNCH = "launch"
    STOP = "stop"
    DRAIN = "drain"
    HEALTH_CHECK = "health_check", "health check"


#: Commands that act on one generation of a job: refused (409) once the job has moved on.
CommandKind.FENCED = frozenset({CommandKind.LAUNCH, CommandKind.STOP})


class CommandState(models.TextChoices):
    PENDING = "pending", "pending (not yet delivered)"
    DELIVERED = "delivered", "delivered (awaiting the acknowledgement)"
    ACKED = "acked", "done"
    REFUSED = "refused"
    FAILED = "failed"
    EXPIRED = "expired", "expired (never acknowledged, or its generation went stale)"


#: Re-sent in every heartbeat answer until acknowledged.
CommandState.OPEN = frozenset({CommandState.PENDING, CommandState.DELIVERED})
CommandState.FINAL = frozenset({CommandState.ACKED, CommandState.REFUSED, CommandState.FAILED, CommandState.EXPIRED})
#: The agent's ``CommandAck.status`` -> the state it leaves the command in.
CommandState.FROM_ACK = {"done": CommandState.ACKED, "refused": CommandState.REFUSED, "failed": CommandState.FAILED}


class SlurmAllocationState(models.TextChoices):
    SUBMITTING = "submitting", "to be submitted (sbatch not yet accepted)"
    QUEUED = "queued", "submitted (pending or running in Slurm)"
    ENDED = "ended", "ended (its exit was reported)"


SlurmAllocationState.OPEN = frozenset({SlurmAllocationState.SUBMITTING, SlurmAllocationState.QUEUED})
