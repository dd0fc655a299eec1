"""Generic webhook: the alert message as JSON, signed (``alerts.signing``) with the channel's secret."""

from __future__ import annotations

import time

from django.conf import settings

from alerts import signing
from alerts.channels.base import Outcome, dumps, post_json, url_problem

#: A secret shorter than this is guessable; the API generates one when none is given.
MIN_SECRET_LENGTH = 16


def send(channel, message: dict) -> Outcome:
    body = dumps(message)
    timestamp = int(time.time())
    headers = {signing.TIMESTAMP_HEADER: str(timestamp),
               signing.SIGNATURE_HEADER: signing.header_value(channel.secret, timestamp, body),
               "X-Nightwatch-Action": message.get("action", "")}
    return post_json(channel.url, body, headers)


def validate(fields: dict) -> dict[str, str]:
    problems = {}
    if problem := url_problem(fields.get("url", ""), allow_http=settings.NIGHTWATCH["ALERTS"]["ALLOW_HTTP"]):
        problems["url"] = problem
    if len(fields.get("secret") or "") < MIN_SECRET_LENGTH:
        problems["secret"] = f"at least {MIN_SECRET_LENGTH} characters"
    return problems
