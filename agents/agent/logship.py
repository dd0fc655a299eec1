"""Ships each generation's torchrun output to the control plane (``POST /nodes/{id}/logs``).

The supervisor hands every line it reads from a generation's log (``Supervisor(on_output=…)``) to
``LogShipper.add``; a thread of its own posts them in numbered batches with the node token, so the
control plane can serve ``nightwatch logs`` and the job page's log panel. It never slows training
or the agent's loop down:

- bounded: at most ``max_lines`` lines wait per generation (the oldest go first; the line numbers
  tell the control plane how many were dropped), and a line is cut to ``MAX_SHIPPED_LINE``;
- a batch that could not be sent (unreachable, refused for overload) is kept and sent again, from
  the same line number, after a back-off; the control plane skips lines it already holds;
- a generation's queue is dropped once the generation ended and everything was sent, or when the
  control plane refuses it for good (403, 409, 400: not this node's generation any more).

An agent that restarts re-reads an adopted generation's log from its beginning (the supervisor
does), so the line numbers start at 0 again and what was already shipped is skipped server-side.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from agents.http import ControlPlaneClient, Unreachable, retry_delay
from agents.protocol import dump
from agents.protocol.agent import MAX_LOG_LINES_PER_BATCH, MAX_SHIPPED_LINE, LogBatch

log = logging.getLogger(__name__)

#: How often the shipper sends what has accumulated (the follow latency of ``nightwatch logs -f``).
SHIP_INTERVAL_S = 1.0


@dataclass
class _Queue:
    lines: collections.deque[str]
    #: Line number of ``lines[0]``.
    first: int = 0
    ended: bool = False
    failures: int = 0
    not_before: float = 0.0
    dropped_logged: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class LogShipper:
    def __init__(self, *, max_lines: int = 20_000, interval_s: float = SHIP_INTERVAL_S):
        self.max_lines = max_lines
        self.interval_s = interval_s
        self._queues: dict[tuple[str, int], _Queue] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent_lines = 0

    # --- fed by the supervisor's log readers ---------------------------------------------------

    def add(self, job: str, generation: int, line: str) -> None:
        queue = self._queue(job, generation)
        with queue.lock:
            if len(queue.lines) >= self.max_lines:
                queue.lines.popleft()
                queue.first += 1
                if not queue.dropped_logged:
                    queue.dropped_logged = True
                    log.warning("job %s generation %d: more than %d lines of output wait to be shipped; dropping the "
                                "oldest", job, generation, self.max_lines)
            queue.lines.append(line[:MAX_SHIPPED_LINE])

    def ended(self, job: str, generation: int) -> None:
        """The generation's output is complete: once it is sent, its queue goes."""
        self._queue(job, generation).ended = True

    def _queue(self, job: str, generation: int) -> _Queue:
        key = (job, generation)
        with self._lock:
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = _Queue(collections.deque())
            return queue

    # --- the sending thread ----------------------------------------------------------------------

    def start(self, client: ControlPlaneClient, node_id: str) -> LogShipper:
        self._thread = threading.Thread(target=self._run, args=(client, node_id), name="log-shipper", daemon=True)
        self._thread.start()
        return self

    def stop(self, client: ControlPlaneClient | None = None, node_id: str | None = None) -> None:
        """Stop the thread; with a client, one last attempt to send what waits."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if client is not None and node_id is not None:
            self.ship_once(client, node_id, now=float("inf"))

    def _run(self, client: ControlPlaneClient, node_id: str) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.ship_once(client, node_id, now=time.monotonic())
            except Exception:  # the shipper must never take the agent down
                log.exception("shipping training output failed")

    def ship_once(self, client: ControlPlaneClient, node_id: str, *, now: float) -> int:
        """Send what waits, generation by generation; returns the lines the control plane took."""
        with self._lock:
            items = list(self._queues.items())
        sent = 0
        for key, queue in items:
            if queue.not_before > now:
                continue
            while True:
                with queue.lock:
                    lines = [queue.lines[i] for i in range(min(len(queue.lines), MAX_LOG_LINES_PER_BATCH))]
                    first = queue.first
                if not lines:
                    break
                batch = LogBatch(job=key[0], generation=key[1], first_line=first, lines=lines)
                try:
                    status, answer = client.request("POST", f"/api/v1/nodes/{node_id}/logs", dump(batch))
                except Unreachable as exc:
                    queue.failures += 1
                    queue.not_before = time.monotonic() + retry_delay(queue.failures, cap=30.0,
                                                                      retry_after=exc.retry_after)
                    break
                if status == 429 or status >= 500:
                    queue.failures += 1
                    queue.not_before = time.monotonic() + retry_delay(queue.failures, cap=30.0)
                    break
                if status >= 400:  # not ours (any more), or malformed: it will never be taken
                    log.warning("job %s generation %d: the control plane refused its output (%d: %s); not shipping "
                                "it", key[0], key[1], status, answer.get("detail", ""))
                    with self._lock:
                        self._queues.pop(key, None)
                    break
                queue.failures = 0
                with queue.lock:
                    # Drop what was sent; lines dropped meanwhile moved ``first`` past some of them.
                    done = max(0, first + len(lines) - queue.first)
                    for _ in range(min(done, len(queue.lines))):
                        queue.lines.popleft()
                    queue.first = max(queue.first, first + len(lines))
                sent += len(lines)
                self.sent_lines += len(lines)
            with self._lock, queue.lock:
                if queue.ended and not queue.lines and self._queues.get(key) is queue:
                    del self._queues[key]
        return sent
