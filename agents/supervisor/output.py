"""Reading how a generation ended: torchrun's output scanned as it streams, and the exit classified."""

from __future__ import annotations

import dataclasses
import re
import time

from agents.protocol.agent import (
    MAX_LOG_LINE,
    ExitReport,
    RankExit,
)
from agents.protocol.hooks import EXIT_PAUSED, EXIT_RESUME_REFUSED, EXIT_STALE_GENERATION

# --- reading how a generation ended ----------------------------------------------------------

_RANK_LINE = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_EXIT_LINE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
_ROOT_CAUSE = "Root Cause (first observed failure)"
_RULE = re.compile(r"^={20,}\s*$")
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")
_ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure)\b.*)$")
#: Exceptions of torchrun itself, which only repeat that a rank failed.
_LAUNCHER_ERRORS = ("ChildFailedError", "SignalException")
#: Log evidence, most specific first: a CUDA error makes the other ranks time out, not the reverse.
_LOG_SIGNATURES = (
    ("xid", re.compile(r"\bXid\b|NVRM: ")),
    ("oom", re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED")),
    ("cuda_error", re.compile(r"CUDA error|cudaError|CUBLAS_STATUS|illegal memory access|uncorrectable ECC")),
    ("nccl_watchdog", re.compile(r"[Ww]atchdog got stuck|Heartbeat monitor timed out|watchdog thread terminated")),
    ("nccl_timeout", re.compile(r"Watchdog caught collective operation timeout|NCCL.*[Tt]ime(d )?out|"
                                r"[Gg]loo.*[Tt]imed out|[Cc]ollective operation timeout")),
)
#: torchrun closing its worker group, which it only does once a worker failed or torchrun itself
#: was told to stop ("Sending process 1234 closing signal SIGTERM", from
#: torch.distributed.elastic.multiprocessing.api ``_close``).
_CLOSING_LINE = re.compile(r"Sending process (\d+) closing signal (SIG[A-Z]+)")
#: torchrun reporting a failed worker at level E (a worker's traceback, "failed (exitcode: 1)"): with
#: workers started by spawn it logs no closing line, and this is its first word of the failure.
_ELASTIC_ERROR = re.compile(r"^E\d{4} .*torch/distributed/elastic/")
#: The prefix torch's logging gives each line (glog's: level, month and day, local time to the
#: microsecond, pid): "W1202 00:46:46.911000 8436 torch/distributed/...] Sending process ...".
_GLOG_TIME = re.compile(r"^[DIWEC](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6}) ")
_EXIT_CODE_SIGNATURES = {EXIT_PAUSED: "paused", EXIT_STALE_GENERATION: "stale_generation",
                         EXIT_RESUME_REFUSED: "resume_refused"}


def logged_at(line: str, now: float | None = None) -> float | None:
    """The Unix time in ``line``'s glog prefix (the node's local time, no year: the year that puts
    it no later than a day after ``now``), or None when the line has no such prefix."""
    match = _GLOG_TIME.match(line)
    if match is None:
        return None
    month, day, hour, minute, second, micro = (int(g) for g in match.groups())
    now = time.time() if now is None else now
    year = time.localtime(now).tm_year
    for candidate in (year, year - 1):
        at = time.mktime((candidate, month, day, hour, minute, second, 0, 0, -1))  # the node's local time
        landed = time.localtime(at)
        if (landed.tm_mon, landed.tm_mday) != (month, day):  # 29 February of the other year, a garbled prefix
            continue
        if at <= now + 86400:
            return at + micro / 1e6
    return None


def decode_line(raw: bytes) -> str:
    """One line of torchrun's output as text: bytes that are not UTF-8 become U+FFFD, and NUL
    (which a program may print, but no message may carry, ``agents.protocol``) becomes U+FFFD too:
    an exit report quoting it would be refused, and the exit lost."""
    return raw.decode("utf-8", errors="replace").replace("\x00", "\ufffd").rstrip("\r")


class OutputScan:
    """What torchrun's output says, read line by line as it streams (not only the tail, which a
    chatty rank can flush): torchrun's failure table (per-rank exit codes, the first rank to
    fail), the exception lines in order, and which failure signatures appeared."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankExit] = {}
        self.root_cause_rank: int | None = None
        #: (rank, line): torch prefixes an uncaught exception's lines with "[rank<N>]: ".
        self.error_lines: list[tuple[int | None, str]] = []
        self.signatures: set[str] = set()
        #: torchrun has printed its whole failure table: everything it does after that is exiting.
        self.table_complete = False
        #: Worker pids torchrun is closing (signalling, then waiting up to 30 s for): the
        #: generation is over once this is not empty.
        self.closing_pids: set[int] = set()
        #: When torchrun first logged the failure (closing the worker group, or a failed worker's
        #: error: its own time of it, a monitor interval after the rank died), from the glog prefix.
        self.closing_logged_at: float | None = None
        self._pending: tuple[int, int] | None = None
        self._in_root_cause = False

    def feed(self, line: str) -> None:
        for signature, pattern in _LOG_SIGNATURES:
            if signature not in self.signatures and pattern.search(line):
                self.signatures.add(signature)
        rank_prefix = _RANK_PREFIX.match(line)
        text = line[rank_prefix.end():] if rank_prefix else line
        error = _ERROR_LINE.match(text)
        # Only the first few matter: the root cause fails first, the rest is collateral.
        if error and len(self.error_lines) < 16 and not any(e in text for e in _LAUNCHER_ERRORS):
            rank = int(rank_prefix.group(1)) if rank_prefix else None
            self.error_lines.append((rank, error.group(1)[:MAX_LOG_LINE]))
        if closing := _CLOSING_LINE.search(line):
            self.closing_pids.add(int(closing.group(1)))
        if self.closing_logged_at is None and (closing or _ELASTIC_ERROR.match(line)):
            self.closing_logged_at = logged_at(line)
        if _ROOT_CAUSE in line:
            self._in_root_cause = True
        elif self._in_root_cause and self.root_cause_rank is not None and _RULE.match(line):
            self.table_complete = True
        elif match := _RANK_LINE.match(line):
            self._pending = (int(match.group(1)), int(match.group(2)))
        elif (match := _EXIT_LINE.match(line)) and self._pending is not None:
            rank, local_rank = self._pending
            code = int(match.group(1))
            self.ranks[rank] = RankExit(rank=rank, local_rank=local_rank, pid=int(match.group(2)),
                                        exit_code=code if code >= 0 else None,
                                        signal=-code if code < 0 else None)
            if self._in_root_cause and self.root_cause_rank is None:
                self.root_cause_rank = rank
            self._pending = None


def classify_exit(exit_code: int | None, scan: OutputScan) -> tuple[str | None, str | None]:
    """(signature, error line) of a generation that ended on its own; (None, None) on success.

    1. A rank that exited with one of the hooks' exit codes asked for it (paused, fenced off).
    2. Log evidence, most specific first (``_LOG_SIGNATURES``).
    3. The root-cause rank killed by a signal: the other ranks' tracebacks are only collateral
       (their peer vanished), so no error line is reported.
    4. Otherwise a traceback: the root-cause rank's exception line, or the first one seen.
    """
    ranks = list(scan.ranks.values())
    if exit_code == 0 and all(r.exit_code == 0 for r in ranks):
        return None, None
    root_errors = [text for rank, text in scan.error_lines
                   if scan.root_cause_rank is not None and rank == scan.root_cause_rank]
    first_error = next(iter(root_errors or [text for _, text in scan.error_lines]), None)
    for rank in ranks:
        if rank.exit_code in _EXIT_CODE_SIGNATURES:
            return _EXIT_CODE_SIGNATURES[rank.exit_code], first_error
    for signature, _ in _LOG_SIGNATURES:
        if signature in scan.signatures:
            return signature, first_error
    root = scan.ranks.get(scan.root_cause_rank) if scan.root_cause_rank is not None else None
    if (root is not None and root.signal) or (not ranks and exit_code is not None and exit_code < 0):
        return "signal", None
    if first_error:
        return "traceback", first_error
    return "unknown", None


def attach_xids(report: ExitReport, xids: list[int]) -> ExitReport:
    """``report`` with the Xids seen while the generation ran; they outrank log evidence."""
    if not xids:
        return report
    signature = report.signature
    if not report.requested_stop and signature not in ("paused", "stale_generation", "resume_refused", None):
        signature = "xid"
    return dataclasses.replace(report, xids=xids[:64], signature=signature)


def _derived_exit_code(scan: OutputScan) -> int | None:
    """torchrun's exit status when it was not our child (adopted), so nobody could wait for it.

    After printing its failure table torchrun raises ``ChildFailedError`` out of ``main``, and
    the interpreter exits 1; without a table the status is not known, and is not guessed."""
    return 1 if scan.table_complete else None
