"""The bottom layer's tables: the audit log (one append-only table every app writes through
``core.events.record_event``), the credentials of people, pipelines and machines, and the API's
idempotency ledger."""

from __future__ import annotations

import hashlib
import secrets

from django.conf import settings
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


TOKEN_PREFIX = "nw_"  # noqa: S105 - a public prefix, not a secret


class Scope(models.TextChoices):
    VIEWER = "viewer", "viewer (read only)"
    CI = "ci", "CI pipeline (launch and read jobs)"
    OPERATOR = "operator", "operator"
    ONCALL = "oncall", "on-call"
    AGENT = "agent", "node agent"
    BOOTSTRAP = "bootstrap", "one-time agent bootstrap"
    JOB = "job", "one generation of one job (training hooks)"


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiTokenQuerySet(models.QuerySet):
    def usable(self):
        now = timezone.now()
        return self.filter(revoked_at__isnull=True).filter(
            models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now)
        )


class ApiToken(models.Model):
    """A bearer token with one scope. Only its SHA-256 is stored; the raw value is shown once.

    Tokens of people and pipelines belong to a user and never grant more than that user's role;
    agent tokens belong to a node and act only for it; a bootstrap token registers one agent
    (``hostname``: only that host; ``node``: re-registers that existing node); a job token belongs to one
    generation of one job (``node``: the node it was delivered to, if any) and acts only for its hooks.
    """

    name = models.CharField(max_length=100)
    scope = models.CharField(max_length=16, choices=Scope.choices)
    digest = models.CharField(max_length=64, unique=True)
    # The first characters, so an operator can tell tokens apart in listings and logs.
    prefix = models.CharField(max_length=12)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="api_tokens"
    )
    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.CASCADE, related_name="tokens")
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.CASCADE, related_name="tokens")
    generation = models.PositiveIntegerField(null=True, blank=True)
    hostname = models.CharField(max_length=253, blank=True)
    single_use = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # A bootstrap token, once used: the node it registered and the SHA-256 of the agent's attempt
    # id, so that a retry whose answer was lost gets the same node back (nodes.services.fleet).
    registered = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    attempt_digest = models.CharField(max_length=64, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        db_table = "controlplane_apitoken"  # the table the controlplane app created: the model moved, its rows did not
        constraints = [
            models.CheckConstraint(
                name="agent_token_has_node",
                condition=~models.Q(scope="agent") | models.Q(node__isnull=False),
            ),
            models.CheckConstraint(
                name="job_token_has_job_and_generation",
                condition=~models.Q(scope="job") | models.Q(job__isnull=False, generation__isnull=False),
            ),
            # Only a job token is bound to a job: no other scope may borrow the binding.
            models.CheckConstraint(
                name="only_job_token_has_job",
                condition=models.Q(scope="job") | models.Q(job__isnull=True, generation__isnull=True),
            ),
        ]
        indexes = [models.Index(fields=["job", "generation"], name="apitoken_job_generation")]

    def __str__(self):
        return f"{self.name} ({self.scope}, {self.prefix}…)"

    @classmethod
    def issue(
        cls,
        *,
        name: str,
        scope: str,
        user=None,
        node=None,
        job=None,
        generation=None,
        hostname="",
        single_use=False,
        expires_at=None,
    ):
        """Create a token; returns ``(token, raw)``. The raw value is never stored."""
        raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token = cls.objects.create(
            name=name,
            scope=scope,
            digest=hash_token(raw),
            prefix=raw[:10],
            user=user,
            node=node,
            job=job,
            generation=generation,
            hostname=hostname,
            single_use=single_use,
            expires_at=expires_at,
        )
        return token, raw

    def revoke(self):
        self.revoked_at = timezone.now()
        self.save(update_fields=["revoked_at"])

    def successor(self) -> tuple[ApiToken, str]:
        """Issue this token's replacement: every binding and the expiry kept, only the secret new.

        The caller revokes ``self`` in the same transaction (a rotation).
        """
        return ApiToken.issue(name=self.name, scope=self.scope, user=self.user, node=self.node, job=self.job,
                              generation=self.generation, hostname=self.hostname, single_use=self.single_use,
                              expires_at=self.expires_at)


class IdempotencyRecord(models.Model):
    """The first response to a request carrying an ``Idempotency-Key``, replayed on retries.

    Keys are per credential: two pipelines may reuse the same key without colliding.
    """

    owner = models.CharField(max_length=80)
    key = models.CharField(max_length=200)
    request_digest = models.CharField(max_length=64)
    status_code = models.PositiveSmallIntegerField()
    response = models.JSONField()
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        db_table = "controlplane_idempotencyrecord"
        constraints = [models.UniqueConstraint(fields=["owner", "key"], name="idempotency_owner_key")]

    def __str__(self):
        return f"{self.owner} {self.key}"


class OutboxMessage(models.Model):
    """A Celery message that could not be published (the broker was down), kept until it can be.

    Written by ``controlplane.celery.OutboxTask`` when a publish fails, read and deleted by
    ``core.outbox.resend`` (beat) once the broker answers: a request whose follow-up work could not
    be queued still succeeds, and the work still happens. Tasks take primary keys and are safe to
    run twice, so a message sent twice (a resend whose delete did not commit) is harmless.
    """

    task = models.CharField(max_length=200)
    args = models.JSONField(default=list)
    kwargs = models.JSONField(default=dict)
    #: Publish options worth keeping (queue, countdown, priority); never an expiry (those are hints).
    options = models.JSONField(default=dict)
    error = models.CharField(max_length=500, blank=True, help_text="Why the first publish failed.")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["pk"]

    def __str__(self):
        return f"{self.task} held since {self.created_at:%Y-%m-%d %H:%M:%S}"
