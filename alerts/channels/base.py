"""What every transport shares: the outcome of one attempt, URL checks, and a JSON POST."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

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
    in the URL (they would be logged and shown); plain http only where allowed."""
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
    return None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A receiver's redirect is not followed: the signed body must reach the URL configured."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def post_json(url: str, body: bytes, headers: dict[str, str]) -> Outcome:
    """POST ``body`` once; a 2xx is success, anything else an outcome with the reason."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        # Checked when the channel was saved too; urlopen would also open file:// and ftp:// URLs.
        return Outcome(ok=False, error=f"refusing to POST to a non-http(s) URL {url[:100]!r}", permanent=True)
    request = urllib.request.Request(url, data=body, method="POST", headers={  # noqa: S310 (scheme checked)
        "Content-Type": "application/json", "User-Agent": USER_AGENT, **headers})
    try:
        with _OPENER.open(request, timeout=HTTP_TIMEOUT_S) as response:
            return Outcome(ok=True, status_code=response.status)
    except urllib.error.HTTPError as exc:
        status = exc.code
        detail = exc.read(300).decode("utf-8", "replace").strip()
        permanent = 400 <= status < 500 and status not in (408, 429)
        return Outcome(ok=False, status_code=status, permanent=permanent,
                       error=f"HTTP {status} {exc.reason}" + (f": {detail}" if detail else ""))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return Outcome(ok=False, error=f"{type(exc).__name__}: {reason}")


def dumps(message: dict) -> bytes:
    return json.dumps(message, sort_keys=True, separators=(",", ":"), default=str).encode()
