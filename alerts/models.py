"""Alert channels, the alerts raised (one per incident or condition) and their deliveries. The
efficiency targets and pool prices the efficiency watch compares against are the jobs app's
(``jobs.models.EfficiencyTarget``, ``PoolPrice``)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils import timezone

from alerts import crypto
from alerts.choices import Action, AlertState, ChannelKind, DeliveryState, Rule, Severity


class Channel(models.Model):
    """Where alerts go: a signed webhook, email addresses, or a PagerDuty Events v2 endpoint.

    Routing: a channel takes alerts of ``min_severity`` and above, of the jobs it names (all jobs,
    and alerts about no job such as a node's, when it names none). ``secret`` is the webhook's
    signing key or PagerDuty's routing key, stored encrypted; the API accepts it but never shows it.
    """

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=12, choices=ChannelKind.choices)
    url = models.CharField(max_length=2000, blank=True, help_text="Webhook URL, or the PagerDuty events endpoint.")
    # Read and written through ``secret``: a Fernet token (alerts.crypto), never the clear value.
    encrypted_secret = models.TextField(blank=True, help_text="Webhook signing secret, or the PagerDuty routing "
                                                              "(integration) key, encrypted.")
    emails = models.JSONField(default=list, blank=True, help_text="Recipients of an email channel.")
    min_severity = models.CharField(max_length=8, choices=Severity.choices, default=Severity.PAGE)
    jobs = models.ManyToManyField("jobs.Job", blank=True, related_name="alert_channels",
                                  help_text="Only alerts of these jobs; none selected = every job.")
    enabled = models.BooleanField(default=True)
    created_by = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return f"{self.name} ({self.kind})"

    @property
    def secret(self) -> str:
        """The clear secret; raises ``crypto.SecretUnreadable`` when the key no longer opens it."""
        return crypto.decrypt(self.encrypted_secret)

    @secret.setter
    def secret(self, value: str) -> None:
        self.encrypted_secret = crypto.encrypt(value)

    @property
    def has_secret(self) -> bool:
        return bool(self.encrypted_secret)


class Alert(models.Model):
    """One alert per incident or condition, updated by follow-ups, resolved when it clears.

    ``key`` deduplicates: at most one firing alert per key (a partial unique constraint), so the
    same incident evaluated twice — by a signal and by the sweeper — updates one row. ``revision``
    names what the last notification said; a follow-up is sent only when it changes.
    """

    key = models.CharField(max_length=120)
    rule = models.CharField(max_length=24, choices=Rule.choices)
    severity = models.CharField(max_length=8, choices=Severity.choices)
    state = models.CharField(max_length=10, choices=AlertState.choices, default=AlertState.FIRING, db_index=True)
    title = models.CharField(max_length=300)
    summary = models.TextField(blank=True)
    evidence = models.JSONField(default=dict, blank=True)
    link = models.CharField(max_length=2000, blank=True)
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.CASCADE, related_name="alerts")
    incident = models.ForeignKey("jobs.Incident", null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="alerts")
    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.CASCADE, related_name="alerts")
    revision = models.CharField(max_length=200, blank=True)
    updates = models.PositiveIntegerField(default=0, help_text="Follow-ups recorded after the first notification.")
    suppressed_updates = models.PositiveIntegerField(default=0, help_text="Follow-ups held back by the rate limit.")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    updated_at = models.DateTimeField(default=timezone.now)
    notified_at = models.DateTimeField(null=True, blank=True, help_text="Last trigger or follow-up sent.")
    acknowledged_at = models.DateTimeField(null=True, blank=True, help_text="A human acted on it.")
    resolved_at = models.DateTimeField(null=True, blank=True)
    # The sweeper re-judges the firing alert checked longest ago first.
    checked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        constraints = [
            models.UniqueConstraint(fields=["key"], condition=Q(state="firing"), name="alert_one_firing_per_key"),
        ]
        indexes = [models.Index(fields=["job", "created_at"], name="alert_job_time")]

    def __str__(self):
        return f"[{self.severity}] {self.title} ({self.state})"


class Delivery(models.Model):
    """One message of an alert to one channel, and every attempt to get it there.

    PostgreSQL is the record; the Celery task is a hint. A pending delivery past
    ``next_attempt_at`` is re-dispatched by the sweeper, so a lost task never loses a page.
    """

    alert = models.ForeignKey(Alert, null=True, blank=True, on_delete=models.CASCADE, related_name="deliveries")
    channel = models.ForeignKey(Channel, on_delete=models.CASCADE, related_name="deliveries")
    action = models.CharField(max_length=12, choices=Action.choices)
    state = models.CharField(max_length=12, choices=DeliveryState.choices, default=DeliveryState.PENDING,
                             db_index=True)
    payload = models.JSONField(default=dict, blank=True, help_text="What was (or will be) sent.")
    attempts = models.PositiveSmallIntegerField(default=0)
    errors = models.JSONField(default=list, blank=True, help_text="One line per failed attempt.")
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True, db_index=True)
    created_at = models.DateTimeField(default=timezone.now)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "pk"]
        verbose_name_plural = "deliveries"

    def __str__(self):
        return f"{self.action} → {self.channel_id} ({self.state}, {self.attempts} attempt(s))"
