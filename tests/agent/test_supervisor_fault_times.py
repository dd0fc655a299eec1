"""Issue 20: the agent dates a generation's failure from the moment a rank died — its own sighting
of a worker gone, and torchrun's log time of closing the worker group — not from when the exit
report was made. Pure: the log parsing and the process-table comparison, without processes."""

from __future__ import annotations

import time

from agents.supervisor.output import OutputScan, logged_at
from agents.supervisor.procs import _Proc, _worker_gone

CLOSING = ("W1202 00:46:46.911000 8436 torch/distributed/elastic/multiprocessing/api.py:1028] "
           "Sending process 8441 closing signal SIGTERM")


def local(*fields: int) -> float:
    return time.mktime((*fields, 0, 0, -1))


def test_torchruns_log_prefix_gives_its_own_time_to_the_microsecond() -> None:
    now = local(2026, 12, 2, 0, 46, 48)
    assert logged_at(CLOSING, now) == local(2026, 12, 2, 0, 46, 46) + 0.911


def test_a_prefix_without_year_is_placed_no_later_than_a_day_after_now() -> None:
    just_after_new_year = local(2027, 1, 1, 0, 0, 1)
    last_year = local(2026, 12, 31, 23, 59, 59) + 0.5
    assert logged_at("E1231 23:59:59.500000 1 api.py:1] x", just_after_new_year) == last_year


def test_lines_without_a_prefix_have_no_time() -> None:
    assert logged_at("Sending process 8441 closing signal SIGTERM") is None
    assert logged_at("[rank1]: Traceback (most recent call last):") is None
    assert logged_at("W1399 00:00:00.000000 1 x] a month that does not exist") is None


def test_the_scan_keeps_the_first_closing_lines_time() -> None:
    scan = OutputScan()
    scan.feed("step 10 done")
    assert scan.closing_logged_at is None
    scan.feed(CLOSING)
    first = scan.closing_logged_at
    scan.feed(CLOSING.replace("46.911000", "47.500000").replace("8441", "8442"))
    assert first is not None and scan.closing_logged_at == first and scan.closing_pids == {8441, 8442}


TORCHRUN = _Proc(pid=100, ppid=1, pgid=100, state="S", started=5)
RANKS = [_Proc(pid=101, ppid=100, pgid=100, state="S", started=6),
         _Proc(pid=102, ppid=100, pgid=100, state="S", started=6)]
LOADER = _Proc(pid=103, ppid=101, pgid=100, state="S", started=7)  # a data-loader worker of rank 0


def test_a_rank_gone_or_a_zombie_is_seen_as_exited() -> None:
    seen = {TORCHRUN, *RANKS, LOADER}
    assert not _worker_gone(seen, seen, TORCHRUN.pid)
    assert _worker_gone(seen, {TORCHRUN, RANKS[0], LOADER}, TORCHRUN.pid)  # reaped by torchrun already
    zombie = _Proc(pid=102, ppid=100, pgid=100, state="Z", started=6)
    assert _worker_gone(seen, {TORCHRUN, RANKS[0], zombie, LOADER}, TORCHRUN.pid)


def test_a_stopped_rank_a_loaders_exit_or_a_reused_pid_is_not_a_rank_exit() -> None:
    seen = {TORCHRUN, *RANKS, LOADER}
    stopped = _Proc(pid=102, ppid=100, pgid=100, state="T", started=6)  # SIGSTOP: hung, not dead
    assert not _worker_gone(seen, {TORCHRUN, RANKS[0], stopped, LOADER}, TORCHRUN.pid)
    assert not _worker_gone(seen, {TORCHRUN, *RANKS}, TORCHRUN.pid)  # the loader worker ended
    reused = _Proc(pid=102, ppid=100, pgid=100, state="S", started=99)  # another process, same pid
    assert _worker_gone(seen, {TORCHRUN, RANKS[0], reused, LOADER}, TORCHRUN.pid)


def test_with_spawned_workers_torchruns_first_error_line_dates_the_failure() -> None:
    """torchrun's spawn path logs the worker's traceback at level E and no closing line."""
    scan = OutputScan()
    scan.feed("W1202 01:08:30.000000 27021 torch/distributed/run.py:800] Setting OMP_NUM_THREADS")  # not a failure
    assert scan.closing_logged_at is None
    scan.feed("E1202 01:08:40.722000 27021 torch/distributed/elastic/multiprocessing/api.py:836] Traceback "
              "(most recent call last):")
    assert scan.closing_logged_at == logged_at("E1202 01:08:40.722000 1 x] y")
