"""Checkpoints and their lineage."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils import timezone

from checkpoints.choices import CheckpointState, ReplicaState


class CheckpointQuerySet(models.QuerySet):
    def live(self):
        """Not deleted: the files are (supposed to be) on disk."""
        return self.exclude(state=CheckpointState.DELETED)

    def restorable(self):
        """A verified copy exists: the primary, or the replica when the primary went bad."""
        return self.filter(
            Q(state=CheckpointState.VERIFIED)
            | Q(state__in=CheckpointState.LIVE, replica_state=ReplicaState.VERIFIED)
        )


class Checkpoint(models.Model):
    """A committed checkpoint of a job, as reported by the training hooks.

    ``parent`` is the previous checkpoint of the same branch (for a generation's first one, the
    checkpoint it resumed from), so the rows form a tree: a rollback starts a branch and history
    is never rewritten. A committed checkpoint's files are immutable; only its verification
    state, the permanent flag and its replica change. Deleted checkpoints keep their row (the
    lineage stays whole); only the files go.
    """

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="checkpoints")
    generation = models.ForeignKey("jobs.Generation", null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="checkpoints")
    step = models.BigIntegerField()
    location = models.CharField(max_length=1000, help_text="Directory of the checkpoint.")
    manifest = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=12, choices=CheckpointState.choices, default=CheckpointState.COMMITTED,
                             db_index=True)
    state_reason = models.TextField(blank=True)
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT, related_name="children")
    permanent = models.BooleanField(default=False)
    config_hash = models.CharField(max_length=64, blank=True)
    data_cursor = models.BigIntegerField(null=True, blank=True, help_text="Global sample cursor.")
    loss = models.FloatField(null=True, blank=True)
    size_bytes = models.BigIntegerField(default=0)
    world_size = models.PositiveIntegerField(null=True, blank=True)
    # The measured save cost, as the hooks reported it: the interval policy's input.
    blocking_s = models.FloatField(null=True, blank=True, help_text="Seconds training was stalled by the save.")
    total_s = models.FloatField(null=True, blank=True, help_text="Seconds from the start of the save to the commit.")
    created_at = models.DateTimeField(default=timezone.now)
    verified_at = models.DateTimeField(null=True, blank=True)
    # --- the second copy (see checkpoints.services.replicas) --------------------------------
    replica_location = models.CharField(max_length=1000, blank=True)
    replica_state = models.CharField(max_length=12, choices=ReplicaState.choices, blank=True,
                                     default=ReplicaState.NONE)
    replica_reason = models.TextField(blank=True)
    # When the replica was last copied or checked; a copy "in progress" for too long was abandoned.
    replica_checked_at = models.DateTimeField(null=True, blank=True)

    objects = CheckpointQuerySet.as_manager()

    class Meta:
        ordering = ["job", "step", "pk"]
        constraints = [
            models.UniqueConstraint(fields=["job", "location"], name="checkpoint_job_location"),
        ]
        indexes = [models.Index(fields=["job", "state", "step"], name="checkpoint_job_state_step")]

    def __str__(self):
        return f"{self.job.name} step {self.step} ({self.state})"

    def save(self, *args, **kwargs):
        # restore_point() hands out an instance whose ``location`` points at the replica when the
        # primary copy is bad; saving that instance would rewrite the registry's primary path.
        if getattr(self, "served_from_replica", False):
            raise ValueError("this instance carries its replica's location for a restore; re-fetch it to save")
        super().save(*args, **kwargs)

    @property
    def restorable(self) -> bool:
        return self.state == CheckpointState.VERIFIED or (
            self.state in CheckpointState.LIVE and self.replica_state == ReplicaState.VERIFIED
        )
