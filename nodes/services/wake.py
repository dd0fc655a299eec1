"""Waking an agent as soon as a command waits for it: the long poll behind
``GET /api/v1/nodes/<id>/commands/wait``.

Commands ride on heartbeat answers, and a heartbeat comes once an interval: 1 s in the benchmarks,
5 s by default, up to 30 s under heartbeat pacing at fleet scale. A stop that fences a failed
generation and the launch of the next one each waited for the node's next heartbeat: bench.node_loss
measured 1.0 s for the stop and 0.8 s for the launch at a 1 s interval, on a recovery of 2.5-3 s.

So the agent keeps one request open (``agents.agent.wake``). It is answered ``true`` as soon as a
command for its node is committed, by whichever process committed it (a Celery worker, another web
process), and ``false`` when its timeout passes; on ``true`` the agent heartbeats at once and takes
its commands as before, so delivery, acknowledgement and fencing are unchanged, and an agent or a
control plane without the long poll still gets every command on the next heartbeat.

One ``CommandWatch`` per web process follows the command table by primary key (``core.tail.Tail``,
which also catches rows committed out of order) every ``WATCH_INTERVAL_S`` while anyone waits: one
indexed query a turn for the whole fleet, however many agents wait. A waiting request is an asyncio
future, not a thread or a database connection, and admission control does not count it in flight
(``core.admission``'s long polls).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.db import connection
from django.db.models import Max, Q

from core.tail import Tail
from nodes.choices import CommandState
from nodes.models import NodeCommand

log = logging.getLogger(__name__)

#: How often the command table is read while an agent waits: the wake-up's added delay.
WATCH_INTERVAL_S = 0.05
#: With no agent waiting for this long the watch stops (and starts again with the next wait).
IDLE_STOP_S = 5.0
#: The longest wait an agent may ask for; a proxy's idle timeout is usually 60 s or more.
MAX_WAIT_S = 55.0
#: Rows read a turn at most (a burst of commands: a 512-node relaunch is 512 rows).
BATCH = 5000


class CommandWatch:
    def __init__(self, *, interval_s: float = WATCH_INTERVAL_S, idle_stop_s: float = IDLE_STOP_S):
        self.interval_s, self.idle_stop_s = interval_s, idle_stop_s
        self.tail = Tail()
        self.waiters: dict[int, set[asyncio.Future]] = {}
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future | None = None
        # One thread of its own, with its own database connection kept open while the watch runs
        # (request handling closes connections at each request's end), as dashboard.relay does.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="command-watch")
        self._context = contextvars.Context()

    async def wait(self, node_id: int, timeout_s: float) -> bool:
        """True as soon as a command for ``node_id`` is pending (at once if one already is), False
        after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        await self._running(loop)
        woken: asyncio.Future = loop.create_future()
        self.waiters.setdefault(node_id, set()).add(woken)
        try:
            # After the watch's starting point and after joining the waiters: a command committed
            # from here on is seen by the watch, one committed before by this read.
            if await sync_to_async(_has_pending)(node_id):
                return True
            try:
                return await asyncio.wait_for(woken, timeout_s)
            except TimeoutError:
                return False
        finally:
            waiting = self.waiters.get(node_id)
            if waiting is not None:
                waiting.discard(woken)
                if not waiting:
                    del self.waiters[node_id]

    def wake(self, node_ids) -> int:
        """Answer the agents of ``node_ids`` that wait; how many requests were answered."""
        answered = 0
        for node_id in set(node_ids):
            for woken in self.waiters.get(node_id, ()):
                if not woken.done():
                    woken.set_result(True)
                    answered += 1
        return answered

    @property
    def started(self) -> bool:
        """Whether the watch ran since it was made or last stopped (its thread may hold a connection)."""
        return self._loop is not None

    async def stop(self) -> None:
        """Stop watching now (tests; a server lets the watch idle out)."""
        if self._task is not None and not self._task.done() and self._loop is asyncio.get_running_loop():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = self._loop = None
        await self._in_thread(_close_connection)

    async def _running(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._started = loop.create_future()
            self._task = loop.create_task(self._run())
        assert self._started is not None
        await asyncio.shield(self._started)

    async def _run(self) -> None:
        assert self._started is not None
        try:
            await self._in_thread(self._mark_now)
        except BaseException as error:
            self._started.set_exception(error)
            raise
        self._started.set_result(None)
        idle_since: float | None = None
        while True:
            if not self.waiters:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > self.idle_stop_s:
                    await self._in_thread(_close_connection)
                    return
            else:
                idle_since = None
            try:
                self.wake(await self._in_thread(self._collect))
            except Exception:  # a failed read must not end the watch: agents fall back on heartbeats
                log.exception("command watch turn failed")
            await asyncio.sleep(self.interval_s)

    async def _in_thread(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._context.run, fn)

    # --- in the watch's thread, with the ORM ---------------------------------------------------------
    def _mark_now(self) -> None:
        self.tail.start_at(NodeCommand.objects.aggregate(m=Max("pk"))["m"] or 0)

    def _collect(self) -> list[int]:
        """The nodes that got a pending command since the last turn."""
        if connection.connection is not None and connection.errors_occurred and not connection.is_usable():
            connection.close()  # a database restart or failover: reconnect
        rows = self.tail.fetch(lambda after, holes: list(
            NodeCommand.objects.filter(Q(pk__gt=after) | Q(pk__in=holes)).order_by("pk")
            .only("pk", "node_id", "state")[:BATCH]))
        return [row.node_id for row in rows if row.state == CommandState.PENDING]


def _close_connection() -> None:
    connection.close()  # looked up in the thread that runs it: each thread has its own


def _has_pending(node_id: int) -> bool:
    return NodeCommand.objects.filter(node_id=node_id, state=CommandState.PENDING).exists()


#: The web process's watch (one per process).
WATCH = CommandWatch()
