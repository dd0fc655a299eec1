"""Channel secrets encrypted at rest; receivers' answers removed from the delivery log (issue 17).

1. ``Channel.secret`` (clear) becomes ``encrypted_secret``, and every stored value is encrypted
   with the configured key (``alerts.crypto``). Reversible: going back decrypts.
2. Delivery errors and test-send audit events used to quote up to 300 bytes of the receiver's
   answer (an SSRF read-back); only the status code or the error's class is kept.
"""

import re

from django.db import migrations, models

from alerts import crypto

_ATTEMPT = re.compile(r"^(?P<head>.*? attempt \d+: )(?P<rest>.*)$", re.DOTALL)
_STATUS = re.compile(r"^HTTP \d{3}")
_CLASS = re.compile(r"^[A-Za-z_][\w.]*$")


def scrubbed(error: str) -> str:
    """``HTTP 500 Internal Server Error: <body>`` -> ``HTTP 500``; ``URLError: <reason>`` -> ``URLError``."""
    if status := _STATUS.match(error):
        return status.group(0)
    name = error.split(":", 1)[0]
    return name if _CLASS.match(name) else "error (detail removed)"


def _scrub_line(line: str) -> str:
    match = _ATTEMPT.match(line)
    return match.group("head") + scrubbed(match.group("rest")) if match else scrubbed(line)


def encrypt_secrets(apps, schema_editor):
    Channel = apps.get_model("alerts", "Channel")
    for channel in Channel.objects.exclude(encrypted_secret=""):
        channel.encrypted_secret = crypto.encrypt(channel.encrypted_secret)
        channel.save(update_fields=["encrypted_secret"])


def decrypt_secrets(apps, schema_editor):
    Channel = apps.get_model("alerts", "Channel")
    for channel in Channel.objects.exclude(encrypted_secret=""):
        channel.encrypted_secret = crypto.decrypt(channel.encrypted_secret)
        channel.save(update_fields=["encrypted_secret"])


def scrub_answers(apps, schema_editor):
    Delivery = apps.get_model("alerts", "Delivery")
    Event = apps.get_model("jobs", "Event")
    for delivery in Delivery.objects.exclude(errors=[]).iterator():
        errors = [_scrub_line(line) if isinstance(line, str) else "" for line in delivery.errors]
        if errors != delivery.errors:
            Delivery.objects.filter(pk=delivery.pk).update(errors=errors)
    for event in Event.objects.filter(kind="alert.channel.test").iterator():
        error = (event.evidence or {}).get("error")
        if isinstance(error, str) and error:
            Event.objects.filter(pk=event.pk).update(evidence={**event.evidence, "error": scrubbed(error)})


class Migration(migrations.Migration):

    dependencies = [
        ("alerts", "0001_initial"),
        ("jobs", "0003_recovery_bookkeeping"),
    ]

    operations = [
        migrations.RenameField(model_name="channel", old_name="secret", new_name="encrypted_secret"),
        migrations.AlterField(
            model_name="channel",
            name="encrypted_secret",
            field=models.TextField(blank=True, help_text="Webhook signing secret, or the PagerDuty routing "
                                                         "(integration) key, encrypted."),
        ),
        migrations.RunPython(encrypt_secrets, decrypt_secrets),
        migrations.RunPython(scrub_answers, migrations.RunPython.noop),
    ]
