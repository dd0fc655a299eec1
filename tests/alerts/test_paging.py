"""Paging end to end on PostgreSQL: the orchestrator and state machine are driven directly (the
agents' part is played by calling what their messages call), the alerts app reacts through its
signal receivers, and deliveries reach a real HTTP receiver on loopback and Django's locmem outbox.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.core import mail
from django.utils import timezone

from agents.protocol.hooks import ReportBatch, StepReport
from alerts import signing
from alerts.choices import AlertState, DeliveryState
from alerts.models import Alert, Delivery
from jobs import ingest, orchestrator, services
from jobs.choices import IncidentState, JobState
from jobs.models import Incident, Job
from tests.alerts.conftest import PD_ROUTING_KEY, WEBHOOK_SECRET

pytestmark = pytest.mark.django_db


@pytest.fixture
def job(cast, eager_celery, django_capture_on_commit_callbacks):
    """A running job whose restart budget is zero: its first crash opens the circuit breaker."""
    job = Job.objects.create(name="gpt", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             accelerator="cpu", created_by="test",
                             recovery_policy={"max_restarts": 0, "window_minutes": 60, "backoff_seconds": 0,
                                              "loss_spike_limit": 3})
    with django_capture_on_commit_callbacks(execute=True):
        services.start_job(job, actor="test")
        report_step(job, 1)
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    return job


def report_step(job, step: int) -> None:
    job.refresh_from_db()
    ingest.record_reports(job, ReportBatch(job=str(job.pk), generation=job.generation, reports=[
        StepReport(job=str(job.pk), generation=job.generation, rank=rank, step=step, loss=2.0, grad_norm=1.0,
                   world_size=2, data_cursor=8 * step, samples=4, tokens=256, phases={"compute": 0.1},
                   time=time.time()) for rank in (0, 1)]), actor="test")


def crash(job, capture, hostname="gpu-01"):
    job.refresh_from_db()
    with capture(execute=True):
        orchestrator.handle_exit(job.pk, job.generation, hostname,
                                 {"exit_code": 1, "signature": "signal", "ranks": [{"rank": 1, "signal": 9}]})
        orchestrator.advance_recovery(job.pk)


def test_a_breaker_opening_pages_once_updates_on_more_failures_and_resolves_when_the_job_trains(
        job, channels, receiver, django_capture_on_commit_callbacks):
    capture = django_capture_on_commit_callbacks
    crash(job, capture)
    job.refresh_from_db()
    incident = Incident.objects.get(job=job)
    assert (incident.kind, job.state) == ("retry_storm", JobState.PAUSED)

    # One alert, paged once on every channel, with the evidence and the link to the incident.
    [alert] = Alert.objects.filter(job=job)
    assert (alert.rule, alert.severity, alert.state) == ("breaker_open", "page", AlertState.FIRING)
    link = f"https://nightwatch.example/jobs/{job.pk}/#incident-{incident.pk}"
    hooks = receiver.at("/hook")
    triggers = [r for r in hooks if r.json["action"] == "trigger"]
    assert len(triggers) == 1
    message = triggers[0].json
    assert message["alert"]["link"] == link and message["alert"]["severity"] == "page"
    assert message["evidence"]["incident"]["kind"] == "retry_storm"
    assert "circuit breaker open" in message["evidence"]["incident"]["classification"]
    assert message["evidence"]["incident"]["evidence"]["detail"]["exit_code"] == 1
    # Signed with the shared secret over the exact bytes, timestamped.
    assert signing.verify(WEBHOOK_SECRET, triggers[0].headers[signing.SIGNATURE_HEADER], triggers[0].body,
                          now=time.time())
    [pd_trigger] = [r.json for r in receiver.at("/pd") if r.json["event_action"] == "trigger"][:1]
    assert pd_trigger["routing_key"] == PD_ROUTING_KEY and pd_trigger["dedup_key"] == f"incident-{incident.pk}"
    assert pd_trigger["payload"]["severity"] == "critical" and pd_trigger["links"][0]["href"] == link
    assert len(mail.outbox) >= 1 and mail.outbox[0].subject.startswith("[Nightwatch PAGE]")
    assert link in mail.outbox[0].body and mail.outbox[0].to == ["oncall@example.com"]
    # The pause that followed is a follow-up saying a human is awaited, not a second page.
    assert all(r.json["action"] == "update" for r in hooks[1:])
    assert "awaiting" in alert.summary or "approve" in Alert.objects.get(pk=alert.pk).summary

    # A second failure on the same incident: a follow-up, not a duplicate.
    sent_before = len(receiver.at("/hook"))
    crash(job, capture)
    assert Incident.objects.filter(job=job).count() == 1
    assert Alert.objects.filter(job=job).count() == 1
    new = [r.json for r in receiver.at("/hook")[sent_before:]]
    assert [m["action"] for m in new] == ["update"]
    assert new[0]["evidence"]["incident"]["evidence"]["further"][0]["signal"] == "exit"
    assert [r.json["event_action"] for r in receiver.at("/pd")].count("trigger") >= 2  # PD: same dedup_key
    assert len({r.json["dedup_key"] for r in receiver.at("/pd")}) == 1

    # The on-call approves: acknowledged (PagerDuty stops escalating), not resolved yet.
    with capture(execute=True):
        services.approve_resume(job, actor="user:olga", reason="budget reset", force=True)
    alert.refresh_from_db()
    assert alert.state == AlertState.FIRING and alert.acknowledged_at
    assert receiver.at("/hook")[-1].json["action"] == "acknowledge"
    assert receiver.at("/pd")[-1].json["event_action"] == "acknowledge"
    # The resumed generation trains a step: the incident closes, the alert resolves.
    with capture(execute=True):
        report_step(job, 2)
    assert Incident.objects.get(job=job).state == IncidentState.RESOLVED
    alert.refresh_from_db()
    assert alert.state == AlertState.RESOLVED and alert.resolved_at
    assert receiver.at("/hook")[-1].json["action"] == "resolve"
    assert receiver.at("/pd")[-1].json == {"routing_key": PD_ROUTING_KEY, "event_action": "resolve",
                                           "dedup_key": f"incident-{incident.pk}"}
    assert mail.outbox[-1].subject.startswith("[Nightwatch RESOLVED]")
    assert not Delivery.objects.exclude(state=DeliveryState.SENT).exists()


def test_a_failing_receiver_is_retried_with_backoff_and_each_failure_recorded(
        job, channels, receiver, django_capture_on_commit_callbacks):
    channels["pagerduty"].delete()
    receiver.statuses = [500, 500]  # the webhook fails twice, then accepts
    crash(job, django_capture_on_commit_callbacks)
    trigger = Delivery.objects.get(channel=channels["webhook"], action="trigger")
    assert (trigger.state, trigger.attempts, trigger.status_code) == (DeliveryState.SENT, 3, 200)
    assert len(trigger.errors) == 2 and all("HTTP 500" in e for e in trigger.errors)
    assert len([r for r in receiver.at("/hook") if r.json["action"] == "trigger"]) == 3


def test_a_receiver_that_keeps_failing_is_given_up_after_the_attempt_budget(
        job, channels, receiver, django_capture_on_commit_callbacks):
    receiver.statuses = [503] * 50
    crash(job, django_capture_on_commit_callbacks)
    for name in ("webhook", "pagerduty"):
        trigger = Delivery.objects.get(channel=channels[name], action="trigger")
        assert (trigger.state, trigger.attempts) == (DeliveryState.FAILED, 3)  # MAX_ATTEMPTS in the fixture
        assert len(trigger.errors) == 3 and "HTTP 503" in trigger.errors[-1]
    # Email still went out: one channel's outage does not hold back another.
    assert Delivery.objects.get(channel=channels["email"], action="trigger").state == DeliveryState.SENT


def test_the_backoff_doubles_and_is_capped(alert_settings):
    from alerts.services import backoff_s

    base, cap = alert_settings.NIGHTWATCH["ALERTS"]["RETRY_BASE_S"], alert_settings.NIGHTWATCH["ALERTS"]["RETRY_MAX_S"]
    assert [backoff_s(n) for n in (1, 2, 3)] == [base, 2 * base, 4 * base]
    assert backoff_s(50) == cap


def test_an_automatic_recovery_only_notifies(cast, eager_celery, channels, receiver,
                                             django_capture_on_commit_callbacks):
    capture = django_capture_on_commit_callbacks
    job = Job.objects.create(name="bert", entrypoint="examples/train.py", nproc_per_node=2, accelerator="cpu",
                             created_by="test", recovery_policy={"max_restarts": 5, "backoff_seconds": 0})
    with capture(execute=True):
        services.start_job(job, actor="test")
        report_step(job, 1)
    crash(job, capture)
    with capture(execute=True):
        orchestrator.advance_recovery(job.pk)  # relaunch
        report_step(job, 2)
    [alert] = Alert.objects.filter(job=job)
    assert (alert.rule, alert.severity, alert.state) == ("recovery", "info", AlertState.RESOLVED)
    # The info channel heard the recovery and its end; the page-only channels heard nothing.
    assert [r.json["action"] for r in receiver.at("/hook")] == ["trigger", "resolve"]
    assert receiver.at("/pd") == [] and mail.outbox == []


def test_follow_ups_are_rate_limited_and_counted(job, channels, receiver, alert_settings,
                                                 django_capture_on_commit_callbacks):
    alert_settings.NIGHTWATCH = {**alert_settings.NIGHTWATCH, "ALERTS": {
        **alert_settings.NIGHTWATCH["ALERTS"], "UPDATE_INTERVAL_S": 3600}}
    for _ in range(3):
        crash(job, django_capture_on_commit_callbacks)
    alert = Alert.objects.get(job=job)
    assert [r.json["action"] for r in receiver.at("/hook")] == ["trigger"]
    # Two further failures: two follow-ups recorded, both held back (and counted for the next message).
    assert alert.updates == 2 and alert.suppressed_updates == 2


def test_routing_by_job_and_severity(cast, job, channels, receiver, django_capture_on_commit_callbacks):
    from alerts.models import Channel

    other = Job.objects.create(name="other", entrypoint="x.py", created_by="test")
    only_other = Channel.objects.create(name="other-team", kind="webhook", url=receiver.url("/other"),
                                        secret=WEBHOOK_SECRET, min_severity="info")
    only_other.jobs.add(other)
    crash(job, django_capture_on_commit_callbacks)
    assert receiver.at("/other") == []
    assert receiver.at("/hook")


def test_an_operator_pause_notifies_and_resolves_without_paging(cast, eager_celery, channels, receiver,
                                                                django_capture_on_commit_callbacks):
    capture = django_capture_on_commit_callbacks
    job = Job.objects.create(name="t5", entrypoint="examples/train.py", nproc_per_node=2, accelerator="cpu",
                             created_by="test")
    with capture(execute=True):
        services.start_job(job, actor="test")
        report_step(job, 1)
        services.pause_job(job, actor="user:otto", reason="maintenance")
        orchestrator.confirm_stopped(job.pk, job.generation, "gpu-01")
        orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.PAUSED
    [alert] = Alert.objects.filter(job=job)
    assert (alert.rule, alert.severity) == ("operator_pause", "info")
    assert receiver.at("/pd") == [] and mail.outbox == []
    with capture(execute=True):
        services.approve_resume(job, actor="user:olga", reason="done", force=True)
    alert.refresh_from_db()
    assert alert.state == AlertState.RESOLVED


def test_a_lemon_pages_and_clearing_it_resolves(cast, job, channels, receiver, alert_settings,
                                                 django_capture_on_commit_callbacks):
    """A node blamed in LEMON_INCIDENTS hardware incidents pages; a drain only notifies."""
    from nodes import services as node_services

    capture = django_capture_on_commit_callbacks
    alert_settings.NIGHTWATCH = {**alert_settings.NIGHTWATCH, "LEMON_INCIDENTS": 1}
    Job.objects.filter(pk=job.pk).update(recovery_policy={"max_restarts": 5, "backoff_seconds": 0})
    job.refresh_from_db()
    with capture(execute=True):
        orchestrator.handle_node_health("gpu-01", "unhealthy", ["xid 79"])
    rules = set(Alert.objects.values_list("rule", flat=True))
    assert {"lemon", "drain"} <= rules
    lemon = Alert.objects.get(rule="lemon")
    assert lemon.severity == "page" and lemon.node.hostname == "gpu-01"
    assert Alert.objects.get(rule="drain").severity == "info"
    assert any(r.json["dedup_key"] == lemon.key for r in receiver.at("/pd"))
    with capture(execute=True):
        node_services.clear_lemon(cast.node1, actor="user:otto", reason="replaced the GPU")
    lemon.refresh_from_db()
    assert lemon.state == AlertState.RESOLVED


def test_a_checkpoint_failing_verification_pages(cast, job, channels, receiver, tmp_path,
                                                 django_capture_on_commit_callbacks):
    from checkpoints.models import Checkpoint
    from checkpoints.services import verify

    checkpoint = Checkpoint.objects.create(job=job, step=10, location=str(tmp_path / "missing"))
    with django_capture_on_commit_callbacks(execute=True):
        verify(checkpoint)
    alert = Alert.objects.get(rule="checkpoint_corrupt")
    assert alert.severity == "page" and alert.state == AlertState.FIRING
    assert alert.evidence["checkpoint"]["step"] == 10 and alert.link.endswith(f"/jobs/{job.pk}/")
    assert any(r.json["dedup_key"] == alert.key for r in receiver.at("/pd"))


def test_the_sweeper_resolves_what_no_event_announced(job, channels, receiver, django_capture_on_commit_callbacks):
    from alerts.services import reconcile_alerts

    crash(job, django_capture_on_commit_callbacks)
    # Resolved by a bulk update: no signal fires.
    Incident.objects.filter(job=job).update(state=IncidentState.RESOLVED)
    with django_capture_on_commit_callbacks(execute=True):
        assert reconcile_alerts() == 1
    assert Alert.objects.get(job=job).state == AlertState.RESOLVED
    assert receiver.at("/hook")[-1].json["action"] == "resolve"


def test_a_resolved_incident_resolves_its_alert_at_once_without_the_sweeper(job, channels, receiver,
                                                                            django_capture_on_commit_callbacks):
    """``resolve_incident`` closes the row by a bulk update (no ``post_save``); its ``incident.resolved``
    event is what tells the alert, in the same commit, not the 60 s sweep."""
    crash(job, django_capture_on_commit_callbacks)
    incident = Incident.objects.get(job=job)
    alert = Alert.objects.get(incident=incident)
    assert alert.state == AlertState.FIRING
    with django_capture_on_commit_callbacks(execute=True):
        assert orchestrator.resolve_incident(incident, now=timezone.now(), actor="user:oncall",
                                             reason="hardware replaced")
    alert.refresh_from_db()
    assert alert.state == AlertState.RESOLVED and alert.checked_at is None  # no sweep has looked at it
    assert receiver.at("/hook")[-1].json["action"] == "resolve"
    assert [r.json["event_action"] for r in receiver.at("/pd")][-1] == "resolve"


def test_evaluating_twice_is_harmless_and_a_lost_task_is_made_up_for(job, channels, receiver,
                                                                     django_capture_on_commit_callbacks):
    from alerts import services as alert_services

    crash(job, django_capture_on_commit_callbacks)
    incident = Incident.objects.get(job=job)
    sent = len(receiver.requests)
    with django_capture_on_commit_callbacks(execute=True):
        assert alert_services.evaluate_incident(incident.pk) is None  # nothing changed: nothing sent
    assert len(receiver.requests) == sent and Alert.objects.filter(job=job).count() == 1

    # A delivery whose task was lost (still pending, overdue) is dispatched again by the sweeper.
    alert = Alert.objects.get(job=job)
    lost = Delivery.objects.create(alert=alert, channel=channels["webhook"], action="update",
                                   payload={**receiver.at("/hook")[0].json, "action": "update"},
                                   next_attempt_at=timezone.now() - timedelta(minutes=10))
    assert alert_services.redispatch_one_delivery()
    lost.refresh_from_db()
    assert (lost.state, lost.attempts) == (DeliveryState.SENT, 1)
    assert not alert_services.redispatch_one_delivery()


def test_a_missed_incident_is_raised_by_the_sweeper(job, channels, receiver, django_capture_on_commit_callbacks):
    """Its task was lost (say the broker was down when the transaction committed)."""
    from alerts import services as alert_services

    job.refresh_from_db()
    orchestrator.handle_exit(job.pk, job.generation, "gpu-01", {"exit_code": 1, "signature": "signal"})
    assert not Alert.objects.exists()  # no on-commit callbacks ran
    with django_capture_on_commit_callbacks(execute=True):
        assert alert_services.raise_missed_incidents() == 1
    assert Alert.objects.get(job=job).state == AlertState.FIRING
    assert [r.json["event_action"] for r in receiver.at("/pd")] == ["trigger"]


def test_an_incident_over_before_it_was_evaluated_is_still_announced_once(job, channels, receiver,
                                                                          django_capture_on_commit_callbacks):
    """PagerDuty gets a trigger and a resolve at once, so nothing stays open there."""
    from alerts import services as alert_services

    job.refresh_from_db()
    orchestrator.handle_exit(job.pk, job.generation, "gpu-01", {"exit_code": 1, "signature": "signal"})
    incident = Incident.objects.get(job=job)
    Incident.objects.filter(pk=incident.pk).update(state=IncidentState.RESOLVED)
    with django_capture_on_commit_callbacks(execute=True):
        alert_services.evaluate_incident(incident.pk)
    alert = Alert.objects.get(incident=incident)
    assert alert.state == AlertState.RESOLVED
    sent = [r.json for r in receiver.at("/pd")]
    assert [m["event_action"] for m in sent] == ["trigger", "resolve"]
    assert {m["dedup_key"] for m in sent} == {alert.key}
    assert alert_services.evaluate_incident(incident.pk) is None  # told once only


def test_a_straggler_notifies_once_and_pages_nobody(job, channels, receiver, django_capture_on_commit_callbacks):
    from jobs import policy

    job.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=True):
        orchestrator.report_fault(job.pk, policy.STRAGGLER, generation=job.generation, nodes=("gpu-01",),
                                  detail={"tail_ratio": 1.8})
    [alert] = Alert.objects.filter(job=job)
    assert (alert.rule, alert.severity, alert.state) == ("straggler", "info", AlertState.RESOLVED)
    assert [r.json["action"] for r in receiver.at("/hook")] == ["trigger"]
    assert receiver.at("/hook")[0].json["evidence"]["incident"]["evidence"]["detail"] == {"tail_ratio": 1.8}
    assert receiver.at("/pd") == [] and mail.outbox == []
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING


def test_a_newer_verified_checkpoint_clears_the_corrupt_checkpoint_page(cast, job, channels, receiver, tmp_path,
                                                                       django_capture_on_commit_callbacks):
    from checkpoints.models import Checkpoint
    from checkpoints.services import verify
    from checkpoints.services.registry import checkpoint_event
    from core.events import EventKind

    with django_capture_on_commit_callbacks(execute=True):
        verify(Checkpoint.objects.create(job=job, step=10, location=str(tmp_path / "missing")))
    alert = Alert.objects.get(rule="checkpoint_corrupt")
    newer = Checkpoint.objects.create(job=job, step=20, location=str(tmp_path / "c20"), state="verified")
    with django_capture_on_commit_callbacks(execute=True):
        checkpoint_event(EventKind.CHECKPOINT_VERIFY, newer, actor="system:verifier", old_state="committed",
                         new_state="verified", reason="step 20 verified")
    alert.refresh_from_db()
    assert alert.state == AlertState.RESOLVED
    # With no corrupt-checkpoint page firing, a verification costs the alerts app nothing.
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        checkpoint_event(EventKind.CHECKPOINT_VERIFY, newer, actor="system:verifier", old_state="verified",
                         new_state="verified", reason="re-verified")
    assert callbacks == []
