"""The alerts API: channel configuration (write-only secrets, validated URLs, roles, audit), the
test-send, the per-job alert log and the efficiency figures."""

from __future__ import annotations

import time

import pytest

from alerts import signing
from alerts.models import Alert, Channel
from jobs.models import Event

pytestmark = pytest.mark.django_db

CHANNELS = "/api/v1/alert-channels"


def test_a_webhook_secret_is_generated_once_and_never_returned(cast, api, receiver, alert_settings, eager_celery,
                                                               django_capture_on_commit_callbacks):
    operator = api(cast.tokens["operator"])
    created = operator.post(CHANNELS, {"name": "ops-hook", "kind": "webhook", "url": receiver.url("/hook"),
                                       "min_severity": "info"}, format="json")
    assert created.status_code == 201, created.content
    secret = created.data["generated_secret"]
    assert len(secret) >= 32 and created.data["has_secret"] and "secret" not in created.data
    channel_url = f"{CHANNELS}/{created.data['id']}"
    for body in (operator.get(channel_url).data, operator.get(CHANNELS).data["results"][0]):
        assert "secret" not in body and "generated_secret" not in body and secret not in str(body)
    # The test-send is queued (a task), signed with that secret; the channel says whether it arrived.
    with django_capture_on_commit_callbacks(execute=True):
        answer = operator.post(f"{channel_url}/test")
    assert answer.status_code == 202 and answer.data == {"delivery": answer.data["delivery"], "state": "pending"}
    [test_send] = operator.get(channel_url).data["test_sends"]
    assert test_send["id"] == answer.data["delivery"]
    assert (test_send["state"], test_send["status_code"], test_send["errors"]) == ("sent", 200, [])
    [sent] = receiver.at("/hook")
    assert sent.json["action"] == "test"
    assert signing.verify(secret, sent.headers[signing.SIGNATURE_HEADER], sent.body, now=time.time())
    # Every change is audited, without the secret.
    audit = list(Event.objects.filter(kind__startswith="alert.channel").values_list("kind", "actor"))
    assert ("alert.channel", "token:operator(otto)") in audit and ("alert.channel.test",
                                                                    "token:operator(otto)") in audit
    assert secret not in str(list(Event.objects.values_list("evidence", flat=True)))


def test_a_secret_can_be_replaced_but_not_read_and_blank_keeps_it(cast, api, receiver, alert_settings):
    channel = Channel.objects.create(name="h", kind="webhook", url=receiver.url(), secret="a" * 20)
    operator = api(cast.tokens["operator"])
    url = f"{CHANNELS}/{channel.pk}"
    assert operator.patch(url, {"secret": ""}, format="json").status_code == 200
    channel.refresh_from_db()
    assert channel.secret == "a" * 20
    answer = operator.patch(url, {"secret": "b" * 24, "min_severity": "info"}, format="json")
    assert answer.status_code == 200 and "secret" not in answer.data
    channel.refresh_from_db()
    assert (channel.secret, channel.min_severity) == ("b" * 24, "info")


@pytest.mark.parametrize("url, reason", [
    ("ftp://example.com/x", "scheme"),
    ("https://user:pw@example.com/x", "credentials"),
    ("https:///nohost", "host"),
    ("", "required"),
])
def test_bad_webhook_urls_are_refused_with_a_precise_problem(cast, api, url, reason, alert_settings):
    answer = api(cast.tokens["operator"]).post(CHANNELS, {"name": "x", "kind": "webhook", "url": url,
                                                          "secret": "s" * 20}, format="json")
    assert answer.status_code == 400
    assert answer["Content-Type"] == "application/problem+json"
    assert any(e["field"] == "url" and reason in e["reason"] for e in answer.json()["errors"])
    assert not Channel.objects.exists()


def test_plain_http_is_refused_where_not_allowed(cast, api, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "ALERTS": {**settings.NIGHTWATCH["ALERTS"], "ALLOW_HTTP": False}}
    answer = api(cast.tokens["operator"]).post(CHANNELS, {"name": "x", "kind": "webhook",
                                                          "url": "http://hooks.example/x", "secret": "s" * 20},
                                               format="json")
    assert answer.status_code == 400 and "https" in answer.json()["detail"]


def test_email_and_pagerduty_channels_validate_their_fields(cast, api, alert_settings):
    operator = api(cast.tokens["operator"])
    bad_email = operator.post(CHANNELS, {"name": "m", "kind": "email", "emails": ["not-an-address"]}, format="json")
    assert bad_email.status_code == 400 and bad_email.json()["errors"][0]["field"] == "emails"
    no_key = operator.post(CHANNELS, {"name": "p", "kind": "pagerduty",
                                      "url": "https://events.pagerduty.com/v2/enqueue"}, format="json")
    assert no_key.status_code == 400 and no_key.json()["errors"][0]["field"] == "secret"
    ok = operator.post(CHANNELS, {"name": "m", "kind": "email", "emails": ["oncall@example.com"],
                                  "jobs": [cast.job.pk]}, format="json")
    assert ok.status_code == 201 and ok.data["jobs"] == [cast.job.pk]


def test_a_failing_test_send_reports_the_status_but_never_the_receivers_answer(
        cast, api, receiver, alert_settings, eager_celery, django_capture_on_commit_callbacks):
    receiver.statuses = [500]
    channel = Channel.objects.create(name="h", kind="webhook", url=receiver.url(), secret="a" * 20)
    oncall = api(cast.tokens["oncall"])
    with django_capture_on_commit_callbacks(execute=True):
        answer = oncall.post(f"{CHANNELS}/{channel.pk}/test")
    assert answer.status_code == 202 and "receiver broke" not in answer.content.decode()
    detail = oncall.get(f"{CHANNELS}/{channel.pk}")
    [test_send] = detail.data["test_sends"]
    assert (test_send["state"], test_send["status_code"]) == ("failed", 500)
    [error] = test_send["errors"]
    assert error.endswith("attempt 1: HTTP 500"), error  # one attempt, not retried
    assert "receiver broke" not in detail.content.decode()
    assert "receiver broke" not in str(list(Event.objects.values_list("evidence", flat=True)))


@pytest.mark.parametrize("who, status", [(None, 401), ("viewer", 403), ("ci", 403), ("agent", 403)])
def test_channels_need_the_operate_capability(cast, api, who, status):
    client = api(cast.tokens[who] if who else None)
    assert client.get(CHANNELS).status_code == status
    assert client.post(CHANNELS, {"name": "x", "kind": "email", "emails": ["a@b.co"]},
                       format="json").status_code == status


def test_the_job_alert_log_and_efficiency_are_readable_by_viewers(cast, api, alert_settings):
    Alert.objects.create(key="k", rule="mfu_low", severity="info", title="slow", job=cast.job)
    viewer = api(cast.tokens["viewer"])
    log = viewer.get(f"/api/v1/jobs/{cast.job.pk}/alerts")
    assert log.status_code == 200 and log.data["results"][0]["title"] == "slow"
    figures = viewer.get(f"/api/v1/jobs/{cast.job.pk}/efficiency")
    assert figures.status_code == 200 and figures.data["mfu"] is None and "cost" in figures.data
    assert viewer.get("/api/v1/jobs/999999/alerts").status_code == 404
    assert api().get(f"/api/v1/jobs/{cast.job.pk}/alerts").status_code == 401


def test_the_efficiency_target_is_set_by_operators(cast, api):
    url = f"/api/v1/jobs/{cast.job.pk}/efficiency/target"
    assert api(cast.tokens["viewer"]).put(url, {"expected_mfu": 0.4}, format="json").status_code == 403
    bad = api(cast.tokens["operator"]).put(url, {"expected_mfu": 1.5}, format="json")
    assert bad.status_code == 400 and bad.json()["errors"][0]["field"] == "expected_mfu"
    ok = api(cast.tokens["operator"]).put(url, {"expected_mfu": 0.4, "flops_per_token": 6e9}, format="json")
    assert ok.status_code == 200 and ok.data == {"expected_mfu": 0.4, "mfu_margin": None, "flops_per_token": 6e9}
    assert api(cast.tokens["viewer"]).get(url).data["expected_mfu"] == 0.4
    assert Event.objects.filter(kind="job.efficiency_target", job=cast.job).exists()


def test_a_pagerduty_test_send_triggers_and_resolves_so_nothing_stays_open(cast, api, receiver, alert_settings,
                                                                          eager_celery,
                                                                          django_capture_on_commit_callbacks):
    channel = Channel.objects.create(name="pd", kind="pagerduty", url=receiver.url("/pd"), secret="R" * 20)
    with django_capture_on_commit_callbacks(execute=True):
        answer = api(cast.tokens["operator"]).post(f"{CHANNELS}/{channel.pk}/test")
    assert answer.status_code == 202
    channel.refresh_from_db()
    assert [d.state for d in channel.deliveries.all()] == ["sent"]
    sent = [r.json for r in receiver.at("/pd")]
    assert [m["event_action"] for m in sent] == ["trigger", "resolve"]
    assert sent[0]["dedup_key"] == sent[1]["dedup_key"] and sent[0]["routing_key"] == "R" * 20
