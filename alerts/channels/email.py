"""Email through Django's mail backend (``EMAIL_*`` settings): plain text, evidence included."""

from __future__ import annotations

import json

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.mail import EmailMessage
from django.core.validators import validate_email

from alerts.channels.base import Outcome

#: More would be a mailing list; configure one as a single address.
MAX_RECIPIENTS = 20


def render(message: dict) -> tuple[str, str]:
    alert = message["alert"]
    tag = {"trigger": "PAGE" if alert["severity"] == "page" else "INFO", "update": "UPDATE",
           "acknowledge": "ACKNOWLEDGED", "resolve": "RESOLVED", "test": "TEST"}[message["action"]]
    subject = f"[Nightwatch {tag}] {alert['title']}"[:250]
    lines = [alert["title"], "", alert["summary"], ""]
    if alert.get("link"):
        lines += [f"Incident page: {alert['link']}", ""]
    lines += [f"Severity: {alert['severity']}   State: {alert['state']}   Follow-ups: {alert['updates']}",
              f"Key: {alert['key']}", "", "Evidence:", json.dumps(message.get("evidence", {}), indent=2,
                                                                    sort_keys=True, default=str)]
    return subject, "\n".join(lines)


def send(channel, message: dict) -> Outcome:
    subject, body = render(message)
    try:
        sent = EmailMessage(subject, body, settings.DEFAULT_FROM_EMAIL, list(channel.emails)).send()
    except Exception as exc:  # SMTP and socket errors of every kind: record them, retry later
        return Outcome(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
    return Outcome(ok=bool(sent), error="" if sent else "the mail backend sent nothing")


def validate(fields: dict) -> dict[str, str]:
    emails = fields.get("emails") or []
    if not emails:
        return {"emails": "at least one address is required"}
    if len(emails) > MAX_RECIPIENTS:
        return {"emails": f"at most {MAX_RECIPIENTS} addresses"}
    for address in emails:
        try:
            validate_email(address)
        except ValidationError:
            return {"emails": f"{address!r} is not an email address"}
    return {}
