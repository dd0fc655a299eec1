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


class Schedulability(models.TextChoices):
    """Whether new generations may be placed on the node (the operator's and policy's say)."""

    ACTIVE = "active"
    DRAINING = "draining", "draining (finishing its current generation)"
    DRAINED = "drained"
