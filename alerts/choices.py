"""Status enums of the alerts app."""

from django.db import models


class ChannelKind(models.TextChoices):
    WEBHOOK = "webhook", "generic webhook (signed JSON)"
    EMAIL = "email", "email"
    PAGERDUTY = "pagerduty", "PagerDuty Events API v2"


class Severity(models.TextChoices):
    """``page`` wakes a human; ``info`` only notifies. Ordered: a channel takes its minimum and above."""

    INFO = "info"
    PAGE = "page"


Severity.RANK = {Severity.INFO: 0, Severity.PAGE: 1}


class AlertState(models.TextChoices):
    FIRING = "firing"
    RESOLVED = "resolved"


class Action(models.TextChoices):
    """What one delivery tells the receiver about its alert."""

    TRIGGER = "trigger"
    UPDATE = "update"
    ACKNOWLEDGE = "acknowledge"  # a human acted (approved a resume); the incident is not over yet
    RESOLVE = "resolve"
    TEST = "test"


class DeliveryState(models.TextChoices):
    PENDING = "pending"
    SENT = "sent"
    FAILED = "failed"
    SUPPRESSED = "suppressed", "suppressed by the rate limit"


DeliveryState.OPEN = frozenset({DeliveryState.PENDING})


class Rule(models.TextChoices):
    """Why an alert fired. The first group pages; the second only notifies."""

    BREAKER_OPEN = "breaker_open", "circuit breaker open"
    PAUSED = "paused", "job paused, awaiting a human"
    PARTITION = "partition", "suspected partition"
    LEMON = "lemon", "node blamed repeatedly"
    CHECKPOINT_CORRUPT = "checkpoint_corrupt", "checkpoint failed verification"
    RECOVERY = "recovery", "automatic recovery"
    DRAIN = "drain", "node drained"
    STRAGGLER = "straggler", "straggler"
    NOTICE = "notice", "noted, no action taken"  # e.g. a single loss spike
    OPERATOR_PAUSE = "operator_pause", "job paused by an operator"
    MFU_LOW = "mfu_low", "MFU below expectation"
    GPU_UTIL_LOW = "gpu_util_low", "GPU utilisation low"
    DOWNTIME_HIGH = "downtime_high", "downtime ratio high"
