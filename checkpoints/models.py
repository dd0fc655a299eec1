"""Checkpoints and their lineage."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from checkpoints.choices import CheckpointState


class Checkpoint(models.Model):
    """A committed checkpoint of a job, as reported by the training hooks.

    ``parent`` is the previous checkpoint of the same branch (for a generation's first one, the
    checkpoint it resumed from), so the rows form a tree: a rollback starts a branch and history
    is never rewritten. A committed checkpoint's files are immutable; only its verification
    state and the permanent flag change.
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
    created_at = models.DateTimeField(default=timezone.now)
    verified_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "step", "pk"]
        constraints = [
            models.UniqueConstraint(fields=["job", "location"], name="checkpoint_job_location"),
        ]
        indexes = [models.Index(fields=["job", "state", "step"], name="checkpoint_job_state_step")]

    def __str__(self):
        return f"{self.job.name} step {self.step} ({self.state})"
