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
which also catches rows committed out of order) every ``WATCH_INTERVAL_S`` while anyone waits, from a
thread of its own with one database connection: one indexed query a turn for the whole fleet,
however many agents wait. A waiting request is an asyncio future, not a thread or a database
connection (it gives its connection back before it waits), and admission control does not count it
in flight (``core.admission``'s long polls).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

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
#: After a failed read (the database away) the watch tries again this much later, not every turn.
FAILED_PAUSE_S = 1.0
#: The longest wait an agent may ask for; a proxy's idle timeout is usually 60 s or more.
MAX_WAIT_S = 55.0
#: Rows read a turn at most (a burst of commands: a 512-node relaunch is 512 rows).
BATCH = 5000


class CommandWatch:
    """Waiting requests (futures of any event loop) by node, and the thread that wakes them.

    The thread is no asyncio task: one web process serves from one loop under daphne, but Django's
    WSGI servers (its live test server) run each request's async view in a loop of its own."""

    def __init__(self, *, interval_s: float = WATCH_INTERVAL_S, idle_stop_s: float = IDLE_STOP_S):
        self.interval_s, self.idle_stop_s = interval_s, idle_stop_s
        self.tail = Tail()
        self.waiters: dict[int, set[asyncio.Future]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = threading.Event()

    async def wait(self, node_id: int, timeout_s: float) -> bool:
        """True as soon as a command for ``node_id`` is pending (at once if one already is), False
        after ``timeout_s``."""
        woken: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._lock:
            self.waiters.setdefault(node_id, set()).add(woken)
            ready = self._running()
        try:
            # After the watch's starting point and after joining the waiters: a command committed
            # from here on is seen by the watch, one committed before by this read.
            if not ready.is_set():
                await asyncio.to_thread(ready.wait, 10.0)
            if await sync_to_async(_has_pending)(node_id):
                return True
            try:
                return await asyncio.wait_for(woken, timeout_s)
            except TimeoutError:
                return False
        finally:
            with self._lock:
                waiting = self.waiters.get(node_id)
                if waiting is not None:
                    waiting.discard(woken)
                    if not waiting:
                        del self.waiters[node_id]

    def wake(self, node_ids) -> int:
        """Answer the requests waiting for ``node_ids`` (from any thread); how many there were."""
        with self._lock:
            woken = [future for node_id in set(node_ids) for future in self.waiters.get(node_id, ())]
        for future in woken:
            with contextlib.suppress(RuntimeError):  # its loop closed: the request is gone
                future.get_loop().call_soon_threadsafe(_answer, future)
        return len(woken)

    def stop(self) -> None:
        """Stop watching now (tests; a server lets the watch idle out)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            self._stopping.set()
            thread.join(timeout=10)
            self._stopping.clear()

    def _running(self) -> threading.Event:
        """Start the thread unless it runs (under ``_lock``); the event it sets once it has its start."""
        if self._thread is None:
            self._ready = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._ready,), name="command-watch", daemon=True)
            self._thread.start()
        return self._ready

    def _run(self, ready: threading.Event) -> None:
        marked = self._mark_now()
        ready.set()
        idle_since: float | None = None
        pause = self.interval_s
        try:
            while not self._stopping.wait(pause):
                with self._lock:
                    if self.waiters:
                        idle_since = None
                    else:
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since > self.idle_stop_s:
                            self._thread = None
                            return
                try:
                    # Without its starting point (the database was away) it tries again before
                    # reading anything: never the whole table from the first row.
                    marked = marked or self._mark_now()
                    if marked:
                        self.wake(self._collect())
                    pause = self.interval_s if marked else FAILED_PAUSE_S
                except Exception:  # a failed read must not end the watch: agents fall back on heartbeats
                    log.exception("command watch turn failed")
                    pause = FAILED_PAUSE_S
        finally:
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None
            connection.close()

    # --- in the watch's thread, with the ORM ---------------------------------------------------------
    def _mark_now(self) -> bool:
        """Follow the table from its end; False when the database did not answer."""
        try:
            self.tail.start_at(NodeCommand.objects.aggregate(m=Max("pk"))["m"] or 0)
        except Exception:  # the waits still end by their timeouts, and heartbeats bring the commands
            log.exception("command watch cannot read the command table")
            connection.close()
            return False
        return True

    def _collect(self) -> list[int]:
        """The nodes that got a pending command since the last turn."""
        if connection.connection is not None and connection.errors_occurred and not connection.is_usable():
            connection.close()  # a database restart or failover: reconnect
        rows = self.tail.fetch(lambda after, holes: list(
            NodeCommand.objects.filter(Q(pk__gt=after) | Q(pk__in=holes)).order_by("pk")
            .only("pk", "node_id", "state")[:BATCH]))
        return [row.node_id for row in rows if row.state == CommandState.PENDING]


def _answer(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(True)


def _has_pending(node_id: int) -> bool:
    """In the request's own thread, after its authorisation; then its connection is given back (to
    the pool, or closed): a thousand waiting agents must not hold a thousand connections until their
    answers, which a pool of DB_POOL_MAX_SIZE would run out of. Not inside a transaction (a test's)."""
    try:
        return NodeCommand.objects.filter(node_id=node_id, state=CommandState.PENDING).exists()
    finally:
        if not connection.in_atomic_block:
            connection.close()


#: The web process's watch (one per process).
WATCH = CommandWatch()
