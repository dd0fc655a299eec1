"""Admission control: a bound on the HTTP requests one web process works on at once.

Without it, a control plane offered more than it can serve collapses instead of levelling off:
every request it accepts waits behind all the others, answers arrive after the callers gave up,
the callers resend, and throughput falls as load rises (issue 18's probe: 2.9 step reports a second
accepted out of 1,024 offered; PostgreSQL out of connections). With it, the process works on at
most ``limit`` requests; the next one is answered at once with ``503`` and ``Retry-After``, which the
agents and the training hooks honour with jittered backoff while their spools keep everything.

Not every request is worth the same. An agent's events carry the exits and Xids that start a
recovery, its command acks the launches and stops that carry one out: ``urgent`` requests may use
the whole bound. A heartbeat that does not get through today makes the sweeper call a live node
unreachable tomorrow: ``priority`` requests (heartbeats, registration, and the writes of
``priority_writes`` URLs: the hooks' checkpoint commits, few, which the rest of their reports queue
behind) leave ``urgent_reserve`` slots free for the urgent ones, and so do an operator's actions
(``operator``: submit, cancel, pause, drain… — writes to the URLs named, never reads): they are few,
and an overload is when they matter (23 job submissions took 6-8 minutes of 503s behind a 1,024-node
fleet's heartbeats when they were bulk). Bulk data (step reports, telemetry, the hooks' events) and
everything else leave ``reserve`` slots free for both. The urgent
slots matter at fleet scale: 1,088 agents each heartbeating on their own connection keep a
shedding server's bound full of heartbeats, and with one class for both an exit report was refused
as often as a heartbeat and reached the control plane 20 s after the rank died (bench.fleet,
2026-12-02). A refused heartbeat costs nothing (its node is spared, ``core.refusals``); a refused
exit delays the recovery. Probes (``exempt``: liveness, readiness) are always admitted: an
orchestrator must not restart a process for being busy.

ASGI middleware, in front of Django: it counts on the event loop, before a request queues for
Django's thread, so "in flight" includes the requests waiting for it. One event loop per process,
so a plain integer is the counter.

What it refused, and the heartbeats it answered late (``late_s`` after they arrived: queued behind
other work), are also added to counts every web process shares (``core.shared_counts``): the
heartbeat sweeper reads them to tell a silent node from a control plane that could not keep up
(``nodes.services.overload``), and ``/metrics`` exports them. So is *who* was refused: the
SHA-256 of the bearer token of each refused request that would have proved its caller alive
(``witnesses``: an agent's requests, the hooks' step reports and checkpoint commits; never the
token), so that the sweepers can tell a node or a job whose requests we turned away (alive, and our fault) from one
that fell silent. A witness admitted but given up by its caller before it was answered (its timeout
ran out while it waited for Django's thread, and Django drops a request on the disconnect) is recorded
the same way (``abandoned:<class>`` in the counts): it was neither refused nor served. (In bench.fleet's
run M a 512-node job's rank 0 got no report through for 28 s, with no refusal recorded, and the job was
declared hung; that its reports were given up in the queue is the likely cause, not a proven one.)
Hashing is the only work a refusal does for it; the sweepers map digests to tokens, so a
made-up token names nobody. All of it is batched in memory and handed to Redis from a thread at
most once per ``FLUSH_S``, so a 503 never waits on Redis and never fails because of it.

A heartbeat is how an agent fetches its commands, so one that carries a launch or a stop is worth
more than the others: the heartbeats of ``carriers`` URLs whose bearer token's digest is among
those with open commands (``core.shared_counts.awaited_heartbeats``, written by
``nodes.services.commands``) are urgent. The set is read from Redis in a thread at most once per
``FLUSH_S``, and kept as it was while Redis does not answer. Without it, a launch waited minutes for
a heartbeat of its node to get through a 1,024-node fleet's 503s (bench.fleet, 2026-12-03).

The bounds say how many of each class may *wait*; the order they are *served* in is the gate's
(``Gate``, ``width`` > 0). Django runs a process's views one at a time, in the order they reach its
thread, so bounds alone serve the classes in proportion to the slots each holds: at 1,024 nodes
bulk telemetry held 12 of the 16 and heartbeats were admitted at 0.7 a second for 1,088 nodes
(bench.fleet, 2026-12-03). The gate lets ``width`` admitted requests into the application at once
and holds the rest in a queue per class: urgent ones go first, then heartbeats and an operator's
actions and bulk share what is left, ``share`` of the first for each bulk one while both wait
(bulk is never starved: its step reports are what the hang sweep reads).

How long a refused caller is asked to wait follows how much more bulk is offered than taken
(``Pressure``). With one fixed second, every refused telemetry batch and step report came back a
second later to be refused again: at 1,024 nodes the fleet offered 160-314 requests a second for
58-75 taken, and most of what the server did for bulk was say no (bench.fleet, 2026-12-04). A
refused bulk request is asked to wait ``retry_after_s`` × offered / admitted over the last 5-10 s,
at most ``retry_after_max_s``: callers spread over the time the server needs to take them. The
other classes are always asked for ``retry_after_s``: they are few, and their wait is a verdict's.
The jobs' hang sweep spares a refused job for 1.5 × the longest wait (``jobs.progress``).

Of a job's step reports only rank 0's move its progress, and every rank of a generation shares
one token. So the hooks say which they send (``agents.protocol.hooks.PROGRESS_HEADER``) on the
``progress`` URLs: rank 0's (``1``) are admitted like heartbeats, at most one per token every
``PROGRESS_GAP_S`` (the reporter sends one a second; a job that marks every request gets the rest
admitted as bulk); another rank's (``0``) are bulk and, refused, prove nothing (the sweep would
otherwise spare a hung job for as long as any of its thousands of ranks had a spooled report
refused: hangs at 1,024 nodes were found 25-30 s after the fault against 22, bench.fleet 2026-12-04).
A request without the header (older hooks) is bulk and a witness, as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.urls import Resolver404, resolve

from agents.protocol import hooks as hooks_protocol
from core import shared_counts
from core.models import hash_token
from core.problems import CONTENT_TYPE, problem

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

URGENT = "urgent"
PRIORITY = "priority"
OPERATOR = "operator"
EXEMPT = "exempt"
OTHER = "other"
#: The classes a request can be refused in, as ``refused:<class>`` in the shared counts.
REFUSABLE = (URGENT, PRIORITY, OPERATOR, OTHER)
#: The gate's queue of each class that has none of its own.
OPERATOR_LANE = {OPERATOR: PRIORITY}
#: The methods that read: an operator's reads (pages, lists) are bulk, however few.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: Shared counts are handed to Redis at most this often per process.
FLUSH_S = 1.0
#: Bulk offered and admitted are counted in windows of this long; the last two make the pressure.
PRESSURE_WINDOW_S = 5.0
#: A token's progress reports are admitted ahead of bulk at most once per this many seconds.
PROGRESS_GAP_S = 0.5
PROGRESS_HEADER = hooks_protocol.PROGRESS_HEADER.lower().encode("ascii")


@dataclass
class Counters:
    """What this process admitted and refused, by class (for logs and /metrics)."""

    in_flight: int = 0
    peak: int = 0
    admitted: dict[str, int] = field(default_factory=lambda: dict.fromkeys((*REFUSABLE, EXEMPT), 0))
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSABLE, 0))


class SharedTally:
    """Counts waiting to be added to ``core.shared_counts``: the event loop adds to them, a thread
    hands them over (one at a time; a batch Redis did not take is dropped, and logged there)."""

    def __init__(self):
        self.pending: Counter[str] = Counter()
        self.callers: dict[str, float] = {}  # refused token digest -> when (Unix time)
        self.since = 0.0  # wall time of the oldest pending count: the second they are filed under
        self.flushed_at = 0.0
        self.flushing: asyncio.Future | None = None

    def add(self, name: str) -> None:
        if not self.pending:
            self.since = time.time()
        self.pending[name] += 1
        self.flush_if_due()

    def refused_caller(self, digest: str) -> None:
        self.callers[digest] = time.time()

    def flush_if_due(self) -> None:
        now = time.monotonic()
        if not self.pending or (self.flushing and not self.flushing.done()) or now - self.flushed_at < FLUSH_S:
            return
        batch, self.pending = dict(self.pending), Counter()
        callers, self.callers = self.callers, {}
        self.flushed_at = now
        self.flushing = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(shared_counts.add, batch, at=self.since, refused=callers))


class Pressure:
    """How many bulk requests were offered for each one admitted, over the current window and the
    one before it (``window_s`` each: the figure moves as fast as the load, but not on one burst)."""

    def __init__(self, window_s: float = PRESSURE_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self.current = [0, 0]  # offered, admitted
        self.previous = [0, 0]

    def count(self, admitted: bool) -> None:
        self._roll()
        self.current[0] += 1
        self.current[1] += admitted

    def ratio(self) -> float:
        """Offered / admitted (1.0 with nothing offered; the offered count when nothing was admitted)."""
        self._roll()
        offered, admitted = self.current[0] + self.previous[0], self.current[1] + self.previous[1]
        return offered / max(admitted, 1) if offered else 1.0

    def _roll(self) -> None:
        windows = int((self.clock() - self.started) // self.window_s)
        if windows >= 1:
            self.previous = self.current if windows == 1 else [0, 0]
            self.current = [0, 0]
            self.started += windows * self.window_s


def bearer_token(scope: Scope) -> str | None:
    """The raw token of an ``Authorization: Bearer`` header, unchecked (None: none, or not readable)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() != b"bearer" or not token.strip():
                return None
            try:
                return token.strip().decode("ascii")
            except UnicodeDecodeError:
                return None
    return None


def _digest(scope: Scope) -> str | None:
    token = bearer_token(scope)
    return hash_token(token) if token is not None else None


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return value.strip()
    return None


class ProgressPace:
    """When each token last had a progress report admitted ahead of bulk (``PROGRESS_GAP_S``)."""

    #: Tokens remembered; past it, those not seen for a minute are forgotten.
    KEEP = 10_000

    def __init__(self, gap_s: float = PROGRESS_GAP_S, clock: Callable[[], float] = time.monotonic):
        self.gap_s, self.clock = gap_s, clock
        self.last: dict[str, float] = {}

    def allows(self, digest: str) -> bool:
        now = self.clock()
        if now - self.last.get(digest, float("-inf")) < self.gap_s:
            return False
        if len(self.last) >= self.KEEP:
            self.last = {d: at for d, at in self.last.items() if now - at < 60.0}
        self.last[digest] = now
        return True


class AwaitedHeartbeats:
    """The token digests whose heartbeats carry commands, as last read from Redis (a thread reads
    them at most once per ``FLUSH_S``; an answer of "unknown" keeps the last set)."""

    def __init__(self, within_s: float):
        self.within_s = within_s
        self.digests: frozenset[str] = frozenset()
        self.read_at = float("-inf")
        self.reading: asyncio.Future | None = None

    def any(self) -> bool:
        """Whether any node carries commands now (a read is started when due): the request path
        hashes a heartbeat's token only then, as it otherwise does only for a refusal."""
        self.refresh_if_due()
        return bool(self.digests)

    def carries(self, digest: str) -> bool:
        return digest in self.digests

    def refresh_if_due(self) -> None:
        now = time.monotonic()
        if now - self.read_at < FLUSH_S or (self.reading is not None and not self.reading.done()):
            return
        self.read_at = now
        self.reading = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(shared_counts.awaited_heartbeats, self.within_s, now=time.time()))
        self.reading.add_done_callback(self._read)

    def _read(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None and (digests := future.result()) is not None:
            self.digests = digests


class Gate:
    """At most ``width`` requests inside the application at once; the others wait in a queue per
    class and enter as those inside leave: urgent first, then ``share`` priority or operator
    requests for each bulk one while both kinds wait (first come, first served within a queue)."""

    def __init__(self, width: int, share: int):
        if width < 1 or share < 1:
            raise ValueError(f"admission gate: need width >= 1 and share >= 1, got width={width} share={share}")
        self.width = width
        self.share = share
        self.inside = 0
        self.queues: dict[str, collections.deque[asyncio.Future]] = {
            URGENT: collections.deque(), PRIORITY: collections.deque(), OTHER: collections.deque()}
        self.served_since_bulk = 0

    @staticmethod
    def lane(kind: str) -> str:
        """The queue of a class: an operator's actions wait with the heartbeats."""
        return OPERATOR_LANE.get(kind, kind)

    def waiting(self) -> int:
        return sum(len(q) for q in self.queues.values())

    async def enter(self, kind: str) -> None:
        """Return once the request may go in (``leave`` must follow, also if the caller is cancelled)."""
        if self.inside < self.width and not self.waiting():
            self.inside += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self.queues[self.lane(kind)].append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed the place just as the caller went away
                self.leave()
            else:
                with contextlib.suppress(ValueError):  # a ``leave`` may have passed over it already
                    self.queues[self.lane(kind)].remove(turn)
            raise

    def leave(self) -> None:
        """One request left the application: the next in turn goes in, if any waits."""
        while (turn := self._next()) is not None:
            if not turn.done():
                turn.set_result(None)  # the place passes to it: ``inside`` stays
                return
        self.inside -= 1

    def _next(self) -> asyncio.Future | None:
        urgent, priority, bulk = self.queues[URGENT], self.queues[PRIORITY], self.queues[OTHER]
        if urgent:
            return urgent.popleft()
        if priority and (not bulk or self.served_since_bulk < self.share):
            self.served_since_bulk += 1
            return priority.popleft()
        if bulk:
            self.served_since_bulk = 0
            return bulk.popleft()
        return None


#: The ASGI scope key of a long poll's ``release()``: called once its caller is authorised and it
#: starts waiting, it gives back the request's slot (in flight, and the gate's), so that waiting
#: requests never fill the bound. ``nodes.services.wake``'s command wait calls it.
RELEASE = "nightwatch.admission.release"


class _Slot:
    """One admitted request's place: in flight until released, and in the gate once entered."""

    def __init__(self, counters: Counters, gate: Gate | None):
        self.counters, self.gate = counters, gate
        self.entered = self.released = False

    async def enter(self, kind: str) -> None:
        if self.gate is not None:
            await self.gate.enter(kind)
            self.entered = True

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.counters.in_flight -= 1
        if self.entered:
            assert self.gate is not None
            self.gate.leave()


class Admission:
    """Wraps an ASGI HTTP application; ``limit`` 0 turns admission control off, ``width`` 0 the gate
    (admitted requests then all go in at once, served in the order they reach Django's thread)."""

    def __init__(self, app, *, limit: int, reserve: int, retry_after_s: int, retry_after_max_s: int | None = None,
                 urgent_reserve: int = 0,
                 urgent: Collection[str] = (), priority: Collection[str] = (), priority_writes: Collection[str] = (),
                 operator: Collection[str] = (),
                 exempt: Collection[str] = (), witnesses: Collection[str] = (), carriers: Collection[str] = (),
                 long_polls: Collection[str] = (), progress: Collection[str] = (),
                 late_s: float | None = None, awaited_within_s: float = 600.0, width: int = 0, share: int = 3):
        if limit < 0 or not 0 <= urgent_reserve <= reserve or (limit and reserve >= limit):
            raise ValueError(f"admission: need 0 <= urgent_reserve <= reserve < limit (or limit 0: off), got "
                             f"limit={limit} reserve={reserve} urgent_reserve={urgent_reserve}")
        if retry_after_s < 1:
            raise ValueError(f"admission: Retry-After is whole seconds, at least 1, got {retry_after_s}")
        retry_after_max_s = retry_after_s if retry_after_max_s is None else retry_after_max_s
        if retry_after_max_s < retry_after_s:
            raise ValueError(f"admission: the longest Retry-After ({retry_after_max_s} s) is shorter than the "
                             f"shortest ({retry_after_s} s)")
        self.app = app
        self.limit = limit
        self.reserve = reserve
        self.urgent_reserve = urgent_reserve
        self._bounds = {URGENT: limit, PRIORITY: limit - urgent_reserve, OPERATOR: limit - urgent_reserve,
                        OTHER: limit - reserve}
        self.retry_after_s = retry_after_s
        self.retry_after_max_s = retry_after_max_s
        self.pressure = Pressure()
        self.urgent = frozenset(urgent)
        self.priority = frozenset(priority)
        self.priority_writes = frozenset(priority_writes)
        self.operator = frozenset(operator)
        self.exempt = frozenset(exempt)
        self.witnesses = frozenset(witnesses)
        self.carriers = frozenset(carriers)
        self.long_polls = frozenset(long_polls)
        self.progress = frozenset(progress)
        self.progress_pace = ProgressPace()
        self.awaited = AwaitedHeartbeats(awaited_within_s)
        self.counters = Counters()
        self.late_s = (settings.NIGHTWATCH["OVERLOAD_HEARTBEAT_LAG_S"] or settings.NIGHTWATCH["HEARTBEAT_INTERVAL_S"]
                       if late_s is None else late_s)
        self.shared = SharedTally()
        self.gate = Gate(width, share) if limit and width else None

    def classify(self, path: str, method: str = "GET") -> str:
        """The class of a request, by the name of the URL it resolves to (unknown paths: ``other``)
        and, for an operator's URLs, its method."""
        return self._route(path, method)[0]

    def _route(self, path: str, method: str) -> tuple[str, str | None]:
        try:
            name = resolve(path).url_name
        except Resolver404:
            return OTHER, None
        if name in self.exempt:
            return EXEMPT, name
        if name in self.urgent:
            return URGENT, name
        if name in self.priority or (name in self.priority_writes and method not in SAFE_METHODS):
            return PRIORITY, name
        return OPERATOR if name in self.operator and method not in SAFE_METHODS else OTHER, name

    def admits(self, kind: str) -> bool:
        if not self.limit or kind == EXEMPT:
            return True
        return self.counters.in_flight < self._bounds[kind]

    def retry_after(self, kind: str) -> int:
        """The whole seconds a refused request of ``kind`` is asked to wait."""
        if kind != OTHER:
            return self.retry_after_s
        return min(self.retry_after_max_s, math.ceil(self.retry_after_s * self.pressure.ratio()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        kind, name = self._route(scope["path"], scope.get("method", "GET"))
        counters = self.counters
        digest = None
        witness = name in self.witnesses
        if kind == PRIORITY and name in self.carriers and self.limit and self.awaited.any():
            digest = _digest(scope)
            if digest is not None and self.awaited.carries(digest):
                kind = URGENT
        if name in self.progress and self.limit:
            claim = _header(scope, PROGRESS_HEADER)
            if claim == b"0":
                witness = False
            elif claim == b"1" and (digest := _digest(scope)) is not None and self.progress_pace.allows(digest):
                kind = PRIORITY
        admitted = self.admits(kind)
        if kind == OTHER and self.limit:
            self.pressure.count(admitted)
        if not admitted:
            counters.refused[kind] += 1
            if witness and (digest := digest or _digest(scope)) is not None:
                self.shared.refused_caller(digest)
            self.shared.add(f"refused:{kind}")
            await self._refuse(scope, send, kind)
            return
        counters.admitted[kind] += 1
        counters.in_flight += 1
        counters.peak = max(counters.peak, counters.in_flight)
        arrived = time.monotonic()
        slot = _Slot(counters, self.gate if kind != EXEMPT else None)
        if name in self.long_polls:
            scope = {**scope, RELEASE: slot.release}
        answered = False

        async def answering(message: dict) -> None:
            nonlocal answered
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            await slot.enter(kind)
            await self.app(scope, receive, answering if witness else send)
        finally:
            slot.release()
            if witness and not answered:  # its caller gave up waiting for us: alive, and our fault
                if (digest := digest or _digest(scope)) is not None:
                    self.shared.refused_caller(digest)
                self.shared.add(f"abandoned:{kind}")
            if kind == PRIORITY and name in self.priority and 0 < self.late_s <= time.monotonic() - arrived:
                self.shared.add("late:priority")
            else:
                self.shared.flush_if_due()  # counts left over from a burst that ended

    async def _refuse(self, scope: Scope, send: Send, kind: str) -> None:
        refused = sum(self.counters.refused.values())
        wait_s = self.retry_after(kind)
        if refused == 1 or refused % 1000 == 0:
            log.warning("admission: %d requests in flight, refusing %s requests with 503 (%d refused so far)",
                        self.counters.in_flight, kind, refused)
        body = json.dumps(problem(
            503, "Service Unavailable",
            f"This server is working on {self.counters.in_flight} requests, its bound; retry after "
            f"{wait_s} s (with jitter).",
            code="overloaded", instance=scope["path"],
        )).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", CONTENT_TYPE.encode()),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(wait_s).encode()),
        ]})
        await send({"type": "http.response.body", "body": body})
