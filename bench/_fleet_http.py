"""A small asyncio HTTP/1.1 client for the fleet simulator, and the latency book it keeps.

``agents.http`` is what real agents and hooks use, but it blocks a thread per request: a thousand
simulated nodes with eight ranks each cannot have a thread per request in a few processes. This
client speaks the same JSON over keep-alive connections (a bounded pool per server for bulk
data, as many nodes behind one load balancer would; each agent's heartbeats on a connection of
their own, as its heartbeat thread sends them), and answers the same way: 2xx/4xx are answers, 5xx and
connection failures are ``Unreachable`` carrying the 503's ``Retry-After``, so callers back off
with ``agents.http.retry_delay`` exactly as the agent and the reporter do.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from typing import Any

from agents.http import Unreachable, _retry_after

#: Latency histogram buckets: 5% apart from 0.5 ms to ~2 minutes, so merged books give
#: percentiles within 5% without keeping every sample.
_BUCKET_BASE = 0.0005
_BUCKET_GROWTH = 1.05
_BUCKETS = 260


def bucket(seconds: float) -> int:
    if seconds <= _BUCKET_BASE:
        return 0
    return min(_BUCKETS - 1, int(math.log(seconds / _BUCKET_BASE, _BUCKET_GROWTH)) + 1)


def bucket_seconds(index: int) -> float:
    return _BUCKET_BASE * _BUCKET_GROWTH ** index


class Book:
    """Per endpoint class: a latency histogram and a count per answer (``0``: no answer)."""

    def __init__(self) -> None:
        self.latency: dict[str, Counter[int]] = {}
        self.status: dict[str, Counter[int]] = {}

    def note(self, endpoint: str, status: int, seconds: float) -> None:
        self.latency.setdefault(endpoint, Counter())[bucket(seconds)] += 1
        self.status.setdefault(endpoint, Counter())[status] += 1

    def as_json(self) -> dict[str, Any]:
        return {"latency": {k: dict(v) for k, v in self.latency.items()},
                "status": {k: dict(v) for k, v in self.status.items()}}


def merge(books: list[dict[str, Any]]) -> dict[str, dict[str, Counter[int]]]:
    """Books written by several simulator processes, added up (JSON keys back to ints)."""
    merged: dict[str, dict[str, Counter[int]]] = {"latency": {}, "status": {}}
    for book in books:
        for part in ("latency", "status"):
            for endpoint, counts in book[part].items():
                merged[part].setdefault(endpoint, Counter()).update({int(k): v for k, v in counts.items()})
    return merged


def percentile(histogram: Counter[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a latency histogram, in seconds (the bucket's upper edge)."""
    total = sum(histogram.values())
    if not total:
        return None
    wanted, seen = q * total, 0
    for index in sorted(histogram):
        seen += histogram[index]
        if seen >= wanted:
            return bucket_seconds(index)
    return bucket_seconds(max(histogram))


class Connection:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def exchange(self, raw: bytes, timeout: float) -> tuple[int, dict[str, str], bytes]:
        """One request and its answer within ``timeout``, connecting first if need be: the connect is
        inside the timeout, as it is in ``urllib`` (a server whose accept queue is full would
        otherwise hold a caller for the kernel's SYN retries, a minute or more)."""
        return await asyncio.wait_for(self._exchange(raw), timeout)

    async def _exchange(self, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        kept = self.writer is not None
        try:
            return await self._send(raw)
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            # A kept-alive connection that the server closed while it sat idle (daphne, as Twisted,
            # after 60 s) took none of the request: it is sent once more on a new connection, as
            # urllib3 does. Without it, a pool used only now and then (a node's events: at a fault)
            # failed a third of its requests and its Xid reached the control plane 94 s late.
            answered = isinstance(error, asyncio.IncompleteReadError) and error.partial
            if not kept or answered:
                raise
            self.close()
            return await self._send(raw)

    async def _send(self, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(raw)
        return await self._response(self.reader)

    @staticmethod
    async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = await _chunked(reader)
        else:
            body = await reader.read()
        return status, headers, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readline()).split(b";")[0].strip(), 16)
        if size == 0:
            await reader.readline()
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readline()


class Client:
    """JSON requests over a pool of ``connections`` keep-alive connections to ``port``."""

    def __init__(self, port: int, book: Book, *, connections: int, timeout: float = 5.0, host: str = "127.0.0.1"):
        self.host, self.port, self.book, self.timeout = host, port, book, timeout
        self._idle: asyncio.Queue[Connection] = asyncio.Queue()
        for _ in range(connections):
            self._idle.put_nowait(Connection(host, port))

    async def request(self, endpoint: str, method: str, path: str, token: str | None = None,
                      body: Any = None, *, source: str | None = None,
                      headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        """Like ``agents.http.ControlPlaneClient.request``; ``endpoint`` names the class it is booked under.

        ``source`` is the simulated node's own address, passed as the TLS proxy in front of the web
        processes would (``X-Forwarded-For``): per-address limits must see a thousand nodes, not one."""
        data = b"" if body is None else json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Accept: application/json",
                f"Content-Length: {len(data)}"]
        if body is not None:
            head.append("Content-Type: application/json")
        if token:
            head.append(f"Authorization: Bearer {token}")
        if source:
            head.append(f"X-Forwarded-For: {source}")
        head.extend(f"{name}: {value}" for name, value in (headers or {}).items())
        raw = ("\r\n".join(head) + "\r\n\r\n").encode() + data
        connection = await self._idle.get()
        started = time.monotonic()
        try:
            status, headers, answer = await connection.exchange(raw, self.timeout)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, IndexError) as error:
            connection.close()
            self.book.note(endpoint, 0, time.monotonic() - started)
            raise Unreachable(f"{method} {path}: {error!r}") from error
        finally:
            self._idle.put_nowait(connection)
        self.book.note(endpoint, status, time.monotonic() - started)
        if headers.get("connection", "").lower() == "close":
            connection.close()
        if status >= 500:
            raise Unreachable(f"{method} {path}: HTTP {status}", status=status,
                              retry_after=_retry_after(headers.get("retry-after")))
        try:
            decoded = json.loads(answer) if answer else {}
        except ValueError:
            decoded = {}
        return status, decoded if isinstance(decoded, dict) else {}
