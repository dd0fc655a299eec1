"""A real HTTP receiver on loopback for the alerts tests, channels pointing at it, and inline Celery.

The receiver records every request (headers and the exact body bytes) and answers with the
statuses it is told to, in order (then 200): a receiver that fails twice, then recovers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

WEBHOOK_SECRET = "s3cret-for-the-loopback-receiver"
PD_ROUTING_KEY = "R0UTINGKEY0123456789"


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> dict[str, Any]:
        return json.loads(self.body)


@dataclass
class Receiver:
    statuses: list[int] = field(default_factory=list)  # answered in order; then 200
    requests: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver.lock:
                    receiver.requests.append(Received(self.path, dict(self.headers), body))
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                payload = b'{"status":"ok"}' if status < 400 else b'{"error":"receiver broke"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def at(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.requests if r.path == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def alert_settings(settings):
    """Follow-ups unthrottled unless a test says otherwise; quick retries; the loopback receiver
    allow-listed (channels may reach no loopback address otherwise: alerts.channels.egress)."""
    settings.NIGHTWATCH = {**settings.NIGHTWATCH,
                           "ALERTS": {**settings.NIGHTWATCH["ALERTS"], "UPDATE_INTERVAL_S": 0, "MAX_ATTEMPTS": 3,
                                      "ALLOWED_NETWORKS": ["127.0.0.1/32"]},
                           "PUBLIC_URL": "https://nightwatch.example"}
    return settings


@pytest.fixture
def channels(db, receiver, alert_settings):
    """A webhook and a PagerDuty channel on the receiver, and an email channel: all take pages;
    the webhook also takes notifications."""
    from alerts.models import Channel

    return {
        "webhook": Channel.objects.create(name="hook", kind="webhook", url=receiver.url("/hook"),
                                          secret=WEBHOOK_SECRET, min_severity="info"),
        "pagerduty": Channel.objects.create(name="pd", kind="pagerduty", url=receiver.url("/pd"),
                                            secret=PD_ROUTING_KEY, min_severity="page"),
        "email": Channel.objects.create(name="mail", kind="email", emails=["oncall@example.com"],
                                        min_severity="page"),
    }
