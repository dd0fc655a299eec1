"""The process tree of a generation as /proc shows it: reading it, finding the family, signalling it."""

from __future__ import annotations

import collections
import os
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from agents.supervisor.zygote import ZYGOTE_COMM

# --- /proc ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    pgid: int
    state: str
    started: int  # clock ticks after boot: tells a process from a later one with the same pid
    #: The process's name; it may change (a forked worker renames itself), so it is no part of
    #: the identity.
    comm: str = field(default="", compare=False)


def _parse_stat(pid: int, raw: str) -> _Proc:
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) ", comm may hold spaces
    return _Proc(pid=pid, state=fields[0], ppid=int(fields[1]), pgid=int(fields[2]), started=int(fields[19]),
                 comm=raw[raw.index("(") + 1:raw.rindex(")")])


def _stat(pid: int) -> _Proc | None:
    """``pid`` as /proc shows it now; None when there is no such process."""
    try:
        return _parse_stat(pid, Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


def _proc_table() -> dict[int, _Proc]:
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited while we looked
        table[int(entry)] = _parse_stat(int(entry), raw)
    return table


def _alive(procs: Iterable[_Proc]) -> list[_Proc]:
    """Those still running; a zombie has finished (it only waits for its parent to reap it)."""
    table = _proc_table()
    return [p for p in procs if (now := table.get(p.pid)) and now.started == p.started and now.state != "Z"]


def _as_now(procs: Iterable[_Proc]) -> list[_Proc]:
    """Those of ``procs`` still running, as /proc shows them now (their current name and parent)."""
    table = _proc_table()
    return [now for p in procs if (now := table.get(p.pid)) and now.started == p.started and now.state != "Z"]


def _is_zygote(proc: _Proc, torchrun_pid: int) -> bool:
    """Whether ``proc`` is torchrun's zygote (warm workers; it dies with torchrun)."""
    return proc.ppid == torchrun_pid and proc.comm == ZYGOTE_COMM


def _workers(procs: Iterable[_Proc], torchrun_pid: int, also: Iterable[_Proc] = ()) -> list[_Proc]:
    """torchrun's workers among ``procs``: its children, and with warm workers the children of its
    zygote (``agents.supervisor.zygote``: the child named ``ZYGOTE_COMM``), which are the ranks
    that its children (the warm clients) stand for. Not the zygote itself, nor a rank's own
    children (data-loader workers). ``also``: more sightings of the same processes (a zygote seen
    in the instant between its fork and its renaming is known by a later sighting)."""
    procs = list(procs)
    zygotes = {p.pid for p in [*procs, *also] if _is_zygote(p, torchrun_pid)}
    return [p for p in procs if p.pid != torchrun_pid and p.pid not in zygotes
            and (p.ppid == torchrun_pid or p.ppid in zygotes)]


def _worker_gone(seen: Iterable[_Proc], family: Iterable[_Proc], torchrun_pid: int) -> bool:
    """Whether a worker of torchrun (see ``_workers``) seen before is missing from, or a zombie in,
    ``family`` (the family as it is now): a rank ended, which torchrun notices only at its next
    monitor tick, and reports after closing the rest of the group."""
    family = list(family)
    now = {(p.pid, p.started): p for p in family}
    for proc in _workers(seen, torchrun_pid, also=family):
        current = now.get((proc.pid, proc.started))
        if current is None or current.state == "Z":
            return True
    return False


def _family(root: int, pgid: int) -> set[_Proc]:
    """``root``, everything below it, and everything in its process group."""
    table = _proc_table()
    children: dict[int, list[int]] = collections.defaultdict(list)
    for proc in table.values():
        children[proc.ppid].append(proc.pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            found.add(table[pid])
            todo.extend(children[pid])
    return found | {p for p in table.values() if p.pgid == pgid}


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether torchrun has exited, *without reaping it*: while it is a zombie its pid, which is
    also the process-group id, cannot be given to another process, so signalling the group
    stays safe until the watcher has cleaned up and reaps it."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped meanwhile by the watcher
        return True


def _dismiss(warm: subprocess.Popen[bytes]) -> None:
    """Let an unused warm launcher go: end of input makes it exit; kill it if it does not."""
    try:
        if warm.stdin is not None:
            warm.stdin.close()
        warm.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        warm.kill()
        warm.wait()


def _signal_all(procs: Iterable[_Proc], sig: int) -> None:
    for proc in procs:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
