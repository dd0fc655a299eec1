"""The process torchrun starts for a rank when workers are warm: it stands for the worker the zygote
forks (``agents.supervisor.zygote``), so that torchrun's own subprocess handling, and its failure
attribution, stay exactly as with a cold worker.

    python -u warm_client.py SOCKET script.py ARGS...      (or SOCKET -m module ARGS...)

It is run as a script and imports nothing but the standard library's small modules (no torch, not
the ``agents`` package): it starts in about 20 ms. It

1. connects to the zygote's Unix socket and sends one request, a length-prefixed JSON object
   ``{"argv", "env", "cwd"}`` (its own environment and directory, the script and its arguments),
   with its stdin, stdout and stderr as SCM_RIGHTS;
2. receives ``{"pid": N}`` and a pidfd of the worker; SIGTERM, SIGINT, SIGCONT, SIGHUP, SIGQUIT,
   SIGUSR1 and SIGUSR2 sent to it are forwarded to the worker through the pidfd (from then on;
   one that came earlier is forwarded then);
3. ends as the worker did: the same exit code, or the same signal re-raised on itself (torchrun
   sees ``-9`` for a SIGKILLed rank); except that
4. with in-process restarts on (``NIGHTWATCH_INPROCESS_RESTARTS`` = N in the rank's environment), a
   worker that *crashed* (killed by a signal it was not sent through this client: SIGKILL from the
   OOM killer, SIGSEGV, SIGBUS...) is replaced, up to N times: the client asks the zygote for a new
   worker with ``NIGHTWATCH_INPROCESS_REPLACEMENT`` set, and the surviving ranks, which kept their
   interpreters, form the next round of the process group with it (``agents.hooks.inprocess``).
   torchrun sees nothing. Not replaced: a worker that exited (an exception is a deterministic bug
   until shown otherwise: restarting would repeat it), one stopped through this client (SIGTERM,
   SIGINT...: the generation is being stopped), and any while the supervisor holds replacements
   (a file ``hold`` beside the zygote's socket: the node failed its health check).

When the zygote cannot be reached (gone, refused, the request rejected) before a worker was forked,
it says so on stderr and becomes the cold worker (``exec python -u script.py ARGS``): slower, never
lost. When the zygote dies after forking, the worker cannot be reported on any more: it is killed,
and the client exits 1 with a message that says why.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
from collections.abc import Iterator
from typing import Any

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGCONT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
#: The exit code when the zygote died under a running worker.
ZYGOTE_LOST = 1
#: Signals that end a process without anyone asking it to stop: a crash, which a replacement may
#: survive. (SIGTERM, SIGINT, SIGHUP, SIGQUIT come from whoever stops the generation.)
CRASH_SIGNALS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE)
#: Beside the zygote's socket: while it exists, no worker is replaced (``Supervisor.hold_replacements``).
HOLD_FILE = "hold"
#: How the client's line about a replacement begins: the supervisor reads it from torchrun's log.
REPLACEMENT_LINE = "nightwatch warm worker: replacing rank "
#: The names ``agents.protocol.agent`` and ``agents.hooks.inprocess`` use: this script imports nothing
#: of the package (it must start in milliseconds), so it spells them out.
RESTARTS_ENV = "NIGHTWATCH_INPROCESS_RESTARTS"
REPLACEMENT_ENV = "NIGHTWATCH_INPROCESS_REPLACEMENT"


class _Unavailable(Exception):
    """The zygote did not take the request: start cold."""


class _Forwarder:
    def __init__(self) -> None:
        self.pidfd: int | None = None
        self.pending: list[int] = []
        #: A signal that stops a process came through here: the worker's end was asked for.
        self.stopping = False

    def __call__(self, sig: int, _frame: object) -> None:
        if sig not in (signal.SIGCONT, signal.SIGUSR1, signal.SIGUSR2):
            self.stopping = True
        if self.pidfd is None:
            self.pending.append(sig)
        else:
            self.send(sig)

    def send(self, sig: int) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, sig)  # type: ignore[arg-type]
        except ProcessLookupError:
            pass  # the worker has ended: its status is on its way

    def detach(self) -> None:
        """The worker ended: signals wait (``pending``) for its replacement."""
        if self.pidfd is not None:
            os.close(self.pidfd)
        self.pidfd = None

    def attach(self, pidfd: int) -> None:
        self.pidfd = pidfd
        for sig in self.pending:
            self.send(sig)
        self.pending.clear()


def _request(sock_path: str, argv: list[str], env: dict[str, str]) -> socket.socket:
    body = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock_path)
        socket.send_fds(conn, [struct.pack("!I", len(body))], [0, 1, 2])
        conn.sendall(body)
    except OSError as exc:
        conn.close()
        raise _Unavailable(f"cannot reach the zygote at {sock_path}: {exc}") from exc
    return conn


def _messages(conn: socket.socket, forwarder: _Forwarder) -> Iterator[dict[str, Any]]:
    """The zygote's replies, one JSON object a line; a pidfd comes with the first."""
    pending = b""
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, 4096, 1)
        except OSError:
            data, fds = b"", []
        for fd in fds:
            forwarder.attach(fd)
        if not data:
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            yield json.loads(line)


def _end_as(outcome: dict[str, Any]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if "signal" in outcome:
        sig = int(outcome["signal"])
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal that does not end a process (it did end the worker)
    os._exit(int(outcome["exit"]))


def replacement_allowed(outcome: dict[str, Any], *, stopping: bool, replaced: int, budget: int,
                        held: bool) -> bool:
    """Whether a worker that ended with ``outcome`` is replaced in process (see the docstring, 4)."""
    return (outcome.get("signal") in CRASH_SIGNALS and not stopping and not held and replaced < budget)


def _budget(env: dict[str, str]) -> int:
    try:
        return max(0, int(env.get(RESTARTS_ENV, "0")))
    except ValueError:
        return 0


def _cold(argv: list[str], why: str) -> None:
    print(f"nightwatch warm worker: {why}; starting this rank cold", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-u", *argv])  # noqa: S606 - the rank, as torchrun would start it


def _serve(conn: socket.socket, argv: list[str], forwarder: _Forwarder) -> tuple[int | None, dict[str, Any] | None]:
    """Stand for one worker: its pid, and how it ended (None: the zygote went away first)."""
    pid = None
    for message in _messages(conn, forwarder):
        if "pid" in message:
            pid = message["pid"]
        elif "error" in message:
            _cold(argv, f"the zygote refused the request: {message['error']}")
        elif pid is not None:
            return pid, message
    return pid, None


def main() -> None:
    if len(sys.argv) < 3:
        print("usage: warm_client.py SOCKET script.py ARGS... | SOCKET -m module ARGS...", file=sys.stderr)
        os._exit(2)
    sock_path, argv = sys.argv[1], sys.argv[2:]
    forwarder = _Forwarder()
    for sig in FORWARDED:
        signal.signal(sig, forwarder)
    budget, replaced = _budget(dict(os.environ)), 0
    hold = os.path.join(os.path.dirname(sock_path), HOLD_FILE)
    try:
        conn = _request(sock_path, argv, dict(os.environ))
    except _Unavailable as exc:
        _cold(argv, str(exc))
        return
    while True:
        pid, outcome = _serve(conn, argv, forwarder)
        conn.close()
        if outcome is None:
            break
        if not replacement_allowed(outcome, stopping=forwarder.stopping, replaced=replaced, budget=budget,
                                   held=os.path.exists(hold)):
            _end_as(outcome)
        replaced += 1
        forwarder.detach()
        print(f"{REPLACEMENT_LINE}{os.environ.get('RANK', '?')} in process ({replaced} of {budget}): its worker "
              f"(pid {pid}) was killed by signal {outcome['signal']}",
              file=sys.stderr, flush=True)
        os.environ[REPLACEMENT_ENV] = str(replaced)  # also for a cold start, should the zygote refuse
        try:
            conn = _request(sock_path, argv, dict(os.environ))
        except _Unavailable as exc:
            print(f"nightwatch warm worker: no replacement ({exc})", file=sys.stderr, flush=True)
            _end_as(outcome)
    if pid is None or forwarder.pidfd is None:
        _cold(argv, "the zygote closed the connection before forking")
        return
    forwarder.send(signal.SIGKILL)
    print(f"nightwatch warm worker: the zygote that forked this rank's worker (pid {pid}) is gone, so its "
          "exit could not be reported; the worker was killed", file=sys.stderr, flush=True)
    os._exit(ZYGOTE_LOST)


if __name__ == "__main__":
    main()
