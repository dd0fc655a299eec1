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
   sees ``-9`` for a SIGKILLed rank).

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


class _Unavailable(Exception):
    """The zygote did not take the request: start cold."""


class _Forwarder:
    def __init__(self) -> None:
        self.pidfd: int | None = None
        self.pending: list[int] = []

    def __call__(self, sig: int, _frame: object) -> None:
        if self.pidfd is None:
            self.pending.append(sig)
        else:
            self.send(sig)

    def send(self, sig: int) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, sig)  # type: ignore[arg-type]
        except ProcessLookupError:
            pass  # the worker has ended: its status is on its way

    def attach(self, pidfd: int) -> None:
        self.pidfd = pidfd
        for sig in self.pending:
            self.send(sig)
        self.pending.clear()


def _request(sock_path: str, argv: list[str]) -> socket.socket:
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
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


def _cold(argv: list[str], why: str) -> None:
    print(f"nightwatch warm worker: {why}; starting this rank cold", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-u", *argv])  # noqa: S606 - the rank, as torchrun would start it


def main() -> None:
    if len(sys.argv) < 3:
        print("usage: warm_client.py SOCKET script.py ARGS... | SOCKET -m module ARGS...", file=sys.stderr)
        os._exit(2)
    sock_path, argv = sys.argv[1], sys.argv[2:]
    forwarder = _Forwarder()
    for sig in FORWARDED:
        signal.signal(sig, forwarder)
    try:
        conn = _request(sock_path, argv)
    except _Unavailable as exc:
        _cold(argv, str(exc))
        return
    pid = None
    for message in _messages(conn, forwarder):
        if "pid" in message:
            pid = message["pid"]
        elif "error" in message:
            _cold(argv, f"the zygote refused the request: {message['error']}")
        elif pid is not None:
            _end_as(message)
    if pid is None or forwarder.pidfd is None:
        _cold(argv, "the zygote closed the connection before forking")
        return
    forwarder.send(signal.SIGKILL)
    print(f"nightwatch warm worker: the zygote that forked this rank's worker (pid {pid}) is gone, so its "
          "exit could not be reported; the worker was killed", file=sys.stderr, flush=True)
    os._exit(ZYGOTE_LOST)


if __name__ == "__main__":
    main()
