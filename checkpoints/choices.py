from django.db import models


class CheckpointState(models.TextChoices):
    COMMITTED = "committed", "committed (not yet verified)"
    VERIFIED = "verified"
    CORRUPT = "corrupt"
    DELETED = "deleted"


CheckpointState.RESTORABLE = frozenset({CheckpointState.VERIFIED})
