"""agents.http.ControlPlaneClient against a real local HTTP server: answers versus unreachable."""

from __future__ import annotations

import json
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agents.http import ControlPlaneClient, Unreachable, retry_delay


@pytest.fixture
def server():
    """Answers ``/status/<code>`` with that status and echoes what it got; ``/slow`` never answers in time."""
    seen = []
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _handle(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            seen.append({"method": self.command, "path": self.path, "body": body,
                         "auth": self.headers.get("Authorization"), "type": self.headers.get("Content-Type")})
            if self.path == "/slow":
                release.wait(5)
            status = int(self.path.split("/")[2]) if self.path.startswith("/status/") else 200
            payload = b"not json" if self.path.endswith("/garbage") else json.dumps({"echo": body}).encode()
            self.send_response(status)
            if self.headers.get("X-Answer-Retry-After") is not None:  # the test says what the server says
                self.send_header("Retry-After", self.headers["X-Answer-Retry-After"])
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _handle  # noqa: N815 - http.server's naming

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    httpd.seen = seen
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield httpd
    release.set()
    httpd.shutdown()
    httpd.server_close()


def test_a_2xx_answer_returns_status_and_json_and_sends_the_bearer_token(server):
    client = ControlPlaneClient(server.url + "/", token="s3cret")
    status, body = client.request("POST", "/status/202", {"n": 1})
    assert (status, body) == (202, {"echo": {"n": 1}})
    assert server.seen[0]["auth"] == "Bearer s3cret"
    assert server.seen[0]["type"] == "application/json"
    assert server.seen[0]["path"] == "/status/202"  # the trailing slash of the base URL is not doubled


@pytest.mark.parametrize("status", [400, 404, 409])
def test_a_4xx_is_an_answer_not_an_outage(server, status):
    assert ControlPlaneClient(server.url).request("POST", f"/status/{status}", {"x": 1}) == (status, {"echo": {"x": 1}})


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_5xx_means_the_control_plane_could_not_decide(server, status):
    with pytest.raises(Unreachable) as raised:
        ControlPlaneClient(server.url).request("GET", f"/status/{status}")
    assert raised.value.status == status


def test_a_body_that_is_not_a_json_object_reads_as_empty(server):
    assert ControlPlaneClient(server.url).request("GET", "/status/200/garbage") == (200, {})


def test_no_token_means_no_authorization_header(server):
    ControlPlaneClient(server.url).request("GET", "/status/200")
    assert server.seen[0]["auth"] is None


def test_a_refused_connection_is_unreachable():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(Unreachable):
        ControlPlaneClient(f"http://127.0.0.1:{port}", timeout=2).request("GET", "/anything")


def test_a_timeout_is_unreachable(server):
    with pytest.raises(Unreachable):
        ControlPlaneClient(server.url, timeout=0.2).request("GET", "/slow")


def test_nan_is_refused_before_anything_is_sent(server):
    with pytest.raises(ValueError):
        ControlPlaneClient(server.url).request("POST", "/status/200", {"loss": float("nan")})
    assert server.seen == []


def test_only_http_urls_are_accepted():
    with pytest.raises(ValueError, match="http"):
        ControlPlaneClient("file:///etc/passwd")


@pytest.mark.parametrize("header, seconds", [("3", 3.0), (" 2 ", 2.0), ("Wed, 21 Oct 2026 07:28:00 GMT", None),
                                             ("-1", None), ("soon", None), ("99999", 3600.0)])
def test_a_503_carries_the_servers_retry_after_in_whole_seconds(server, header, seconds):
    with pytest.raises(Unreachable) as raised:
        ControlPlaneClient(server.url).request("POST", "/status/503", {"x": 1},
                                               headers={"X-Answer-Retry-After": header})
    assert raised.value.status == 503 and raised.value.retry_after == seconds


def test_retry_delay_grows_to_its_cap_never_undercuts_retry_after_and_is_jittered():
    rng = random.Random(7)
    plain = [retry_delay(n, base=0.5, cap=4.0, rng=rng) for n in range(1, 7)]
    for n, delay in enumerate(plain, start=1):
        floor = min(4.0, 0.5 * 2 ** (n - 1))
        assert floor <= delay <= 1.5 * floor
    asked = [retry_delay(1, base=0.5, cap=4.0, retry_after=10.0, rng=rng) for _ in range(200)]
    assert min(asked) >= 10.0 and max(asked) <= 15.0
    assert len({round(d, 3) for d in asked}) > 100  # spread out, not one instant for the whole fleet
