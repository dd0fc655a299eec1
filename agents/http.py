"""A tiny JSON-over-HTTP client for the control plane, on the standard library only.

Shared by the node agent and the training hooks, which both run where only the standard library
and torch can be assumed. The one distinction callers need is *answered* versus *unreachable*:

- 2xx and 4xx are answers: ``request`` returns ``(status, decoded JSON or {})``. A 4xx is the
  server deciding something (409 stale generation, 400 bad message) and retrying will not help.
- connection errors, timeouts and 5xx raise ``Unreachable``: the control plane could not decide,
  so the caller keeps the data (spool) and tries again later. A 503 from an overloaded control plane
  (admission control) carries ``Retry-After``: ``Unreachable.retry_after``, which ``retry_delay``
  honours with jitter, so a fleet refused at once does not come back at once.
"""

from __future__ import annotations

import http.client
import json
import random
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class Unreachable(Exception):
    """The control plane did not answer (connection refused, timeout, reset) or failed (5xx)."""

    def __init__(self, reason: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(reason)
        self.status = status
        #: seconds the server asked us to wait (``Retry-After`` of a 503), if it said
        self.retry_after = retry_after


def retry_delay(failures: int, *, base: float = 0.5, cap: float = 10.0, retry_after: float | None = None,
                rng: random.Random | None = None) -> float:
    """Seconds to wait before the next try after ``failures`` failures in a row (``failures`` >= 1).

    Exponential from ``base`` up to ``cap``, never sooner than the server's ``Retry-After`` (which
    may exceed ``cap``: the server knows its load), plus up to 50% jitter so that callers refused
    together spread out instead of returning together.
    """
    delay = min(cap, base * 2 ** (failures - 1))
    if retry_after is not None:
        delay = max(delay, retry_after)
    return delay * (1.0 + 0.5 * (rng or random).random())


class ControlPlaneClient:
    """``request(method, path, body)`` against ``base_url``, with bearer-token auth."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 5.0):
        scheme = urllib.parse.urlsplit(base_url).scheme
        if scheme not in ("http", "https"):
            # urlopen would also open file:// and ftp:// URLs; a control-plane URL is never one.
            raise ValueError(f"control plane URL must be http(s), got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        """Send one request; return (status, JSON object) for 2xx/4xx, raise ``Unreachable`` otherwise."""
        all_headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            # allow_nan=False: NaN is not JSON; messages must go through protocol.dump() first.
            data = json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
            all_headers["Content-Type"] = "application/json"
        if self.token:
            all_headers["Authorization"] = f"Bearer {self.token}"
        all_headers.update(headers or {})
        req = urllib.request.Request(  # noqa: S310 - scheme checked in __init__
            self.base_url + path, data=data, headers=all_headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as response:  # noqa: S310 - scheme checked
                return response.status, _decode(response.read())
        except urllib.error.HTTPError as error:
            if error.code >= 500:
                raise Unreachable(f"{method} {path}: HTTP {error.code}", status=error.code,
                                  retry_after=_retry_after(error.headers.get("Retry-After"))) from error
            return error.code, _decode(_read_quietly(error))
        # URLError and timeouts are OSErrors; HTTPException covers a reset half-way through a response.
        except (OSError, http.client.HTTPException) as error:
            raise Unreachable(f"{method} {path}: {error}") from error


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds; its HTTP-date form and anything malformed read as absent."""
    if value is None or not value.strip().isdigit():
        return None
    return min(float(value.strip()), 3600.0)


def _read_quietly(error: urllib.error.HTTPError) -> bytes:
    try:
        return error.read()
    except (OSError, http.client.HTTPException):
        return b""


def _decode(raw: bytes) -> dict[str, Any]:
    """The JSON object in a response body, or {} for an empty or non-object body."""
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
