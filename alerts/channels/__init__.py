"""Alert transports, one module each with the same small interface, registered in one map.

Each module has ``send(channel, message) -> Outcome`` (one attempt; never raises for a delivery
failure, it reports it) and ``validate(kind_fields) -> dict[str, str]`` (field -> problem).
"""

from __future__ import annotations

from alerts.channels import email, pagerduty, webhook
from alerts.channels.base import Outcome
from alerts.choices import ChannelKind

TRANSPORTS = {
    ChannelKind.WEBHOOK: webhook,
    ChannelKind.EMAIL: email,
    ChannelKind.PAGERDUTY: pagerduty,
}


def send(channel, message: dict) -> Outcome:
    return TRANSPORTS[channel.kind].send(channel, message)


def validate(kind: str, fields: dict) -> dict[str, str]:
    return TRANSPORTS[kind].validate(fields)


__all__ = ["TRANSPORTS", "Outcome", "send", "validate"]
