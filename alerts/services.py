"""Verbs of the alerts app: turn a spec into an alert (or a follow-up, or a resolution), route it
to channels, and deliver with retries. Evaluation entry points for the signals and the sweeper.

    jobs.Event / jobs.Incident saved ─on commit─▶ tasks.evaluate_* ─▶ rules ─▶ apply(spec)
        apply: new → trigger · changed while firing → follow-up (rate-limited) · cleared → resolve
               └─▶ one Delivery row per routed channel ─on commit─▶ tasks.deliver (retried, backoff)
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from alerts import channels, crypto, messages, rules
from alerts.choices import Action, AlertState, DeliveryState, Rule, Severity
from alerts.models import Alert, Channel, Delivery
from alerts.rules import AlertSpec
from checkpoints.choices import CheckpointState
from checkpoints.models import Checkpoint
from core.events import EventKind, record_event
from core.models import Event
from core.text import clip
from jobs.choices import JobState
from jobs.models import Incident

log = logging.getLogger(__name__)


def config() -> dict:
    return settings.NIGHTWATCH["ALERTS"]


# --- alerts from specs --------------------------------------------------------------------------

def apply(spec: AlertSpec, *, now=None) -> Alert | None:
    """Make the stored alert match ``spec``; returns the alert touched, or None.

    - no firing alert under the key and the spec fires: a new alert, a ``trigger`` to each
      routed channel (a notify-only spec is stored resolved: one notification, nothing to resolve);
    - a firing alert and the spec still fires with another ``revision``: a follow-up, sent at most
      once per ``UPDATE_INTERVAL_S`` (held-back follow-ups are counted and reported with the next);
    - a firing alert and the spec no longer fires: resolved, and a ``resolve`` to the channels
      that were told about it.
    """
    now = now or timezone.now()
    try:
        with transaction.atomic():
            return _apply(spec, now)
    except IntegrityError:
        # Two evaluations raced to create the same alert: the other one won; apply it as an update.
        with transaction.atomic():
            return _apply(spec, now)


def _lock_key(key: str) -> None:
    """Serialise evaluations of one key for the rest of the transaction. Row locks cannot: the
    row may not exist yet, and resolved alerts (a notification) have no unique constraint to fall
    back on. SQLite serialises writers anyway."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"nightwatch.alerts:{key}"])


def _apply(spec: AlertSpec, now) -> Alert | None:
    _lock_key(spec.key)
    existing = Alert.objects.select_for_update().filter(key=spec.key)
    if spec.notify_only:
        if existing.exists():
            return None
        alert = _create(spec, now, state=AlertState.RESOLVED)
        _fan_out(alert, Action.TRIGGER, now)
        return alert
    alert = existing.filter(state=AlertState.FIRING).first()
    if alert is None:
        if not spec.firing:
            if spec.announce_if_missed and not existing.exists():
                # Every incident is told once, even one that was over before we looked at it.
                alert = _create(spec, now, state=AlertState.RESOLVED)
                _fan_out(alert, Action.TRIGGER, now)
                return alert
            return None
        alert = _create(spec, now, state=AlertState.FIRING)
        _fan_out(alert, Action.TRIGGER, now)
        return alert
    if not spec.firing:
        _refresh(alert, spec, now)
        alert.state, alert.resolved_at = AlertState.RESOLVED, now
        alert.save()
        _fan_out(alert, Action.RESOLVE, now)
        return alert
    if spec.acknowledged and alert.acknowledged_at is None:
        _refresh(alert, spec, now)
        alert.acknowledged_at = now
        alert.save()
        _fan_out(alert, Action.ACKNOWLEDGE, now)
        return alert
    upgraded = Severity.RANK[spec.severity] > Severity.RANK[alert.severity]
    if spec.revision == alert.revision and not upgraded:
        return None
    _refresh(alert, spec, now)
    alert.updates += 1
    interval = timedelta(seconds=config()["UPDATE_INTERVAL_S"])
    if not upgraded and alert.notified_at and now - alert.notified_at < interval:
        alert.suppressed_updates += 1
        alert.save()
        return alert
    alert.save()
    _fan_out(alert, Action.UPDATE, now)
    alert.suppressed_updates = 0
    alert.save(update_fields=["suppressed_updates"])
    return alert


#: Bounded columns: a title names a node (up to 253 characters) and an actor (up to 200).
_TITLE_LEN = Alert._meta.get_field("title").max_length
_REVISION_LEN = Alert._meta.get_field("revision").max_length


def _create(spec: AlertSpec, now, *, state: str) -> Alert:
    return Alert.objects.create(
        key=spec.key, rule=spec.rule, severity=spec.severity, state=state, title=clip(spec.title, _TITLE_LEN),
        summary=spec.summary, evidence=spec.evidence, link=spec.link, job_id=spec.job_id,
        incident_id=spec.incident_id, node_id=spec.node_id, revision=clip(spec.revision, _REVISION_LEN), created_at=now,
        updated_at=now, resolved_at=now if state == AlertState.RESOLVED else None,
    )


def _refresh(alert: Alert, spec: AlertSpec, now) -> None:
    alert.title = clip(spec.title, _TITLE_LEN) or alert.title
    alert.summary, alert.evidence = spec.summary, spec.evidence
    alert.revision, alert.updated_at = clip(spec.revision, _REVISION_LEN), now
    if Severity.RANK[spec.severity] > Severity.RANK[alert.severity]:
        alert.severity = spec.severity


# --- routing and rate limits ----------------------------------------------------------------------

def routed_channels(alert: Alert):
    """Enabled channels that take this severity and this job (or every job)."""
    severities = [s for s, rank in Severity.RANK.items() if rank <= Severity.RANK[alert.severity]]
    chosen = Channel.objects.filter(enabled=True, min_severity__in=severities)
    if alert.job_id is None:
        chosen = chosen.filter(jobs__isnull=True)
    else:
        chosen = chosen.filter(Q(jobs__isnull=True) | Q(jobs=alert.job_id))
    return chosen.distinct()


def _fan_out(alert: Alert, action: str, now) -> list[Delivery]:
    """One delivery per routed channel. A channel that never heard of the alert gets a trigger
    (also when an alert it was not routed before now reaches it); an acknowledgement or a resolve
    goes only where the alert was announced."""
    told = set(Delivery.objects.filter(alert=alert, action__in=[Action.TRIGGER, Action.UPDATE])
               .exclude(state=DeliveryState.SUPPRESSED).values_list("channel_id", flat=True))
    created = []
    for channel in routed_channels(alert):
        if action in (Action.RESOLVE, Action.ACKNOWLEDGE):
            if channel.pk not in told:
                continue
            this_action = action
        else:
            this_action = Action.UPDATE if channel.pk in told else Action.TRIGGER
        state = DeliveryState.PENDING
        if _over_channel_budget(channel, alert, now):
            state = DeliveryState.SUPPRESSED
        delivery = Delivery.objects.create(alert=alert, channel=channel, action=this_action, state=state,
                                           payload=messages.message(alert, this_action, now=now), created_at=now,
                                           next_attempt_at=now if state == DeliveryState.PENDING else None)
        created.append(delivery)
    if action in (Action.TRIGGER, Action.UPDATE):
        alert.notified_at = now
        alert.save(update_fields=["notified_at"])
    pending = [d.pk for d in created if d.state == DeliveryState.PENDING]
    if pending:
        transaction.on_commit(lambda: _deliver_later(pending), robust=True)
    return created


def _over_channel_budget(channel: Channel, alert: Alert, now) -> bool:
    """Pages always go out; notifications stop at ``CHANNEL_MAX_PER_HOUR`` per channel (an alert
    storm must not bury the page that matters). The suppressed ones stay in the alert log."""
    if alert.severity == Severity.PAGE:
        return False
    sent = Delivery.objects.filter(channel=channel, created_at__gte=now - timedelta(hours=1)).exclude(
        state=DeliveryState.SUPPRESSED).exclude(action=Action.TEST).count()
    return sent >= config()["CHANNEL_MAX_PER_HOUR"]


def _deliver_later(delivery_ids: list[int]) -> None:
    # alerts.tasks wraps this module's verbs (imports it at the top): the task is looked up when enqueued.
    from alerts.tasks import deliver

    for pk in delivery_ids:
        deliver.delay(pk, 0)


# --- delivery -------------------------------------------------------------------------------------

def backoff_s(attempts: int) -> float:
    """Seconds before the next attempt after ``attempts`` failed ones: exponential, capped."""
    return min(config()["RETRY_BASE_S"] * 2 ** max(0, attempts - 1), config()["RETRY_MAX_S"])


#: While an attempt is in flight, the sweeper leaves the delivery alone this long.
IN_FLIGHT_LEASE_S = 120


def attempt_delivery(delivery_id: int, attempt: int) -> float | None:
    """Make attempt number ``attempt + 1`` of a pending delivery; returns the seconds to wait
    before retrying, or None when done (sent, given up, or not ours to attempt).

    The attempt counter is the compare-and-set: of a Celery retry and a sweeper re-dispatch
    carrying the same number, only one sends.
    """
    now = timezone.now()
    claimed = Delivery.objects.filter(pk=delivery_id, state=DeliveryState.PENDING, attempts=attempt).update(
        attempts=attempt + 1, next_attempt_at=now + timedelta(seconds=IN_FLIGHT_LEASE_S))
    if not claimed:
        return None
    delivery = Delivery.objects.select_related("channel").get(pk=delivery_id)
    outcome = channels.send(delivery.channel, delivery.payload)
    done_at = timezone.now()
    if outcome.ok:
        Delivery.objects.filter(pk=delivery_id).update(state=DeliveryState.SENT, sent_at=done_at,
                                                       status_code=outcome.status_code, next_attempt_at=None)
        return None
    errors = [*delivery.errors, f"{done_at.isoformat()} attempt {attempt + 1}: {outcome.error}"[:1000]][-20:]
    # A test-send is one attempt: the operator who asked for it reads that attempt's outcome.
    give_up = outcome.permanent or attempt + 1 >= config()["MAX_ATTEMPTS"] or delivery.action == Action.TEST
    wait = backoff_s(attempt + 1)
    Delivery.objects.filter(pk=delivery_id).update(
        state=DeliveryState.FAILED if give_up else DeliveryState.PENDING, errors=errors,
        status_code=outcome.status_code, next_attempt_at=None if give_up else done_at + timedelta(seconds=wait))
    log.warning("alert delivery %s to channel %s failed (attempt %d%s): %s", delivery_id,
                delivery.channel.name, attempt + 1, ", giving up" if give_up else "", outcome.error)
    return None if give_up else wait


def redispatch_one_delivery() -> bool:
    """A pending delivery whose retry is overdue (its task was lost) is dispatched again."""
    overdue = timezone.now() - timedelta(seconds=config()["REDISPATCH_GRACE_S"])
    delivery = Delivery.objects.filter(state=DeliveryState.PENDING, next_attempt_at__lt=overdue) \
        .order_by("next_attempt_at").first()
    if delivery is None:
        return False
    # Push it forward first, so the next sweep does not dispatch it again while this one runs.
    Delivery.objects.filter(pk=delivery.pk, attempts=delivery.attempts).update(
        next_attempt_at=timezone.now() + timedelta(seconds=IN_FLIGHT_LEASE_S))
    # alerts.tasks wraps this module's verbs (imports it at the top): the task is looked up when enqueued.
    from alerts.tasks import deliver

    deliver.delay(delivery.pk, delivery.attempts)
    return True


#: Test-sends kept per channel (the channel's API representation shows them).
TEST_SENDS_KEPT = 10


def test_send(channel: Channel, *, actor: str) -> Delivery:
    """Queue a test message to ``channel`` (one attempt, by ``tasks.deliver``) and audit it. The
    caller gets the delivery record; its outcome — sent with a status code, or failed with the
    error's class — is read later from the channel, never the receiver's answer."""
    now = timezone.now()
    with transaction.atomic():
        stale = Delivery.objects.filter(channel=channel, action=Action.TEST).order_by("-created_at", "-pk") \
            .values_list("pk", flat=True)[TEST_SENDS_KEPT - 1:]
        Delivery.objects.filter(pk__in=list(stale)).delete()
        delivery = Delivery.objects.create(channel=channel, action=Action.TEST, created_at=now, next_attempt_at=now,
                                           payload=messages.test_message(channel, now=now, actor=actor))
        record_event(EventKind.ALERT_CHANNEL_TEST, actor=actor, reason=f"test-send to {channel.name}",
                     new_state=delivery.state, evidence={"channel": channel.pk, "delivery": delivery.pk})
        transaction.on_commit(lambda: _deliver_later([delivery.pk]), robust=True)
    return delivery


def reencrypt_secrets() -> tuple[int, list[str]]:
    """Rewrite every channel secret under the first key of NIGHTWATCH_SECRETS_KEY (after a key was
    set or rotated); returns how many were rewritten and the names of those no key opens."""
    rewritten, unreadable = 0, []
    for channel in Channel.objects.exclude(encrypted_secret="").order_by("pk"):
        try:
            token = crypto.reencrypted(channel.encrypted_secret)
        except crypto.SecretUnreadable:
            unreadable.append(channel.name)
            continue
        rewritten += Channel.objects.filter(pk=channel.pk, encrypted_secret=channel.encrypted_secret) \
            .update(encrypted_secret=token)
    return rewritten, unreadable


# --- evaluation entry points ----------------------------------------------------------------------

def evaluate_incident(incident_id: int) -> Alert | None:
    incident = Incident.objects.select_related("job").filter(pk=incident_id).first()
    if incident is None:
        return None
    return apply(rules.for_incident(incident))


def evaluate_event(event_id: int) -> list[Alert]:
    """React to one event of the append-only log: new conditions, and conditions that cleared."""
    event = Event.objects.select_related("job", "node").filter(pk=event_id).first()
    if event is None:
        return []
    touched = []
    if event.kind == EventKind.JOB_STATE and event.job is not None:
        job = event.job
        if event.new_state == JobState.PAUSED and job.state == JobState.PAUSED:
            incident = rules.open_incident(job)
            spec = rules.for_incident(incident) if incident else rules.operator_pause(job, event)
            touched.append(apply(spec))
        touched += recheck_all(Alert.objects.filter(job=job, state=AlertState.FIRING))
    elif event.kind == EventKind.NODE_DRAIN and event.node is not None:
        touched.append(apply(rules.drain(event.node, event)))
    elif event.kind == EventKind.NODE_BLAME and event.node is not None:
        touched.append(apply(rules.lemon(event.node)))
    elif event.kind in (EventKind.NODE_UNDRAIN, EventKind.NODE_LEMON_CLEARED) and event.node is not None:
        touched += recheck_all(Alert.objects.filter(node=event.node, state=AlertState.FIRING))
    elif event.kind == EventKind.INCIDENT_RESOLVED and (event.evidence or {}).get("incident"):
        touched.append(evaluate_incident(event.evidence["incident"]))
    elif event.kind == EventKind.CHECKPOINT_VERIFY and event.job is not None:
        checkpoint = Checkpoint.objects.select_related("job").filter(pk=(event.evidence or {}).get("checkpoint")) \
            .first()
        if checkpoint is not None and event.new_state == CheckpointState.CORRUPT:
            touched.append(apply(rules.corrupt_checkpoint(checkpoint)))
        touched += recheck_all(Alert.objects.filter(job=event.job, rule=Rule.CHECKPOINT_CORRUPT,
                                                    state=AlertState.FIRING))
    return [a for a in touched if a is not None]


def current_spec(alert: Alert) -> AlertSpec | None:
    """The spec of ``alert``'s condition as it stands now (None: cannot be judged; leave it)."""
    if alert.incident_id is not None:
        return rules.for_incident(alert.incident)
    if alert.rule in rules.INCIDENT_RULES:  # the incident was deleted: nothing left to page about
        return AlertSpec(key=alert.key, rule=alert.rule, severity=alert.severity, firing=False)
    if alert.rule == Rule.OPERATOR_PAUSE:
        firing = alert.job is not None and alert.job.state == JobState.PAUSED
        return AlertSpec(key=alert.key, rule=alert.rule, severity=alert.severity, firing=firing,
                         title=alert.title, summary=alert.summary, evidence=alert.evidence, revision=alert.revision)
    if alert.rule == Rule.LEMON and alert.node is not None:
        return rules.lemon(alert.node)
    if alert.rule == Rule.CHECKPOINT_CORRUPT:
        checkpoint = Checkpoint.objects.select_related("job").filter(
            pk=(alert.evidence.get("checkpoint") or {}).get("id")).first()
        if checkpoint is None:
            return AlertSpec(key=alert.key, rule=alert.rule, severity=alert.severity, firing=False)
        return rules.corrupt_checkpoint(checkpoint)
    if alert.rule in rules.EFFICIENCY_RULES and alert.job is not None:
        return next((s for s in rules.efficiency_alerts(alert.job) if s.key == alert.key), None)
    return None


def recheck_all(alerts) -> list[Alert]:
    touched = []
    for alert in alerts.select_related("job", "node", "incident__job")[:200]:
        spec = current_spec(alert)
        if spec is not None:
            touched.append(apply(spec))
    return [a for a in touched if a is not None]


def reconcile_alerts(limit: int = 200) -> int:
    """Re-judge the firing alerts checked longest ago: conditions that cleared without an event
    we saw (an incident resolved by a bulk update, a lost task) resolve here. Returns how many
    alerts changed."""
    alerts = list(Alert.objects.filter(state=AlertState.FIRING).order_by("checked_at", "pk")
                  .select_related("job", "node", "incident__job")[:limit])
    changed = 0
    for alert in alerts:
        spec = current_spec(alert)
        if spec is not None and apply(spec) is not None:
            changed += 1
    Alert.objects.filter(pk__in=[a.pk for a in alerts]).update(checked_at=timezone.now())
    return changed


def raise_missed_incidents(limit: int = 100) -> int:
    """Open incidents that have no alert yet (their task was lost): evaluate them now."""
    missed = list(Incident.objects.filter(state="open", alerts__isnull=True).values_list("pk", flat=True)[:limit])
    return sum(1 for pk in missed if evaluate_incident(pk) is not None)
