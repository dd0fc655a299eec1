"""Channel secrets at rest (alerts.crypto): stored as Fernet tokens, never returned, readable after a
key rotation, refused cleanly when no key opens them; the migration that encrypted the clear ones."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet
from django.core.management import CommandError, call_command
from django.db import connection

from alerts import channels, crypto
from alerts.checks import alert_egress_and_secrets
from alerts.models import Channel

CHANNELS = "/api/v1/alert-channels"
SECRET = "whsec-0123456789abcdef"


def with_keys(settings, key: str) -> None:
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "ALERTS": {**settings.NIGHTWATCH["ALERTS"], "SECRETS_KEY": key}}


def stored(channel: Channel) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT encrypted_secret FROM alerts_channel WHERE id = %s", [channel.pk])
        return cursor.fetchone()[0]


@pytest.mark.django_db
def test_a_secret_is_stored_encrypted_and_never_returned(cast, api, settings, alert_settings):
    with_keys(settings, Fernet.generate_key().decode())
    operator = api(cast.tokens["operator"])
    created = operator.post(CHANNELS, {"name": "pd", "kind": "pagerduty", "secret": SECRET,
                                       "url": "https://events.pagerduty.com/v2/enqueue"}, format="json")
    assert created.status_code == 201, created.content
    channel = Channel.objects.get()
    token = stored(channel)
    assert SECRET not in token and token.startswith("gAAAAA")
    assert channel.secret == SECRET
    body = operator.get(f"{CHANNELS}/{channel.pk}").content.decode()
    assert SECRET not in body and token not in body and '"has_secret":true' in body


@pytest.mark.django_db
def test_a_rotated_key_still_reads_old_secrets_until_they_are_reencrypted(settings):
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    with_keys(settings, old)
    Channel.objects.create(name="h", kind="webhook", url="https://hooks.example/x", secret=SECRET)
    with_keys(settings, f"{new},{old}")
    assert Channel.objects.get().secret == SECRET
    call_command("reencrypt_alert_secrets")
    with_keys(settings, new)
    assert Channel.objects.get().secret == SECRET
    # A key that was never set (and the SECRET_KEY-derived default: an install that had none).
    derived_only = Channel.objects.create(name="d", kind="webhook", url="https://hooks.example/y", secret="")
    derived_only.encrypted_secret = Fernet(crypto.derived_key(settings.SECRET_KEY)).encrypt(b"abc").decode()
    derived_only.save()
    assert Channel.objects.get(name="d").secret == "abc"


@pytest.mark.django_db
def test_a_secret_no_key_opens_fails_the_send_and_must_be_set_again(cast, api, settings, alert_settings):
    with_keys(settings, Fernet.generate_key().decode())
    channel = Channel.objects.create(name="h", kind="webhook", url="https://hooks.example/x", secret=SECRET)
    with_keys(settings, Fernet.generate_key().decode())
    outcome = channels.send(Channel.objects.get(), {"action": "test"})
    assert not outcome.ok and outcome.permanent and outcome.error.startswith("SecretUnreadable")
    operator = api(cast.tokens["operator"])
    assert operator.get(f"{CHANNELS}/{channel.pk}").status_code == 200
    refused = operator.patch(f"{CHANNELS}/{channel.pk}", {"min_severity": "info"}, format="json")
    assert refused.status_code == 400 and refused.json()["errors"][0]["field"] == "secret"
    fixed = operator.patch(f"{CHANNELS}/{channel.pk}", {"secret": "n" * 20}, format="json")
    assert fixed.status_code == 200 and Channel.objects.get().secret == "n" * 20
    with_keys(settings, Fernet.generate_key().decode())
    with pytest.raises(CommandError, match="opens the secret of: h "):
        call_command("reencrypt_alert_secrets")


def test_the_secrets_key_is_checked_and_production_warns_without_one(settings):
    with_keys(settings, "not-a-key")
    assert [c.id for c in alert_egress_and_secrets()] == ["nightwatch.alerts.E008"]
    with_keys(settings, "")
    settings.PRODUCTION = True
    assert [c.id for c in alert_egress_and_secrets()] == ["nightwatch.alerts.W001"]
    with_keys(settings, Fernet.generate_key().decode())
    assert alert_egress_and_secrets() == []


@pytest.mark.django_db(transaction=True)
def test_the_migration_encrypts_clear_secrets_and_removes_quoted_answers():
    from django.db.migrations.executor import MigrationExecutor

    before, after = [("alerts", "0001_initial")], [("alerts", "0002_encrypted_secret_scrubbed_errors")]
    executor = MigrationExecutor(connection)
    leaves = executor.loader.graph.leaf_nodes()
    executor.migrate(before)
    try:
        old = executor.loader.project_state(before).apps
        channel = old.get_model("alerts", "Channel").objects.create(name="h", kind="webhook", secret=SECRET,
                                                                     url="https://hooks.example/x")
        delivery = old.get_model("alerts", "Delivery").objects.create(channel=channel, action="test", errors=[
            '2026-11-30T10:00:00+00:00 attempt 1: HTTP 500 Internal Server Error: {"private":"answer"}',
            "2026-11-30T10:01:00+00:00 attempt 2: URLError: <urlopen error private answer>"])
        event = old.get_model("jobs", "Event").objects.create(kind="alert.channel.test", actor="t", evidence={
            "channel": channel.pk, "error": "HTTP 200 OK: private answer"})
        executor = MigrationExecutor(connection)
        executor.migrate(after)
        new = executor.loader.project_state(after).apps
        migrated = new.get_model("alerts", "Channel").objects.get(pk=channel.pk)
        assert migrated.encrypted_secret != SECRET and crypto.decrypt(migrated.encrypted_secret) == SECRET
        assert new.get_model("alerts", "Delivery").objects.get(pk=delivery.pk).errors == [
            "2026-11-30T10:00:00+00:00 attempt 1: HTTP 500", "2026-11-30T10:01:00+00:00 attempt 2: URLError"]
        assert new.get_model("jobs", "Event").objects.get(pk=event.pk).evidence == {"channel": channel.pk,
                                                                                    "error": "HTTP 200"}
    finally:
        MigrationExecutor(connection).migrate(leaves)


@pytest.mark.django_db
def test_the_admin_form_sets_and_keeps_the_secret(client, django_user_model, alert_settings):
    admin = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(admin)
    form = {"name": "h", "kind": "webhook", "url": "https://93.184.216.34/x", "secret": SECRET, "emails": "[]",
            "min_severity": "page", "enabled": "on", "deliveries-TOTAL_FORMS": "0", "deliveries-INITIAL_FORMS": "0"}
    assert client.post("/admin/alerts/channel/add/", form).status_code == 302
    channel = Channel.objects.get()
    assert channel.secret == SECRET and SECRET not in stored(channel)
    page = client.get(f"/admin/alerts/channel/{channel.pk}/change/").content.decode()
    assert SECRET not in page and stored(channel) not in page
    assert client.post(f"/admin/alerts/channel/{channel.pk}/change/", {**form, "secret": ""}).status_code == 302
    assert Channel.objects.get().secret == SECRET
