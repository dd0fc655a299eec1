"""The audit log: one append-only table that every app writes through ``core.events.record_event``."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone


class AppendOnlyQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise ValidationError("Events are append-only.")

    def delete(self):
        raise ValidationError("Events are append-only.")


class Event(models.Model):
    """Append-only record of every state change and operator action: who, what, why, evidence.

    Timelines, alerts, goodput and the audit trail all read from these rows.
    """

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    kind = models.CharField(max_length=48, db_index=True, help_text="e.g. job.state, node.drain, job.launch")
    actor = models.CharField(max_length=200, help_text="user:…, token:…, node:… or system:…")
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.CASCADE, related_name="events")
    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.CASCADE, related_name="events")
    generation = models.PositiveIntegerField(null=True, blank=True)
    old_state = models.CharField(max_length=24, blank=True)
    new_state = models.CharField(max_length=24, blank=True)
    reason = models.TextField(blank=True)
    evidence = models.JSONField(default=dict, blank=True)

    objects = AppendOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["created_at", "pk"]
        db_table = "jobs_event"  # the table the jobs app created: the model moved, its rows did not
        indexes = [models.Index(fields=["job", "created_at"], name="event_job_time")]

    def __str__(self):
        return f"{self.created_at:%H:%M:%S} {self.kind} {self.old_state}→{self.new_state} by {self.actor}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValidationError("Events are append-only.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ValidationError("Events are append-only.")
