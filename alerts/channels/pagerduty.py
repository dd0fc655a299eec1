"""PagerDuty Events API v2: trigger / acknowledge / resolve, deduplicated by ``dedup_key``.

A follow-up is a second ``trigger`` with the same ``dedup_key`` (PagerDuty adds it to the open
incident); an on-call resuming the paused job acknowledges it; a resolve closes it. The routing
key is the channel's secret.
"""

from __future__ import annotations

from django.conf import settings

from alerts.channels.base import Outcome, dumps, post_json, url_problem
from alerts.choices import Action, Severity

EVENT_ACTIONS = {Action.TRIGGER: "trigger", Action.UPDATE: "trigger", Action.ACKNOWLEDGE: "acknowledge",
                 Action.RESOLVE: "resolve", Action.TEST: "trigger"}
PD_SEVERITY = {Severity.PAGE: "critical", Severity.INFO: "info"}


def event(channel, message: dict) -> dict:
    """The Events v2 body for ``message`` (the generic alert message of ``alerts.messages``)."""
    alert = message["alert"]
    body = {
        "routing_key": channel.secret,
        "event_action": EVENT_ACTIONS[message["action"]],
        "dedup_key": alert["key"],
    }
    if body["event_action"] in ("acknowledge", "resolve"):
        return body
    job = alert.get("job") or {}
    body["payload"] = {
        "summary": f"{alert['title']}"[:1024],
        "source": job.get("name") or (alert.get("node") or {}).get("hostname") or "nightwatch",
        "severity": PD_SEVERITY.get(alert["severity"], "warning"),
        "timestamp": alert["updated_at"],
        "component": f"job {job['id']}" if job else "cluster",
        "group": alert["rule"],
        "class": alert["rule"],
        "custom_details": {"summary": alert["summary"], "evidence": message.get("evidence", {}),
                           "updates": alert["updates"]},
    }
    body["client"] = "Nightwatch"
    if alert.get("link"):
        body["client_url"] = alert["link"]
        body["links"] = [{"href": alert["link"], "text": "Incident page"}]
    return body


def send(channel, message: dict) -> Outcome:
    """One attempt. An alert announced already resolved (a notification, or an incident over before
    it was evaluated) is triggered and resolved at once, so it does not stay open in PagerDuty; a
    retry repeats both, which PagerDuty deduplicates by ``dedup_key``."""
    outcome = post_json(channel.url, dumps(event(channel, message)), {})
    born_resolved = message["action"] in (Action.TRIGGER, Action.UPDATE, Action.TEST) \
        and message["alert"]["state"] == "resolved"
    if not outcome.ok or not born_resolved:
        return outcome
    return post_json(channel.url, dumps(event(channel, {**message, "action": Action.RESOLVE})), {})


def validate(fields: dict) -> dict[str, str]:
    problems = {}
    if problem := url_problem(fields.get("url", ""), allow_http=settings.NIGHTWATCH["ALERTS"]["ALLOW_HTTP"]):
        problems["url"] = problem
    if not 8 <= len(fields.get("secret") or "") <= 64:
        problems["secret"] = "the PagerDuty routing key (8-64 characters) is required"  # noqa: S105
    return problems
