"""Commands from the control plane, executed at least once and at most once per idempotency key.

The server re-sends a command in every heartbeat answer until it sees the ack, so the same
command can arrive many times. ``CommandRunner`` executes a key once, records the ack in a
ledger on disk, and on every re-delivery sends the recorded ack again instead of re-running.
Commands run one at a time, in arrival order, on a worker thread, so a 30-second stop does not
hold up heartbeats.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agents.protocol import ProtocolError, dump, parse
from agents.protocol.agent import Command, CommandAck, parse_command_payload

log = logging.getLogger(__name__)

#: A handler executes one command kind and says how it went: ("done" | "refused" | "failed", detail).
Handler = Callable[[Command, Any], tuple[str, str]]


class CommandLedger:
    """Acks of executed commands by idempotency key; the newest ``keep`` survive restarts."""

    def __init__(self, path: Path, keep: int = 2048):
        self._path = path
        self._keep = keep
        self._acks: collections.OrderedDict[str, CommandAck] = collections.OrderedDict()
        if path.exists():
            for raw in json.loads(path.read_text()):
                ack = parse(CommandAck, raw)
                self._acks[ack.idempotency_key] = ack

    def get(self, key: str) -> CommandAck | None:
        return self._acks.get(key)

    def record(self, ack: CommandAck) -> None:
        self._acks[ack.idempotency_key] = ack
        while len(self._acks) > self._keep:
            self._acks.popitem(last=False)
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps([dump(a) for a in self._acks.values()]))
        os.replace(tmp, self._path)


class CommandRunner:
    def __init__(self, ledger: CommandLedger, handlers: Mapping[str, Handler],
                 send_ack: Callable[[CommandAck], None], *, refusals: tuple[type[Exception], ...] = ()):
        """``refusals``: exceptions that mean "this command must not run" (a stale generation),
        acked as refused rather than failed."""
        self._ledger = ledger
        self._refusals = refusals
        self._handlers = dict(handlers)
        self._send_ack = send_ack
        self._queue: queue.Queue[Command | None] = queue.Queue()
        self._lock = threading.Lock()
        self._queued: set[str] = set()
        self._closing = threading.Event()
        self.executed = collections.Counter[str]()  # kind -> executions, for operators and tests
        self._worker = threading.Thread(target=self._work, name="commands", daemon=True)
        self._worker.start()

    def submit(self, command: Command) -> None:
        with self._lock:
            done = self._ledger.get(command.idempotency_key)
            if done is None and command.idempotency_key not in self._queued:
                self._queued.add(command.idempotency_key)
                self._queue.put(command)
                return
        if done is not None:
            log.info("command %s (%s) was already executed; acknowledging it again", command.id, command.kind)
            self._send_ack(_ack(command, done.status, done.detail))

    def close(self, timeout: float = 60.0) -> None:
        """Finish the command in progress; drop the queued ones unacked (they will be re-sent)."""
        self._closing.set()
        self._queue.put(None)
        self._worker.join(timeout)

    def _work(self) -> None:
        while (command := self._queue.get()) is not None:
            if self._closing.is_set():
                # Shutting down: launching now would only be undone. Not acked, so the control
                # plane re-sends it to the next run of the agent.
                with self._lock:
                    self._queued.discard(command.idempotency_key)
                continue
            status, detail = self._execute(command)
            ack = _ack(command, status, detail)
            with self._lock:
                self._ledger.record(ack)
                self._queued.discard(command.idempotency_key)
            self.executed[command.kind] += 1
            self._send_ack(ack)

    def _execute(self, command: Command) -> tuple[str, str]:
        try:
            payload = parse_command_payload(command)
        except ProtocolError as exc:
            return "failed", f"invalid {command.kind} command: {exc}"
        log.info("command %s: %s job=%s generation=%s", command.id, command.kind, command.job, command.generation)
        try:
            return self._handlers[command.kind](command, payload)
        except self._refusals as exc:
            log.warning("command %s (%s) refused: %s", command.id, command.kind, exc)
            return "refused", str(exc)[:2000]
        except Exception as exc:
            log.exception("command %s (%s) failed", command.id, command.kind)
            return "failed", f"{type(exc).__name__}: {exc}"[:2000]


def _ack(command: Command, status: str, detail: str) -> CommandAck:
    return CommandAck(command_id=command.id, idempotency_key=command.idempotency_key, status=status,
                      time=time.time(), job=command.job, generation=command.generation, detail=detail[:2000])
