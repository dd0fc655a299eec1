"""Alert transports, one module each with the same small interface, registered in one map.

Each module has ``send(channel, message) -> Outcome`` (one attempt; never raises for a delivery
failure, it reports it) and ``validate(kind_fields) -> dict[str, str]`` (field -> problem).
"""

from __future__ import annotations

from alerts.channels import email, pagerduty, webhook
from alerts.channels.base import Outcome
from alerts.choices import ChannelKind
from alerts.crypto import SecretUnreadable

TRANSPORTS = {
    ChannelKind.WEBHOOK: webhook,
    ChannelKind.EMAIL: email,
    ChannelKind.PAGERDUTY: pagerduty,
}


def send(channel, message: dict) -> Outcome:
    try:
        return TRANSPORTS[channel.kind].send(channel, message)
    except SecretUnreadable as exc:  # the key changed: an operator must set the secret again
        return Outcome(ok=False, error=f"SecretUnreadable: {exc}", permanent=True)


def validate(kind: str, fields: dict) -> dict[str, str]:
    return TRANSPORTS[kind].validate(fields)


__all__ = ["TRANSPORTS", "Outcome", "send", "validate"]
