"""What every transport shares: the outcome of one attempt, URL checks, and a JSON POST."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import dataclass

from alerts.channels import egress

#: Seconds one HTTP attempt may take; a slow receiver must not hold a worker for long.
HTTP_TIMEOUT_S = 10.0
USER_AGENT = "Nightwatch-Alerts/1"


@dataclass(frozen=True)
class Outcome:
    ok: bool
    status_code: int | None = None
    error: str = ""
    #: A 4xx other than 408/429 means the receiver refuses this message: retrying cannot help.
    permanent: bool = False


def url_problem(url: str, *, allow_http: bool) -> str | None:
    """Why ``url`` cannot be an alert endpoint, or None. Only http(s) with a host; no credentials
    in the URL (they would be logged and shown); plain http only where allowed; a host that
    resolves to a public address (or is allow-listed, ``egress``)."""
    if not url:
        return "required"
    if len(url) > 2000:
        return "at most 2000 characters"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises ValueError for a malformed port
    except ValueError as exc:
        return f"not a valid URL: {exc}"
    if parts.scheme not in ("https", "http"):
        return f"must be an https:// URL, got scheme {parts.scheme or 'none'!r}"
    if parts.scheme == "http" and not allow_http:
        return "must be https:// (plain http is allowed only with NIGHTWATCH_ALERTS_ALLOW_HTTP)"
    if not parts.hostname:
        return "has no host"
    if parts.username or parts.password:
        return "must not carry credentials; use the channel's secret instead"
    if port == 0:
        return "port 0 is not a port"
    if any(ch.isspace() for ch in url):
        return "must not contain whitespace"
    return egress.destination_problem(url)


def post_json(url: str, body: bytes, headers: dict[str, str]) -> Outcome:
    """POST ``body`` once to a checked destination (``egress``); a 2xx is success. The outcome
    keeps the status code or the error's class, never the receiver's answer: whoever reads the
    delivery log must not be able to read a private service through it."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        # Checked when the channel was saved too.
        return Outcome(ok=False, error="refusing to POST to a non-http(s) URL", permanent=True)
    try:
        status = egress.post(url, body, {"Content-Type": "application/json", "User-Agent": USER_AGENT, **headers},
                             timeout=HTTP_TIMEOUT_S)
    except egress.RefusedDestination as exc:
        return Outcome(ok=False, error=f"RefusedDestination: {exc}", permanent=True)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Outcome(ok=False, error=error_class(exc))
    if 200 <= status < 300:
        return Outcome(ok=True, status_code=status)
    # A redirect is not followed (the signed body must reach the URL configured) and will not go away.
    permanent = 300 <= status < 400 or (400 <= status < 500 and status not in (408, 429))
    return Outcome(ok=False, status_code=status, permanent=permanent, error=f"HTTP {status}")


def error_class(exc: BaseException) -> str:
    """The exception's class, with the operating system's reason where there is one ("Connection
    refused"): never its message, which may quote what the receiver sent (a bad status line)."""
    reason = getattr(exc, "strerror", None)
    return f"{type(exc).__name__}: {reason}" if isinstance(reason, str) and reason else type(exc).__name__


def dumps(message: dict) -> bytes:
    return json.dumps(message, sort_keys=True, separators=(",", ":"), default=str).encode()
