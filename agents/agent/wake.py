"""The agent's long poll for commands: heartbeat as soon as a command waits, not an interval later.

Commands ride on heartbeat answers, once an interval (5 s by default, up to 30 s when the control
plane paces a large fleet). A stop that fences a failed generation and the launch of the next one
are what a recovery waits for, so a thread keeps one ``GET nodes/<id>/commands/wait`` open
(``nodes.services.wake`` on the control plane); when it answers ``commands: true`` the agent's loop
heartbeats at once and takes them as always. Everything else is unchanged: a lost poll, a refused
one, or a control plane that predates it only means the commands come with the next heartbeat.

Bounded: after a wake-up the next poll waits until a heartbeat has got through (the one it asked
for, or, when that one was refused, a retry: ``next_heartbeat_in``), so a queue that a refused
heartbeat left full never makes the agent poll again in a loop; an unreachable control plane backs
off as the spool's replay does, and a refusal's ``Retry-After`` is honoured. (A gap that doubled
with each wake-up, reset only by a whole wait without one, grew to the heartbeat interval on a node
whose commands come less than ``WAIT_S`` apart: the launch after a stop then waited 0.7 s in
bench.node_loss.)

A control plane that queues many commands at once (a 512-node job's launches) wakes that many agents
in the same instant, and their heartbeats arrive together. Sent again an interval later, they arrive
together again, every interval, and admission control refuses such a burst nearly whole: at 1,088
nodes (bench.fleet, 2026-12-06) 7 % of the heartbeats of nodes with a launch waiting were admitted
against 30 % of the others', in bursts of 300-500 every 22 s, and launches reached their nodes up to
8 minutes after they were queued. So a refused heartbeat that commands wait for is tried again after
a jittered backoff, not an interval later, and every heartbeat's next turn is drawn a little early
(``next_heartbeat_in``): agents that heartbeated together drift apart.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

from agents.http import ControlPlaneClient, Unreachable, retry_delay
from agents.protocol import ProtocolError, parse
from agents.protocol.agent import COMMAND_WAIT_PATH, CommandWaitResponse

log = logging.getLogger(__name__)

#: How long each poll asks the control plane to wait; below the usual 60 s idle timeout of proxies.
WAIT_S = 50.0
#: Added to the request's own timeout: the answer at ``WAIT_S`` still has to travel.
TRANSIT_S = 10.0
#: A control plane without the long poll (404, 405) is asked again after this long (an upgrade).
ABSENT_RETRY_S = 600.0


#: Each heartbeat's next turn comes up to this fraction of the interval early (drawn each time).
HEARTBEAT_JITTER = 0.1
#: The first retry of a refused heartbeat that commands wait for; doubling up to the interval.
OWED_RETRY_S = 1.0


def next_heartbeat_in(interval_s: float, *, owed: bool = False, refusals: int = 0, retry_after: float | None = None,
                      rng: random.Random | None = None) -> float:
    """Seconds from one heartbeat to the next (see the module's docstring).

    ``owed``: commands wait for this node (the command wait said so, and no heartbeat got through
    since); ``refusals``: heartbeats refused in a row. An owed heartbeat that was refused is tried
    again after ``retry_delay`` (``OWED_RETRY_S`` doubling, the server's ``Retry-After`` at least,
    up to half again as much at random), never later than the interval. Any other is next due
    ``interval_s`` less up to ``HEARTBEAT_JITTER`` of it.
    """
    if owed and refusals:
        return min(interval_s, retry_delay(refusals, base=OWED_RETRY_S, cap=interval_s, retry_after=retry_after,
                                           rng=rng))
    return interval_s * (1.0 - HEARTBEAT_JITTER * (rng or random).random())


class CommandWait(threading.Thread):
    """Calls ``on_commands`` whenever the control plane says a command waits for ``node_id``."""

    def __init__(self, base_url: str, token: str, node_id: str, *, on_commands: Callable[[], None],
                 heartbeats: HeartbeatCount, interval_s: Callable[[], float], stopping: threading.Event,
                 wait_s: float = WAIT_S):
        """``on_commands``: heartbeat now; ``heartbeats``: the heartbeats that got through."""
        super().__init__(name="command-wait", daemon=True)
        self.client = ControlPlaneClient(base_url, token, timeout=wait_s + TRANSIT_S)
        self.node_id, self.wait_s = node_id, wait_s
        self.on_commands, self.heartbeats = on_commands, heartbeats
        self.interval_s, self.stopping = interval_s, stopping
        self.wakeups = 0

    def run(self) -> None:
        path = f"{COMMAND_WAIT_PATH.format(node_id=self.node_id)}?timeout={self.wait_s:g}"
        failures = 0
        while not self.stopping.is_set():
            try:
                status, body = self.client.request("GET", path)
            except Unreachable as exc:
                failures += 1
                self.stopping.wait(retry_delay(failures, cap=max(self.interval_s(), 1.0), retry_after=exc.retry_after))
                continue
            failures = 0
            if status in (404, 405):
                log.info("the control plane has no command wait (HTTP %d): commands come with heartbeats; asking "
                         "again in %.0f s", status, ABSENT_RETRY_S)
                self.stopping.wait(ABSENT_RETRY_S)
                continue
            try:
                answer = parse(CommandWaitResponse, body) if status == 200 else None
            except ProtocolError as exc:
                log.warning("malformed command wait answer (%s); commands come with heartbeats", exc)
                answer = None
            if answer is None:
                if status != 200:
                    log.warning("command wait refused (HTTP %d: %s); commands come with heartbeats", status, body)
                self.stopping.wait(max(self.interval_s(), 1.0))
                continue
            if not answer.commands:
                continue
            self.wakeups += 1
            through = self.heartbeats.count
            self.on_commands()
            self.heartbeats.wait_past(through, self.stopping)


class HeartbeatCount:
    """How many heartbeats got through, and a wait for the next one (from another thread)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.count = 0

    def got_through(self) -> None:
        with self._changed:
            self.count += 1
            self._changed.notify_all()

    def wait_past(self, count: int, stopping: threading.Event) -> None:
        """Until more than ``count`` got through, or ``stopping`` is set."""
        with self._changed:
            while self.count <= count and not stopping.is_set():
                self._changed.wait(timeout=0.5)  # stopping has no way to notify: look at it twice a second
