"""A tiny JSON-over-HTTP client for the control plane, on the standard library only.

Shared by the node agent and the training hooks, which both run where only the standard library
and torch can be assumed. The one distinction callers need is *answered* versus *unreachable*:

- 2xx and 4xx are answers: ``request`` returns ``(status, decoded JSON or {})``. A 4xx is the
  server deciding something (409 stale generation, 400 bad message) and retrying will not help.
- connection errors, timeouts and 5xx raise ``Unreachable``: the control plane could not decide,
  so the caller keeps the data (spool) and tries again later.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class Unreachable(Exception):
    """The control plane did not answer (connection refused, timeout, reset) or failed (5xx)."""

    def __init__(self, reason: str, status: int | None = None):
        super().__init__(reason)
        self.status = status


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
                raise Unreachable(f"{method} {path}: HTTP {error.code}", status=error.code) from error
            return error.code, _decode(_read_quietly(error))
        # URLError and timeouts are OSErrors; HTTPException covers a reset half-way through a response.
        except (OSError, http.client.HTTPException) as error:
            raise Unreachable(f"{method} {path}: {error}") from error


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
