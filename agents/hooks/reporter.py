"""Delivering step reports, events and checkpoint commits without ever holding training up.

The training thread only appends to an in-memory queue (``report``/``event``/``commit`` are O(1)
and never raise). A background thread moves what arrived into the on-disk spool and delivers
from the spool, oldest first, acknowledging a record only once the control plane answered 2xx.
So an outage costs nothing but delay: records wait in the spool (bounded: old step reports are
dropped first, events and commits never) and go out in order when the server is back; a crash
between delivery and acknowledgement re-sends a batch, which the server deduplicates on
(job, generation, rank, step). The answers also carry the control plane's ``Control``, which
this class turns into flags the hooks read at their next exchange point.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any
from urllib.parse import quote

from agents.http import ControlPlaneClient, Unreachable, retry_delay
from agents.protocol import ProtocolError, dump, parse
from agents.protocol.hooks import (
    CHECKPOINTS_PATH,
    CONTROL_PATH,
    REPORTS_PATH,
    CheckpointCommit,
    Control,
    Event,
    NodeWindow,
    StepReport,
    progress_header,
)
from agents.spool import Spool

log = logging.getLogger("nightwatch.hooks")

# Spool kinds. Only step reports and node windows may be dropped when the spool is full: one
# missing step is a gap in a chart, a missing event or checkpoint commit is a hole in the job's history.
REPORT, WINDOW, EVENT, CHECKPOINT = "report", "window", "event", "checkpoint"
DROPPABLE = frozenset({REPORT, WINDOW})
BATCH_LIMIT = 1000  # ReportBatch allows at most 1000 each of reports, windows and events
BUCKETS = {REPORT: "reports", WINDOW: "windows", EVENT: "events"}


class Reporter:
    def __init__(self, client: ControlPlaneClient, spool: Spool, *, job: str, generation: int, rank: int,
                 poll_control: bool = False, flush_interval: float = 1.0, control_interval: float = 5.0,
                 max_backoff: float = 10.0, max_in_memory: int = 100_000):
        self.client = client
        self.spool = spool
        self.job = job
        self.generation = generation
        self.rank = rank
        #: Only rank 0's step reports move the job's progress (admission lets them ahead of bulk).
        self._progress_header = progress_header(rank)
        self.poll_control = poll_control
        self.flush_interval = flush_interval
        self.control_interval = control_interval
        self.max_backoff = max_backoff
        self.max_in_memory = max_in_memory
        self._incoming: deque[tuple[str, StepReport | NodeWindow | Event | CheckpointCommit, str]] = deque()
        self.dropped_in_memory = 0
        # What the control plane asked for, read by the training thread.
        self.stale = False
        self.pause_requested = False
        self.checkpoint_interval: int | None = None
        self._checkpoint_requested = False
        self._last_checkpoint_now = False
        self._control_lock = threading.Lock()
        self._control_seen_at = float("-inf")
        self._failures = 0
        self._retry_at = 0.0
        self._batch_size = BATCH_LIMIT  # records per batch; 1 while isolating a refused record
        self._deadline = float("inf")  # set by close(): the last delivery attempt stops there
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nightwatch-reporter-{rank}", daemon=True)
        self._thread.start()

    # -- called from the training thread: never blocks, never raises --------------------------

    def report(self, step_report: StepReport) -> None:
        if len(self._incoming) >= self.max_in_memory:
            self.dropped_in_memory += 1  # only step reports are ever turned away
            return
        key = f"report:{step_report.generation}:{step_report.rank}:{step_report.step}"
        self._incoming.append((REPORT, step_report, key))  # encoded by the background thread

    def window(self, window: NodeWindow) -> None:
        if len(self._incoming) >= self.max_in_memory:
            self.dropped_in_memory += 1
            return
        self._incoming.append((WINDOW, window, f"window:{window.generation}:{window.node}:{window.last_step}"))

    def event(self, event: Event, *, urgent: bool = False) -> None:
        """Queue ``event``; an ``urgent`` one (it may pause the job) is sent now, not at the next tick."""
        self._incoming.append((EVENT, event, f"event:{event.generation}:{event.key}"))
        if urgent:
            self._wake.set()

    def commit(self, commit: CheckpointCommit) -> None:
        self._incoming.append((CHECKPOINT, commit, f"checkpoint:{commit.generation}:{commit.path}"))
        self._wake.set()  # a commit is worth sending now, not at the next tick

    def take_checkpoint_request(self) -> bool:
        """True once per "checkpoint now" the control plane raised."""
        with self._control_lock:
            requested, self._checkpoint_requested = self._checkpoint_requested, False
            return requested

    def close(self, timeout: float = 10.0) -> None:
        """Spool what is queued and try to deliver it for up to ``timeout`` seconds.

        What is not delivered by then stays in the spool for the next process to replay.
        """
        self._deadline = time.monotonic() + timeout
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout + self.client.timeout + 1.0)
        if self._thread.is_alive():  # stuck in a request: closing the spool under it would fail it
            log.warning("reporter still busy after %.0fs; undelivered records stay spooled", timeout)
            return
        self.spool.close()

    # -- the background thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            self._pump()
        self._retry_at = 0.0
        self._pump()  # last chance to deliver before the process ends

    def _pump(self) -> None:
        try:
            while self._incoming:
                kind, message, key = self._incoming.popleft()
                self.spool.append(kind, dump(message), key)
            if time.monotonic() >= self._retry_at and not self.stale:
                self._deliver()
                if self.poll_control and time.monotonic() - self._control_seen_at >= self.control_interval:
                    self._fetch_control()
        except Unreachable as error:
            self._back_off(error)
        except Exception:  # the reporter must never take training down with it
            log.exception("nightwatch reporter error (training continues)")

    def _deliver(self) -> None:
        while not self.stale and time.monotonic() < self._deadline:
            records = self.spool.peek(2 * BATCH_LIMIT)
            if not records:
                return
            if records[0][1] == CHECKPOINT:
                row_id, _, body = records[0]
                status, answer = self.client.request("POST", CHECKPOINTS_PATH.format(job=self._job_path), body)
                self._settle(status, answer, body["generation"], row_id, size=1)
            else:
                row_id, batch = self._next_batch(records)
                status, answer = self.client.request("POST", REPORTS_PATH.format(job=self._job_path), batch,
                                                     headers=self._progress_header)
                self._settle(status, answer, batch["generation"], row_id,
                             size=sum(len(batch[bucket]) for bucket in BUCKETS.values()))
                if status == 202 and answer.get("control") is not None:
                    self._apply_control(answer["control"])
            if self._failures:
                log.info("control plane reachable again; delivering spooled records")
                self._failures = 0

    def _next_batch(self, records: list[tuple[int, str, dict[str, Any]]]) -> tuple[int, dict[str, Any]]:
        """The longest run of reports, windows and events of one generation at the head of the spool;
        with the age of its newest step report when nothing waits behind it (``newest_step_age``)."""
        generation = records[0][2]["generation"]
        batch: dict[str, Any] = {"job": self.job, "generation": generation} | {b: [] for b in BUCKETS.values()}
        last_id, taken = records[0][0], 0
        for size, (row_id, kind, body) in enumerate(records):
            if kind == CHECKPOINT or body["generation"] != generation:
                break
            bucket = batch[BUCKETS[kind]]
            if len(bucket) == BATCH_LIMIT or size == self._batch_size:
                break
            bucket.append(body)
            last_id, taken = row_id, size + 1
        everything = taken == len(records) < 2 * BATCH_LIMIT and not self._incoming
        age = newest_step_age(batch, everything=everything, now=time.time())
        if age is not None:
            batch["newest_step_age_s"] = age
        return last_id, batch

    def _settle(self, status: int, answer: dict[str, Any], generation: int, upto_id: int, size: int) -> None:
        """Acknowledge what the control plane answered for; decide what a refusal means."""
        if status == 409 and generation >= self.generation:
            log.error("control plane says generation %d is stale: stopping (%s)", generation, answer)
            self.stale = True
            return
        if status == 409:
            log.warning("dropping spooled records of fenced-off generation %d", generation)
        elif status >= 400 and size > 1:
            # Some record in the batch is refused. Send one record at a time until it is found, so
            # its batch-mates are not lost with it.
            self._batch_size = 1
            return
        elif status >= 400:
            # A record the server will never accept (a schema mismatch): retrying forever would
            # block everything behind it, so it is logged and let go.
            log.error("control plane refused a record (HTTP %d): %s", status, answer)
            self._batch_size = BATCH_LIMIT
        self.spool.ack(upto_id)

    def _fetch_control(self) -> None:
        path = CONTROL_PATH.format(job=self._job_path) + f"?generation={self.generation}&rank={self.rank}"
        status, answer = self.client.request("GET", path)
        if status == 409:
            self.stale = True
        elif status == 200:
            self._apply_control(answer)

    def _apply_control(self, raw: Any) -> None:
        try:
            control = parse(Control, raw)
        except ProtocolError as error:
            log.error("ignoring malformed control answer: %s", error)
            return
        with self._control_lock:
            self._control_seen_at = time.monotonic()
            if control.stale:
                self.stale = True
            # Act on the rising edge: the server may keep the flag up until it sees the commit.
            if control.checkpoint_now and not self._last_checkpoint_now:
                self._checkpoint_requested = True
            self._last_checkpoint_now = control.checkpoint_now
            self.pause_requested = control.pause
            if control.checkpoint_interval_steps:
                self.checkpoint_interval = control.checkpoint_interval_steps

    def _back_off(self, error: Unreachable) -> None:
        self._failures += 1
        delay = retry_delay(self._failures, cap=self.max_backoff, retry_after=error.retry_after)
        self._retry_at = time.monotonic() + delay
        if self._failures == 1:
            log.warning("control plane unreachable (%s); spooling, retrying in %.1fs", error, delay)

    @property
    def _job_path(self) -> str:
        return quote(self.job, safe="")


def newest_step_age(batch: dict[str, Any], *, everything: bool, now: float) -> float | None:
    """``ReportBatch.newest_step_age_s``: how old the batch's newest step report is at ``now`` (the
    rank's clock, as the report's own time), if the batch holds ``everything`` the rank has not yet
    delivered; None otherwise, or when it holds no step report. Never negative (a clock stepped back)."""
    if not everything or not batch["reports"]:
        return None
    return max(0.0, round(now - batch["reports"][-1]["time"], 3))
