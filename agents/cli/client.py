"""A small JSON client for the Nightwatch API: bearer token, problem-details errors, pagination."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field


@dataclass
class ApiError(Exception):
    """An answer other than 2xx, or no answer. ``errors`` are the problem's per-field reasons."""

    status: int  # 0: the control plane could not be reached
    title: str
    detail: str
    errors: list[dict] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"{self.status} {self.title}" if self.status else self.title
        return f"{head}: {self.detail}" if self.detail else head


class Client:
    def __init__(self, url: str, token: str | None, *, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def request(self, method: str, path: str, body: dict | None = None, *, params: dict | None = None,
                headers: dict | None = None):
        query = "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None}) if params else ""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}/api/v1{path}{query}", data=data, method=method)  # noqa: S310
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                raw = response.read()
        except urllib.error.HTTPError as error:
            raise _problem(error) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise ApiError(0, "control plane unreachable", f"{self.url}: {reason}") from None
        return json.loads(raw) if raw else None

    def get(self, path: str, **params):
        return self.request("GET", path, params=params or None)

    def post(self, path: str, body: dict, *, headers: dict | None = None):
        return self.request("POST", path, body, headers=headers)

    def list(self, path: str, *, limit: int = 100, **params) -> list[dict]:
        """The first ``limit`` items of a paginated list."""
        page = self.get(path, limit=limit, **params)
        return page["results"] if isinstance(page, dict) and "results" in page else page


def _problem(error: urllib.error.HTTPError) -> ApiError:
    try:
        body = json.loads(error.read() or b"{}")
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    return ApiError(error.code, str(body.get("title") or error.reason), str(body.get("detail") or ""),
                    list(body.get("errors") or []))
