"""A worker's liveness file, and the check that supervisors run against it.

The Celery worker touches the file from its consumer's loop (``controlplane.celery.LivenessFile``);
a supervisor (the compose healthcheck, a systemd timer) runs

    python -m core.liveness FILE --max-age 60 [--kill-pidfile PIDFILE]

which exits 0 while the file was touched within ``--max-age`` seconds and 1 otherwise (missing,
stale). With ``--kill-pidfile`` an unhealthy verdict also SIGKILLs the process named in that file
(the worker's ``--pidfile``): under compose with ``init: true`` the container then exits and its
restart policy starts a fresh one, which compose alone never does for a merely unhealthy container.

Standard library only: the check runs every few seconds and must not pay for Django or Celery.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def touch(path: str) -> None:
    """Mark the worker alive now (written then renamed: a reader never sees a half-written file)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(f"{os.getpid()} {time.time():.3f}\n")
    os.replace(tmp, target)


def remove(path: str) -> None:
    Path(path).unlink(missing_ok=True)


def age(path: str, *, now: float | None = None) -> float | None:
    """Seconds since the file was last touched; None when there is none."""
    try:
        touched = Path(path).stat().st_mtime
    except FileNotFoundError:
        return None
    return (time.time() if now is None else now) - touched


def verdict(path: str, max_age: float, *, now: float | None = None, pidfile: str = "") -> tuple[bool, str]:
    """(alive, why) for the file at ``path``. A worker whose ``pidfile`` is younger than ``max_age``
    but that has not touched the file yet is starting (connecting to the broker), not dead."""
    seconds = age(path, now=now)
    if seconds is None:
        started = age(pidfile, now=now) if pidfile else None
        if started is not None and started <= max_age:
            return True, f"{path} does not exist yet: the worker started {started:.0f} s ago"
        return False, f"{path} does not exist: the worker never started, or stopped"
    if seconds > max_age:
        return False, f"{path} was last touched {seconds:.0f} s ago (limit {max_age:g} s): the worker is stuck or dead"
    return True, f"{path} touched {seconds:.1f} s ago"


def _kill(pidfile: str) -> str:
    try:
        pid = int(Path(pidfile).read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError, IndexError) as error:
        return f"; could not kill the process in {pidfile}: {error}"
    return f"; killed process {pid} (from {pidfile})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.liveness", description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--max-age", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--kill-pidfile", default="", help="SIGKILL the process in this pid file when unhealthy")
    args = parser.parse_args(argv)
    alive, why = verdict(args.file, args.max_age, pidfile=args.kill_pidfile)
    if not alive and args.kill_pidfile:
        why += _kill(args.kill_pidfile)
    print(("alive: " if alive else "unhealthy: ") + why)
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
