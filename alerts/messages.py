"""The one shape of an alert message (what a webhook receives; email and PagerDuty render it),
and the links into the dashboard.

    {"version": 1, "action": "trigger|update|acknowledge|resolve|test", "sent_at": "...",
     "alert": {"id", "key", "rule", "severity", "state", "title", "summary", "link",
               "job": {"id", "name", "state"} | null, "incident": id | null,
               "node": {"id", "hostname"} | null, "created_at", "updated_at", "acknowledged_at", "resolved_at",
               "updates", "suppressed_updates"},
     "evidence": {...}}
"""

from __future__ import annotations

from django.conf import settings

VERSION = 1


def public_url(path: str) -> str:
    return settings.NIGHTWATCH["PUBLIC_URL"].rstrip("/") + path


def job_link(job_id: int, incident_id: int | None = None) -> str:
    """The dashboard's job page, at the incident's anchor when there is one."""
    return public_url(f"/jobs/{job_id}/" + (f"#incident-{incident_id}" if incident_id else ""))


def node_link(hostname: str) -> str:
    return public_url(f"/nodes/{hostname}/")


def _iso(value) -> str | None:
    return value.isoformat() if value else None


def message(alert, action: str, *, now) -> dict:
    job = alert.job
    node = alert.node
    return {
        "version": VERSION,
        "action": action,
        "sent_at": now.isoformat(),
        "alert": {
            "id": alert.pk, "key": alert.key, "rule": alert.rule, "severity": alert.severity,
            "state": alert.state, "title": alert.title, "summary": alert.summary, "link": alert.link,
            "job": {"id": job.pk, "name": job.name, "state": job.state} if job else None,
            "incident": alert.incident_id,
            "node": {"id": node.pk, "hostname": node.hostname} if node else None,
            "created_at": _iso(alert.created_at), "updated_at": _iso(alert.updated_at),
            "acknowledged_at": _iso(alert.acknowledged_at), "resolved_at": _iso(alert.resolved_at),
            "updates": alert.updates,
            "suppressed_updates": alert.suppressed_updates,
        },
        "evidence": alert.evidence,
    }


def test_message(channel, *, now, actor: str) -> dict:
    """A test-send: the real shape, marked as a test, so receivers can be checked end to end."""
    return {
        "version": VERSION,
        "action": "test",
        "sent_at": now.isoformat(),
        "alert": {
            "id": None, "key": f"test-{channel.pk}-{int(now.timestamp())}", "rule": "test", "severity": "info",
            "state": "resolved", "title": f"Nightwatch test alert for channel {channel.name!r}",
            "summary": f"Sent by {actor} to check that this channel delivers. Nothing is wrong.",
            "link": public_url("/"), "job": None, "incident": None, "node": None,
            "created_at": now.isoformat(), "updated_at": now.isoformat(), "acknowledged_at": None,
            "resolved_at": now.isoformat(),
            "updates": 0, "suppressed_updates": 0,
        },
        "evidence": {"test": True},
    }
