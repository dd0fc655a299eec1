from django.db import models


class CheckpointState(models.TextChoices):
    """The state of a checkpoint's primary copy (the directory the hooks wrote)."""

    COMMITTED = "committed", "committed (not yet verified)"
    VERIFIED = "verified"
    CORRUPT = "corrupt"
    DELETED = "deleted"


CheckpointState.RESTORABLE = frozenset({CheckpointState.VERIFIED})
#: states whose files are still on disk and that retention and operators may act on
CheckpointState.LIVE = frozenset({CheckpointState.COMMITTED, CheckpointState.VERIFIED, CheckpointState.CORRUPT})


class ReplicaState(models.TextChoices):
    """The state of a checkpoint's second copy; blank while no replica location is configured."""

    NONE = "", "no replica"
    COPYING = "copying"
    VERIFIED = "verified"
    CORRUPT = "corrupt"
    DELETED = "deleted"
