"""The relay: turns rows committed by *any* process into pushes to the browsers.

Why not push from the code that commits? The embedded demo runs the Celery worker as a separate
process, and the in-memory channel layer reaches only the consumers of the process it lives in:
a pause the worker commits would never reach a browser. The API that takes step reports belongs
to the jobs app, which should not know about browsers either. So the web process that holds the
WebSockets follows the two append-only tables every state change and every report lands in —
``core.models.Event`` (every transition, operator action, verification, drain …) and
``jobs.models.StepMetric`` — by primary key (``core.tail``), and sends what it finds to the
``job.<id>`` and ``cluster`` groups. Only committed rows are visible to it, so pushes always
follow the commit; a dashboard action also wakes it up on commit (``poke``).

Coalescing: each group gets at most one message per ``MIN_GAP_S``; whatever arrives meanwhile
is merged into the next one, so a browser sees a few messages a second however fast a job
reports.

With Redis (several web processes sharing the layer) only one process relays at a time: a
short lease in Redis decides which, and another takes over when its holder stops renewing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection
from django.db.models import Max, Q

from core import degraded
from core.events import CHART_KINDS
from core.models import Event
from core.tail import Tail
from dashboard import events, sections
from jobs.models import StepMetric

log = logging.getLogger(__name__)

#: How often the tables are read while someone watches (the push latency's floor): two indexed
#: queries per turn, in one process only.
INTERVAL_S = 0.05
#: A group gets at most one message per this many seconds.
MIN_GAP_S = 0.25
#: Sections that only step reports change (the step count, the rank-skew grid) are re-rendered at
#: most this often: chart points go out at once, those sections follow at a calmer pace.
SLOW_GAP_S = 1.0
#: Those sections ride along with the next points; they go alone only when no points came for this
#: long since their last render (a job that stopped reporting), and then do not take the group's
#: turn. Sent alone as soon as they were due, they took the turn just before the next point often
#: enough that the point waited out the gap: at a step a second, a point's p95 in the relay was
#: 200-250 ms, most of the live push target.
SLOW_ALONE_S = 2 * SLOW_GAP_S
#: With no one watching for this long the relay stops (and starts again on the next connect).
IDLE_STOP_S = 5.0
LEASE_KEY = "nightwatch:dashboard:relay"
LEASE_MS = 3000
#: The lease is renewed this often, not at every read: renewed this recently, it holds for two
#: seconds more, and no other process can take it meanwhile. At every read it cost up to three
#: Redis round trips before each one, 20 reads a second, on the path of every push.
RENEW_EVERY_S = LEASE_MS / 3000

@dataclass
class Pending:
    """What a group will be sent at its next turn."""

    job_id: int | None = None
    sections: set[str] = field(default_factory=set)
    slow_sections: set[str] = field(default_factory=set)  # changed by step reports only
    points: dict[tuple[int, int], events.Point] = field(default_factory=dict)
    nodes: set[int] = field(default_factory=set)  # whose heat-map blocks changed

    def add_points(self, points: list[events.Point]) -> None:
        for point in points:
            key = (point.generation, point.step)
            old = self.points.get(key)
            self.points[key] = point if old is None else _merge(old, point)


def _merge(a: events.Point, b: events.Point) -> events.Point:
    first, second = (a, b) if a.rank <= b.rank else (b, a)
    return events.Point(step=a.step, generation=a.generation, rank=first.rank,
                        loss=first.loss if first.loss is not None else second.loss,
                        grad_norm=first.grad_norm if first.grad_norm is not None else second.grad_norm,
                        spike=a.spike or b.spike, skipped=a.skipped or b.skipped, nan=a.nan or b.nan)


class Relay:
    def __init__(self, *, interval_s: float = INTERVAL_S, min_gap_s: float = MIN_GAP_S, lease: bool | None = None,
                 renew_every_s: float = RENEW_EVERY_S):
        """``lease``: take the Redis lease before relaying (default: when Redis is configured)."""
        self.interval_s, self.min_gap_s = interval_s, min_gap_s
        self.lease, self.renew_every_s = lease, renew_every_s
        self._renewed_at = -1e9  # time.monotonic() of the last renewal that held
        self.events, self.metrics = Tail(), Tail()
        self.pending: dict[str, Pending] = {}
        self.last_sent: dict[str, float] = {}
        self.last_slow: dict[str, float] = {}
        self.watchers = 0
        self.leading: bool | None = None  # None: just (re)started from the tables' ends
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._ids = itertools.count(1)
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._redis = None
        # One thread of its own: the relay keeps one database connection open while it runs,
        # which request handling (closing connections at each request's end) never touches.
        # Django keeps connections in context variables: the relay's own context holds its own.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dashboard-relay")
        self._context = contextvars.Context()

    # --- lifecycle (called by consumers, in the event loop) ----------------------------------------
    async def attach(self) -> None:
        """A browser started watching: make sure the relay runs (it starts after what exists now,
        which the browser's snapshot already shows)."""
        self.watchers += 1
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._wake = asyncio.Event()
            await self._in_thread(self.mark_now)
            self._task = self._loop.create_task(self._run())

    def detach(self) -> None:
        self.watchers = max(0, self.watchers - 1)

    async def stop(self) -> None:
        """Stop relaying now (tests; a server just lets it idle out)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task, self.watchers = None, 0
        await self._in_thread(self._release)
        await self._in_thread(_close_connection)

    def poke(self) -> None:
        """Read the tables now (a dashboard action committed). Safe from any thread."""
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        layer = get_channel_layer()
        idle_since = None
        while True:
            if self.watchers == 0:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > IDLE_STOP_S:
                    await self._in_thread(self._release)
                    await self._in_thread(_close_connection)
                    if self.watchers == 0:  # nobody attached while we were letting go
                        return
                    await self._in_thread(self.mark_now)
            else:
                idle_since = None
            try:
                await self._in_thread(self.collect)
                await self.flush(layer.group_send)
            except Exception:  # a failed read must not end live updates; the next turn retries
                log.exception("dashboard relay turn failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._next_wait())
            self._wake.clear()

    async def _in_thread(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._context.run, fn)

    def _next_wait(self) -> float:
        """Sleep until the next read, or sooner when a held-back group's turn comes first."""
        now = time.monotonic()
        turns = []
        for group, pending in self.pending.items():
            due = self.last_sent.get(group, -1e9) + self.min_gap_s
            if not (pending.sections or pending.points):
                due = max(due, self.last_slow.get(group, -1e9) + SLOW_ALONE_S)
            turns.append(due - now)
        return max(0.005, min([self.interval_s, *turns]))

    # --- one turn (sync: runs in a thread, with the ORM) ---------------------------------------------
    def mark_now(self) -> None:
        """Follow the tables from their current ends."""
        _drop_broken_connection()
        self.events.start_at(Event.objects.aggregate(m=Max("pk"))["m"] or 0)
        self.metrics.start_at(StepMetric.objects.aggregate(m=Max("pk"))["m"] or 0)
        self.leading = None

    def collect(self) -> None:
        """Read what was committed since the last turn into the groups' pending messages."""
        _drop_broken_connection()
        if not self._lead():
            return
        new_events = self.events.fetch(lambda after, holes: list(
            Event.objects.filter(Q(pk__gt=after) | Q(pk__in=holes)).order_by("pk")
            .only("pk", "kind", "job_id", "node_id")[:2000]))
        new_metrics = self.metrics.fetch(lambda after, holes: list(
            StepMetric.objects.filter(Q(pk__gt=after) | Q(pk__in=holes)).order_by("pk")
            .only("pk", "job_id", "generation", "rank", "step", "loss", "grad_norm", "spike", "skipped", "nan")
            [:5000]))
        self.route(new_events, new_metrics)

    def route(self, new_events, new_metrics) -> None:
        """Which group learns what from the rows (the routing table is ``dashboard.sections``)."""
        for event in new_events:
            if event.job_id is not None:
                names = list(sections.JOB_EVENT_SECTIONS)
                if event.kind in CHART_KINDS:
                    names.append("chart")
                self._pending(events.job_group(event.job_id), event.job_id).sections.update(names)
                self._pending(events.CLUSTER_GROUP).sections.update(sections.CLUSTER_JOB_SECTIONS)
            if event.node_id is not None:
                cluster = self._pending(events.CLUSTER_GROUP)
                cluster.sections.update(sections.CLUSTER_NODE_SECTIONS)
                cluster.nodes.add(event.node_id)
        by_job: dict[int, list] = {}
        for row in new_metrics:
            by_job.setdefault(row.job_id, []).append(row)
        for job_id, rows in by_job.items():
            pending = self._pending(events.job_group(job_id), job_id)
            pending.add_points(events.points_from_rows(rows))
            pending.slow_sections.update(sections.METRICS_SECTIONS)
            self._pending(events.CLUSTER_GROUP).slow_sections.add("jobs")

    def _pending(self, group: str, job_id: int | None = None) -> Pending:
        return self.pending.setdefault(group, Pending(job_id=job_id))

    async def flush(self, send, *, now: float | None = None) -> int:
        """Send each group whose turn has come what it has pending; returns how many were sent.

        A group's turn comes ``min_gap_s`` after its last message; sections that only step reports
        changed ride along at most every ``SLOW_GAP_S``, and go alone after ``SLOW_ALONE_S``.
        """
        now = time.monotonic() if now is None else now
        sent = 0
        for group, pending in list(self.pending.items()):
            if now - self.last_sent.get(group, -1e9) < self.min_gap_s:
                continue
            news = bool(pending.sections or pending.points)
            slow_due = bool(pending.slow_sections) and (
                now - self.last_slow.get(group, -1e9) >= (SLOW_GAP_S if news else SLOW_ALONE_S))
            if not (news or slow_due):
                continue
            names = set(pending.sections)
            if slow_due:
                names |= pending.slow_sections
                pending.slow_sections = set()
                self.last_slow[group] = now
            message = events.push_message(message_id=f"{self.owner}-{next(self._ids)}", job_id=pending.job_id,
                                          points=[p for _, p in sorted(pending.points.items())],
                                          sections=sorted(names), nodes=sorted(pending.nodes), relayed_at=time.time())
            taken = (pending.sections, pending.points, pending.nodes)
            pending.sections, pending.points, pending.nodes = set(), {}, set()
            try:
                await send(group, message)
            except Exception as error:  # the channel layer (Redis) is down: keep it for the next turn
                pending.sections |= taken[0] | names
                pending.points = {**taken[1], **pending.points}
                pending.nodes |= taken[2]
                degraded.note("channel_layer", error)
                break
            degraded.recovered("channel_layer")
            if not (pending.slow_sections or pending.sections):
                self.pending.pop(group, None)
            if news:  # at most one SLOW_ALONE_S apart, a message of slow sections alone takes no turn
                self.last_sent[group] = now
            sent += 1
        return sent

    # --- the lease (Redis only) ----------------------------------------------------------------------
    def _lead(self) -> bool:
        """Whether this process relays now: always with the in-memory layer; with Redis, while it
        holds the lease. A process that just took the lease starts from the tables' current ends
        (the browsers' snapshots cover the handover)."""
        url = getattr(settings, "REDIS_URL", None)
        if not url or self.lease is False:
            return True
        now = time.monotonic()
        if self.leading and now - self._renewed_at < self.renew_every_s:
            return True
        # Only with Redis: the in-memory layer's processes (the embedded demo, tests) never load the client.
        import redis

        if self._redis is None:
            # Short timeouts: an unreachable Redis must cost a turn half a second, not hang the relay.
            self._redis = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            held = self._redis.set(LEASE_KEY, self.owner, nx=True, px=LEASE_MS)
            if not held and self._redis.get(LEASE_KEY) == self.owner.encode():
                held = bool(self._redis.pexpire(LEASE_KEY, LEASE_MS))
        except redis.RedisError as error:
            # Not relaying this turn, but keeping our place in the tables: what commits while Redis is
            # down is pushed once it is back, not skipped as a takeover from another process would be.
            degraded.note("relay_lease", error)
            return False
        if held and self.leading is False:  # taking over from another process
            self.mark_now()
        self.leading = bool(held)
        if held:
            self._renewed_at = now
        return self.leading

    def _release(self) -> None:
        if self._redis is not None and self.leading:
            with contextlib.suppress(Exception):
                if self._redis.get(LEASE_KEY) == self.owner.encode():
                    self._redis.delete(LEASE_KEY)
        self.leading = False


def _close_connection() -> None:
    connection.close()


def _drop_broken_connection() -> None:
    """Reconnect after a database error (a restart, a failover); otherwise keep the connection:
    a new one every tenth of a second would cost more than the reads."""
    if connection.connection is not None and connection.errors_occurred and not connection.is_usable():
        connection.close()


#: The web process's relay (one per process).
RELAY = Relay()
