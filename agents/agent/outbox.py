"""Everything the agent reports goes through a disk spool, and is replayed from it in order.

So a control-plane outage costs nothing but delay: telemetry, events and command acks wait on
disk. Past the spool's bound the oldest *telemetry* is dropped (and the drop reported as an
event); events and acks are never dropped.

Two lanes, each in its own order: events and acks (an exit, an Xid, a launch's ack: what starts a
recovery) go before telemetry. A control plane that sheds load refuses bulk data first, and an
Xid queued behind a telemetry backlog waited out every one of its refusals (issue 18's fleet run:
5 s at 1,024 nodes); now it waits for at most the one telemetry batch already on its way.
Telemetry samples are keyed by (node, GPU, time) on the server, so their order against events
does not matter. The lanes also back off apart (``Agent._loop``): telemetry refused by a shedding
control plane waits out its ``Retry-After``, and an Xid that arrives meanwhile goes on its own.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.http import ControlPlaneClient, Unreachable
from agents.protocol import dump, parse
from agents.protocol.agent import (
    ACK_PATH,
    EVENTS_PATH,
    MAX_EVENTS_PER_BATCH,
    MAX_SAMPLES_PER_BATCH,
    TELEMETRY_PATH,
    AgentEvent,
    CommandAck,
    GpuSample,
    TelemetryDropped,
    compact,
)
from agents.spool import Spool

log = logging.getLogger(__name__)

TELEMETRY, EVENT, ACK = "telemetry", "event", "ack"
_BATCH_LIMITS = {TELEMETRY: MAX_SAMPLES_PER_BATCH, EVENT: MAX_EVENTS_PER_BATCH, ACK: 1}
#: Delivery lanes, most urgent first; within a lane, spool order.
URGENT, BULK = frozenset({EVENT, ACK}), frozenset({TELEMETRY})
#: After the urgent URL did not answer, the urgent lane goes to the control plane's URL this long
#: before the urgent URL is tried again (a timeout there would otherwise delay every event).
URGENT_RETRY_S = 30.0
#: ``Unreachable.status`` of an urgent URL that did not answer: no response at all, or a proxy in
#: front of it saying so (502, 504). A 503 is admission control answering: it is waited out.
NO_ANSWER = (None, 502, 504)


class AuthRejected(Exception):
    """The control plane refused our node token (401/403): keep the data, tell the operator."""


class Outbox:
    def __init__(self, path: Path, *, max_records: int):
        self.spool = Spool(path, max_records=max_records, droppable_kinds=frozenset({TELEMETRY}))
        self.events_created = 0
        self._drops_reported = 0
        # Something that should not wait for the next telemetry batch is held (an event, an ack, or
        # anything a previous run left in the spool).
        self.urgent = len(self.spool) > 0
        #: Monotonic; set when the urgent URL did not answer, and until then the urgent lane goes to the
        #: control plane's URL. 0: it answered the last time it was tried.
        self._urgent_retry_at = 0.0

    def add_samples(self, samples: list[GpuSample]) -> None:
        for sample in samples:
            self.spool.append(TELEMETRY, dump(sample))

    def add_event(self, kind: str, detail: Any, *, job: str | None = None, generation: int | None = None,
                  key: str | None = None) -> AgentEvent:
        event = AgentEvent(key=key or f"{kind}-{uuid.uuid4().hex}", kind=kind, time=time.time(), job=job,
                           generation=generation, detail=compact(detail))
        if self.spool.append(EVENT, dump(event), key=event.key):
            self.events_created += 1
            self.urgent = True
        return event

    def add_ack(self, ack: CommandAck) -> None:
        # Keyed: a command re-delivered while its first ack still waits is acked once.
        self.spool.append(ACK, dump(ack), key=f"ack-{ack.command_id}")
        self.urgent = True

    def report_drops(self) -> None:
        """Turn telemetry dropped by the spool's bound into a (never dropped) event."""
        total = self.spool.dropped.get(TELEMETRY, 0)
        if total > self._drops_reported:
            # Keyed by the running total: after an agent restart the same total is not counted twice.
            self.add_event("telemetry_dropped", TelemetryDropped(count=total - self._drops_reported, total=total),
                           key=f"telemetry_dropped-{total}")
            log.warning("spool full: %d telemetry samples dropped so far", total)
            self._drops_reported = total

    def flush(self, client: ControlPlaneClient, node_id: str,
              on_stale_ack: Callable[[CommandAck], None], *, bulk: bool = True,
              urgent_client: ControlPlaneClient | None = None) -> int:
        """Deliver spooled records until none is left, the urgent lane before each bulk batch (only
        the urgent lane with ``bulk=False``); how many were delivered. The urgent lane goes to
        ``urgent_client`` where there is one (the agent's ``urgent_url``), the bulk lane to ``client``.

        Raises ``agents.http.Unreachable`` (and keeps the rest) when the control plane is down or
        refuses; ``urgent`` is still true afterwards only if the urgent lane was what it refused.
        """
        delivered = 0
        while True:
            # Cleared before the lane is read: what another thread adds meanwhile sets it again.
            self.urgent = False
            try:
                while run := self._head_run(URGENT):
                    delivered += self._deliver_urgent(client, urgent_client, node_id, run, on_stale_ack)
            except BaseException:
                self.urgent = True
                raise
            if not bulk or not (run := self._head_run(BULK)):
                break
            delivered += self._deliver(client, node_id, run[0][1], run, on_stale_ack, BULK)
        return delivered

    def _deliver_urgent(self, client: ControlPlaneClient, urgent_client: ControlPlaneClient | None, node_id: str,
                        run: list, on_stale_ack: Callable[[CommandAck], None]) -> int:
        """The urgent lane's ``run`` to the urgent processes, or to ``client`` where there are none or
        they do not answer at all: processes of their own make a verdict faster, never a single point of
        failure. (A refusal, a 503 with ``Retry-After``, is an answer: it is waited out as elsewhere.)"""
        if urgent_client is not None and time.monotonic() >= self._urgent_retry_at:
            try:
                delivered = self._deliver(urgent_client, node_id, run[0][1], run, on_stale_ack, URGENT)
            except Unreachable as exc:
                if exc.status not in NO_ANSWER:
                    raise
                if not self._urgent_retry_at:  # logged once an outage
                    log.warning("the urgent URL does not answer (%s); events and acks go to the control "
                                "plane's URL meanwhile", exc)
                self._urgent_retry_at = time.monotonic() + URGENT_RETRY_S
                return 0  # the lane's head is taken again, by the control plane's URL now
            else:
                if self._urgent_retry_at:
                    log.info("the urgent URL answers again")
                self._urgent_retry_at = 0.0
                return delivered
        return self._deliver(client, node_id, run[0][1], run, on_stale_ack, URGENT)

    def _head_run(self, lane: frozenset[str]) -> list[tuple[int, str, dict[str, Any]]]:
        """The lane's oldest records of one kind, as many as one request carries."""
        records = self.spool.peek(MAX_SAMPLES_PER_BATCH, kinds=lane)
        run: list[tuple[int, str, dict[str, Any]]] = []
        for record in records:
            if record[1] != records[0][1] or len(run) == _BATCH_LIMITS[record[1]]:
                break
            run.append(record)
        return run

    def _deliver(self, client: ControlPlaneClient, node_id: str, kind: str, run: list,
                 on_stale_ack: Callable[[CommandAck], None], lane: frozenset[str]) -> int:
        """Send ``run`` (records of one kind, in order) and forget what the control plane decided on.

        A batch the control plane refuses as malformed is split in halves until the refused
        records are alone: one bad record must not take a whole batch of good ones with it.
        """
        bodies = [body for _, _, body in run]
        if kind == TELEMETRY:
            status, answer = client.request("POST", TELEMETRY_PATH.format(node_id=node_id), {"samples": bodies})
        elif kind == EVENT:
            status, answer = client.request("POST", EVENTS_PATH.format(node_id=node_id), {"events": bodies})
        else:
            ack = parse(CommandAck, bodies[0])
            status, answer = client.request(
                "POST", ACK_PATH.format(node_id=node_id, command_id=ack.command_id), bodies[0])
            if status == 409:
                on_stale_ack(ack)
        if status in (401, 403):
            raise AuthRejected(f"control plane refused the node token ({status}): {answer}")
        if status >= 400 and not (kind == ACK and status == 409):
            if len(run) > 1:
                half = len(run) // 2
                return (self._deliver(client, node_id, kind, run[:half], on_stale_ack, lane)
                        + self._deliver(client, node_id, kind, run[half:], on_stale_ack, lane))
            # Re-sending a message the server judged malformed would block everything behind it.
            log.error("control plane refused a %s record with %d: %s; dropping it", kind, status, answer)
            self.spool.ack(run[-1][0], kinds=lane)
            return 0
        self.spool.ack(run[-1][0], kinds=lane)
        return len(run)

    def __len__(self) -> int:
        return len(self.spool)

    def close(self) -> None:
        self.spool.close()
