"""Command execution: once per idempotency key, across restarts, refusals told apart from failures."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

from agents.agent.commands import CommandLedger, CommandRunner
from agents.protocol.agent import Command, CommandAck, StopPayload, compact
from agents.supervisor import StaleGeneration


def stop(id: str, key: str, generation: int = 3) -> Command:  # noqa: A002
    return Command(id=id, kind="stop", idempotency_key=key, job="j", generation=generation,
                   payload=compact(StopPayload(grace_s=1)))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.acks: queue.Queue[CommandAck] = queue.Queue()

    def handle(self, command: Command, payload: Any) -> tuple[str, str]:
        self.calls.append((command.id, payload))
        if command.generation is not None and command.generation < 3:
            raise StaleGeneration(f"generation {command.generation} is older than 3")
        if command.generation == 99:
            raise OSError("disk full")
        return "done", f"stopped {command.job}"

    def runner(self, ledger_path: Path) -> CommandRunner:
        return CommandRunner(CommandLedger(ledger_path), {"stop": self.handle}, self.acks.put,
                             refusals=(StaleGeneration,))


def test_a_key_runs_once_even_across_a_restart(tmp_path: Path) -> None:
    recorder = Recorder()
    runner = recorder.runner(tmp_path / "commands.json")
    runner.submit(stop("c1", "k1"))
    runner.submit(stop("c1", "k1"))  # re-delivered before the first ran: queued once
    first = recorder.acks.get(timeout=5)
    runner.submit(stop("c1", "k1"))  # re-delivered after: acked again from the ledger
    again = recorder.acks.get(timeout=5)
    runner.close()
    assert (first.status, first.detail, first.command_id) == ("done", "stopped j", "c1")
    assert (again.status, again.detail) == (first.status, first.detail)
    assert [call[0] for call in recorder.calls] == ["c1"]
    assert recorder.calls[0][1] == StopPayload(grace_s=1)

    # A new agent process (the ledger is on disk) does not run it again either.
    restarted = recorder.runner(tmp_path / "commands.json")
    restarted.submit(stop("c9", "k1"))  # same key, new command id: the server retried creating it
    ack = recorder.acks.get(timeout=5)
    restarted.close()
    assert (ack.command_id, ack.status) == ("c9", "done") and len(recorder.calls) == 1


def test_refusals_failures_and_bad_payloads_are_told_apart(tmp_path: Path) -> None:
    recorder = Recorder()
    runner = recorder.runner(tmp_path / "commands.json")
    runner.submit(stop("old", "k-old", generation=2))
    runner.submit(stop("broken", "k-broken", generation=99))
    runner.submit(Command(id="bad", kind="stop", idempotency_key="k-bad", job="j", generation=3,
                          payload={"grace_s": "forever"}))
    acks = {ack.command_id: ack for ack in (recorder.acks.get(timeout=5) for _ in range(3))}
    runner.close()
    assert acks["old"].status == "refused" and "older than 3" in acks["old"].detail
    assert acks["broken"].status == "failed" and "OSError: disk full" in acks["broken"].detail
    assert acks["bad"].status == "failed" and "payload.grace_s" in acks["bad"].detail
    assert [call[0] for call in recorder.calls] == ["old", "broken"]  # the malformed one never ran


def test_the_ledger_keeps_only_the_newest_keys(tmp_path: Path) -> None:
    ledger = CommandLedger(tmp_path / "commands.json", keep=2)
    for i in range(3):
        ledger.record(CommandAck(command_id=f"c{i}", idempotency_key=f"k{i}", status="done", time=1.0))
    reloaded = CommandLedger(tmp_path / "commands.json", keep=2)
    assert reloaded.get("k0") is None and reloaded.get("k2") is not None


def test_closing_finishes_the_running_command_and_leaves_queued_ones_unacked(tmp_path: Path) -> None:
    started, release = queue.Queue[str](), queue.Queue[str]()
    acks: queue.Queue[CommandAck] = queue.Queue()

    def slow(command: Command, payload: Any) -> tuple[str, str]:
        started.put(command.id)
        release.get(timeout=5)
        return "done", ""

    runner = CommandRunner(CommandLedger(tmp_path / "commands.json"), {"stop": slow}, acks.put)
    runner.submit(stop("first", "k1"))
    runner.submit(stop("second", "k2"))
    assert started.get(timeout=5) == "first"
    closer = threading.Thread(target=runner.close, kwargs={"timeout": 5})
    closer.start()
    deadline = time.monotonic() + 5
    while not runner._closing.is_set() and time.monotonic() < deadline:  # close() has begun
        time.sleep(0.01)
    release.put("go")
    closer.join(timeout=10)
    assert [acks.get(timeout=1).command_id] == ["first"] and acks.empty()
    assert started.empty()  # "second" never ran: the control plane will send it again
