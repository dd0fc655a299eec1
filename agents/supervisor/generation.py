"""A generation as the supervisor tracks it, and its on-disk record (what a restarted agent adopts)."""

from __future__ import annotations

import collections
import json
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.protocol import parse
from agents.protocol.agent import (
    MAX_LOG_TAIL_LINES,
    ExitReport,
    LaunchedDetail,
)
from agents.supervisor.output import OutputScan
from agents.supervisor.procs import _exited, _Proc, _stat


@dataclass
class _Generation:
    job: str
    generation: int
    #: torchrun's pid and start time (clock ticks after boot, /proc/PID/stat): together they tell
    #: torchrun from a later process that the kernel gave the same pid.
    pid: int
    pid_started: int
    #: Our child; None for a generation adopted from an earlier agent process, which can only be
    #: watched in /proc (its exit status goes to whoever reaps it, not to us).
    proc: subprocess.Popen[bytes] | None
    log_path: Path
    launched: LaunchedDetail
    started_at: float
    started_monotonic: float
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=MAX_LOG_TAIL_LINES))
    scan: OutputScan = field(default_factory=OutputScan)
    #: Every process seen in the family, so that a child that left the process group (setsid)
    #: and was re-parented when its parent died is still found and killed.
    seen: set[_Proc] = field(default_factory=set)
    requested_stop: bool = False
    report: ExitReport | None = None
    #: Set when torchrun exited or printed its failure table: the watcher can finish the generation.
    over: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    #: Set by the watcher once the family is gone: the log reader reads to the end and stops.
    output_done: threading.Event = field(default_factory=threading.Event)
    #: When torchrun was first seen closing its worker group (monotonic clock); None before.
    closing_since: float | None = None
    #: Wall-clock end of a generation that ended while no agent watched it (from its log's mtime).
    ended_at: float | None = None
    #: Wall-clock time torchrun was first seen closing its worker group (a worker failed).
    failing_since: float | None = None
    #: Wall-clock time the watcher first found one of torchrun's workers gone (a rank ended), one
    #: watch tick at most after it did; None while every rank runs.
    rank_exited_at: float | None = None
    #: Ranks its warm clients replaced in process (``warm_client``, read from the log), and how many
    #: of those the watcher has taken in: each one re-arms the rank-gone notice for the next death.
    replaced: int = 0
    replaced_seen: int = 0
    #: Ranks' uncaught exceptions read before the last replacement (told of already).
    errors_told: int = 0
    #: The private directory of the zygote's socket (warm workers); removed when the generation ends.
    zygote_dir: Path | None = None
    #: Its ranks are replaced in process (warm workers and a budget): a stopped worker is killed.
    inprocess: bool = False
    #: Workers (pid, start time) found stopped (state T), with the wall time each was first seen so.
    stopped_since: dict[tuple[int, int], float] = field(default_factory=dict)

    def torchrun_present(self) -> bool:
        """Whether ``pid`` still names torchrun (running, or a zombie not yet reaped): only then
        is walking the tree below it and its process group safe."""
        if self.proc is not None:
            return self.proc.returncode is None  # reaped: its pid may belong to someone else by now
        now = _stat(self.pid)
        return now is not None and now.started == self.pid_started

    def torchrun_exited(self) -> bool:
        if self.proc is not None:
            return _exited(self.proc)
        now = _stat(self.pid)
        return now is None or now.started != self.pid_started or now.state == "Z"


def _record_path(records_dir: Path, job: str, generation: int) -> Path:
    return records_dir / f"{job}@{generation}.json"  # "@" cannot occur in a job id (ID_PATTERN)


def _read_record(path: Path) -> dict[str, Any]:
    """A running-generation record, checked field by field: a torn or foreign file must not make
    the agent adopt (and later signal) an arbitrary pid."""
    record = json.loads(path.read_text())
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    for name, kind in (("job", str), ("generation", int), ("pid", int), ("pid_started", int),
                       ("log_path", str), ("started_at", (int, float)), ("launched", dict)):
        if not isinstance(record.get(name), kind) or isinstance(record.get(name), bool):
            raise ValueError(f"field {name!r} is missing or not {kind}")
    if record["pid"] < 2 or record["generation"] < 0:
        raise ValueError(f"pid {record['pid']} / generation {record['generation']} out of range")
    record["launched"] = parse(LaunchedDetail, record["launched"])
    return record
