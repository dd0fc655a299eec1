"""HTTP from a chosen loopback address, to stand for clients behind the documented TLS proxy.

Linux answers on all of 127.0.0.0/8, so a connection bound to ``127.0.0.2`` reaches the cluster's
daphne (listening on 127.0.0.1) with ``REMOTE_ADDR`` 127.0.0.2: the tests' proxy, trusted when the
cluster runs with ``TRUSTING_THE_PROXY``. Plain connections come from 127.0.0.1, an untrusted peer.
"""

from __future__ import annotations

import http.client
import re
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

PROXY = "127.0.0.2"
#: The cluster's environment for "the TLS proxy at PROXY sets X-Forwarded-For".
TRUSTING_THE_PROXY = {"NIGHTWATCH_TRUSTED_PROXIES": f"{PROXY}/32"}


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    text: str


class Peer:
    """One keep-alive connection from ``source``, with the cookies the server set."""

    def __init__(self, url: str, source: str = "127.0.0.1"):
        parts = urlsplit(url)
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30,
                                                     source_address=(source, 0))
        self.cookies: dict[str, str] = {}

    def request(self, method: str, path: str, *, headers: dict | None = None, form: dict | None = None) -> Answer:
        headers = dict(headers or {})
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{name}={value}" for name, value in self.cookies.items())
        body = None
        if form is not None:
            body = urlencode(form)
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        self.connection.request(method, path, body=body, headers=headers)
        response = self.connection.getresponse()
        answer = Answer(response.status, response.headers, response.read().decode(errors="replace"))
        for cookie in response.headers.get_all("Set-Cookie") or []:
            name, _, rest = cookie.partition("=")
            self.cookies[name.strip()] = rest.split(";")[0]
        return answer

    def sign_in(self, path: str, username: str, password: str, *, client: str | None = None) -> Answer:
        """Fill in the login form at ``path`` (the dashboard's or the admin's), as ``client`` behind the proxy."""
        headers = {"X-Forwarded-For": client} if client else {}
        form = self.request("GET", path, headers=headers)
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
        assert csrf, form.text[:500]
        return self.request("POST", path, headers=headers, form={
            "csrfmiddlewaretoken": csrf.group(1), "username": username, "password": password})

    def close(self) -> None:
        self.connection.close()
