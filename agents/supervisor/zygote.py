"""Warm workers: a zygote that has imported torch forks each rank of one generation on request.

A cold rank pays a new interpreter and ``import torch`` (about a second, more under load) before
its first step; plain ``torchrun --max-restarts`` pays the same, so only skipping it can bring a
restart well under torchrun's. The zygote keeps torchrun's own ``SubprocessContext`` (and so its
failure attribution: which rank failed first, with what code or signal): torchrun still starts one
ordinary subprocess per rank, but that subprocess is ``warm_client.py``, a ~20 ms script without
torch that asks the zygote for the real worker and then stands for it (see its docstring).

Design, and why per generation:

- The warm launcher (``agents.launcher``, torch and the workers' imports already done) forks the
  zygote when it is handed a generation, just before it becomes torchrun. So the zygote is
  torchrun's child and the workers its grandchildren: the supervisor's tree walk from torchrun
  finds them, its stop and kill logic reach them, an agent restart adopts them with torchrun, and
  nothing of one generation (environment, imports' state, a socket) can reach the next. A
  node-wide zygote owned by the agent would die with the agent or outlive torchrun, and its
  children would be nobody's generation.
- It dies with torchrun (``PR_SET_PDEATHSIG``); it ignores SIGTERM and SIGINT, which the stop
  logic sends the whole family, so that it stays until its workers have acted on theirs.
- The socket is a Unix socket in a directory made private (0700) by the supervisor, and each
  connection's peer must be this user (``SO_PEERCRED``). A request is a length-prefixed JSON
  object of lists and strings (argv, env, cwd) with the client's stdin/stdout/stderr as
  SCM_RIGHTS: nothing is unpickled or evaluated.
- One thread (a selector loop), so forking is safe: per connection, the request is read, the
  worker forked, and ``{"pid": N}`` sent with a pidfd of the worker (the client forwards signals
  through it: no pid-reuse race); when the worker is reaped, ``{"exit": code}`` or
  ``{"signal": n}``.
- The client is what torchrun and the tools see: when it dies (SIGKILL from torchrun after its
  grace, the supervisor, a test), its worker is SIGKILLed; while it is stopped (SIGSTOP), its
  worker is stopped too, within ``JOB_CONTROL_POLL_S``.
- The forked worker becomes ``python -u script.py args`` (or ``-m module``): new session, the
  client's fds on 0/1/2, its environment, directory and ``sys.argv``, default signal handlers,
  torch's thread count from ``OMP_NUM_THREADS`` (libgomp read it at import, in the zygote), numpy's
  global generator reseeded (``random`` reseeds itself after a fork), and the script run as
  ``__main__`` with the interpreter's ordinary exit (threads joined, atexit).
- What still differs from a cold start: ``/proc/PID/environ`` and ``cmdline`` of a forked rank are the
  zygote's (its ``os.environ`` is the rank's; tools that read ``/proc`` find the warm client, which
  has the rank's), the ranks of a node share one ``PYTHONHASHSEED``-style string hash seed, and an
  uncaught exception's traceback starts with the launcher's frames.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import gc
import importlib
import importlib.machinery
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import tokenize
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

#: The zygote's process name (``/proc/PID/comm``): how the supervisor tells it from torchrun's
#: workers among torchrun's children (its own children are the workers).
ZYGOTE_COMM = "nw-zygote"
#: How often a stopped (SIGSTOP) client is looked for, to stop its worker too.
JOB_CONTROL_POLL_S = 0.05
#: A client sends its whole request at once; one slower than this is dropped.
REQUEST_TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 16 * 2**20
#: The imports a worker would otherwise pay for: torch, its process groups and checkpointing,
#: DDP, and the hooks.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.nn.parallel", "agents.hooks")
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15
_HEADER = struct.Struct("!I")
RANKS_DIR = "ranks"


class RequestError(ValueError):
    """A client's request is not what the protocol allows."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker becomes: ``python -u ARGV...`` in ``cwd`` with exactly ``env``."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    fds: list[int] = field(default_factory=list)


def parse_request(body: bytes, fds: list[int]) -> WorkerSpec:
    """A request, checked field by field (a JSON object of lists and strings, three fds)."""
    try:
        request = json.loads(body)
    except ValueError as exc:
        raise RequestError(f"not JSON: {exc}") from exc
    if not isinstance(request, dict) or set(request) != {"argv", "env", "cwd"}:
        raise RequestError("expected an object with exactly argv, env and cwd")
    argv, env, cwd = request["argv"], request["env"], request["cwd"]
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise RequestError("argv must be a non-empty list of strings")
    if argv[0] == "-m" and len(argv) < 2:
        raise RequestError("-m without a module")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise RequestError("env must map strings to strings")
    if not isinstance(cwd, str) or not cwd:
        raise RequestError("cwd must be a path")
    if len(fds) != 3:
        raise RequestError(f"expected 3 file descriptors (stdin, stdout, stderr), got {len(fds)}")
    return WorkerSpec(argv=argv, env=env, cwd=cwd, fds=fds)


def private_socket_dir(base: str | None = None) -> Path:
    """A new directory only this user can enter (0700), for one generation's socket. Short, under
    the temporary directory: a Unix socket's path may not exceed 107 bytes."""

    path = Path(tempfile.mkdtemp(prefix="nw-zygote-", dir=base))
    os.chmod(path, 0o700)
    return path


def worker_pids(socket_dir: Path) -> dict[int, int]:
    """client pid -> pid of the worker it stands for, as the zygote listening in ``socket_dir``
    recorded them: torchrun's failure table names the clients, the exit report the ranks."""
    found = {}
    try:
        entries = list((Path(socket_dir) / RANKS_DIR).iterdir())
    except OSError:
        return {}
    for entry in entries:
        try:
            if entry.name.isdigit():
                found[int(entry.name)] = int(entry.read_text())
        except (OSError, ValueError):
            continue
    return found


def remove_socket_dir(path: Path) -> None:
    """Remove a directory ``private_socket_dir`` made, and nothing else (the path may come from a
    record on disk)."""

    path = Path(path)
    if path.name.startswith("nw-zygote-") and path.parent == Path(tempfile.gettempdir()) and path.is_dir() \
            and not path.is_symlink() and path.stat().st_uid == os.getuid():
        shutil.rmtree(path, ignore_errors=True)


#: torchrun's entrypoint for a warm rank: a script, run by torchrun's ``python -u``.
CLIENT = str(Path(__file__).with_name("warm_client.py"))


def through_client(torchrun_args: list[str], socket_path: str) -> list[str]:
    """torchrun's arguments with the rank's target (``script.py ARGS`` or ``--module M ARGS``)
    handed to the warm client: torchrun's own options are all ``--name=value`` (``_command``)."""
    at = next(i for i, arg in enumerate(torchrun_args) if arg == "--module" or not arg.startswith("--"))
    options, target = torchrun_args[:at], torchrun_args[at:]
    if target[0] == "--module":
        target = ["-m", *target[1:]]
    return [*options, CLIENT, socket_path, *target]


def listen(path: str) -> socket.socket:
    """The zygote's listening socket, bound before torchrun starts (no client can come too early)."""
    directory = Path(path).parent
    mode = directory.stat().st_mode & 0o777
    if mode & 0o077 or directory.stat().st_uid != os.getuid():
        raise PermissionError(f"{directory} must be private to this user (mode {mode:o})")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(256)
    return sock


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _set_name(name: str) -> None:
    _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def start(sock: socket.socket) -> WorkerSpec | None:
    """Fork the zygote off this process (the warm launcher, about to become torchrun): None here.

    In the zygote this never returns but in a worker it forked: there it returns the rank's spec,
    the process already made the rank's (``become``); the caller runs it with ``run`` and exits.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        sock.close()
        return None
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # torchrun died before the line above took effect
        os._exit(0)
    _set_name(ZYGOTE_COMM)
    # Nothing may return from here but a rank: the caller would go on to become a second torchrun.
    try:
        spec = Zygote(sock).serve()
    except BaseException:
        traceback.print_exc()
        print("nightwatch zygote: stopped; this generation's ranks start cold", file=sys.stderr, flush=True)
        os._exit(70)
    try:
        become(spec)
    except BaseException:  # no such directory, say: the rank fails as a cold one would
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    return spec


@dataclass
class _Worker:
    pid: int
    conn: socket.socket
    client_pid: int
    stopped: bool = False
    #: Whether its connection is still in the selector (not once the client was found gone).
    watched: bool = True


class Zygote:
    """The selector loop: accept, fork, reap, report, mirror a client's death or stop."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sel = selectors.DefaultSelector()
        self.workers: dict[int, _Worker] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        #: Which worker each client stands for (see ``worker_pids``), beside the socket.
        self.ranks_dir = Path(sock.getsockname()).parent / RANKS_DIR
        self.ranks_dir.mkdir(mode=0o700, exist_ok=True)

    def serve(self) -> WorkerSpec:
        """Serve until a fork; in the forked worker, return its spec (everything else closed)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # see the module docstring
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self._wake_w)
        # What the imports built stays shared with the ranks: the collector must not walk (and
        # so copy) it in every one of them.
        gc.collect()
        gc.freeze()
        self.sock.setblocking(False)
        self.sel.register(self.sock, selectors.EVENT_READ, "accept")
        self.sel.register(self._wake_r, selectors.EVENT_READ, "child")
        while True:
            events = self.sel.select(JOB_CONTROL_POLL_S if self.workers else None)
            for key, _ in events:
                if key.data == "accept":
                    spec = self._accept()
                    if spec is not None:
                        return spec
                elif key.data == "child":
                    self._reap()
                else:
                    self._client_readable(key.data)
            self._reap()  # a SIGCHLD that came while we were busy
            self._mirror_job_control()

    def _accept(self) -> WorkerSpec | None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return None
        conn.setblocking(True)
        conn.settimeout(REQUEST_TIMEOUT_S)
        fds: list[int] = []
        try:
            client_pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                raise RequestError(f"peer uid {uid} is not this user's ({os.getuid()})")
            header, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 3)
            if len(header) != _HEADER.size:
                raise RequestError("connection closed before the request")
            (size,) = _HEADER.unpack(header)
            if size > MAX_REQUEST_BYTES:
                raise RequestError(f"request of {size} bytes")
            spec = parse_request(_read_exactly(conn, size), fds)
        except (OSError, RequestError) as exc:
            for fd in fds:
                os.close(fd)
            _reply(conn, {"error": str(exc)})
            conn.close()
            return None
        return self._fork(conn, client_pid, spec)

    def _fork(self, conn: socket.socket, client_pid: int, spec: WorkerSpec) -> WorkerSpec | None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._close_in_worker(conn)
            return spec
        for fd in spec.fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)  # not reaped before we wait: it names this worker
        try:
            conn.settimeout(None)
            socket.send_fds(conn, [json.dumps({"pid": pid}).encode() + b"\n"], [pidfd])
        except OSError:
            pass  # the client is gone: the next loop round finds its connection closed
        finally:
            os.close(pidfd)
        self.workers[pid] = _Worker(pid=pid, conn=conn, client_pid=client_pid)
        tmp = self.ranks_dir / f".{client_pid}"
        tmp.write_text(str(pid))
        os.replace(tmp, self.ranks_dir / str(client_pid))
        self.sel.register(conn, selectors.EVENT_READ, pid)
        return None

    def _close_in_worker(self, conn: socket.socket) -> None:
        """In the forked worker: close what belongs to the zygote, through the objects that own it
        (closing raw fds would let their finalizers close the script's files later)."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.sel.close()
        self.sock.close()
        for worker in self.workers.values():
            worker.conn.close()
        conn.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _reap(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            worker = self.workers.pop(pid, None)
            if worker is None:
                continue
            outcome = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                       else {"exit": os.waitstatus_to_exitcode(status)})
            if worker.watched:
                self.sel.unregister(worker.conn)
            _reply(worker.conn, outcome)
            worker.conn.close()

    def _client_readable(self, pid: int) -> None:
        """The client sends nothing after its request: readable means it is gone (EOF)."""
        worker = self.workers.get(pid)
        if worker is None:
            return
        try:
            data = worker.conn.recv(64, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            return
        self.sel.unregister(worker.conn)
        worker.watched = False
        _signal(pid, signal.SIGCONT)
        _signal(pid, signal.SIGKILL)  # reaped (and forgotten) by _reap

    def _mirror_job_control(self) -> None:
        for worker in self.workers.values():
            stopped = _state(worker.client_pid) in ("T", "t")
            if stopped != worker.stopped:
                _signal(worker.pid, signal.SIGSTOP if stopped else signal.SIGCONT)
                worker.stopped = stopped


def become(spec: WorkerSpec) -> None:
    """In the forked worker: take the rank's session, fds, environment, directory and name."""
    os.setsid()
    for target, fd in enumerate(spec.fds):
        os.dup2(fd, target)
    for fd in spec.fds:
        if fd > 2:
            os.close(fd)
    os.chdir(spec.cwd)
    os.environ.clear()  # writes through to the C environment the worker's own children inherit
    os.environ.update(spec.env)
    _set_name(Path(sys.executable).name)
    threads = spec.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    if "numpy" in sys.modules:  # seeded once, in the zygote: every rank would draw the same numbers
        sys.modules["numpy"].random.seed()


def run_and_exit(spec: WorkerSpec) -> NoReturn:
    """Run the rank (``run``). A rank that succeeds (falls off the end, ``sys.exit(0)``) ends as
    the interpreter would, threads joined and atexit run, but without the module teardown: in a
    forked rank it refcounts, and so copies, the zygote's whole heap, which took seconds under load
    at the end of a run, where the hang detector saw a rank that did not exit. A rank that fails
    (an exception, a non-zero ``SystemExit``) propagates it, and the interpreter reports it and
    exits with its teardown, as a cold rank does: torchrun names the first rank it finds dead as the
    root cause, and a surviving rank that died of the broken collective as fast as the killed one
    was taken for it (rank 0 "traceback" instead of rank 1 SIGKILL)."""
    try:
        run(spec)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    _finish(0)


def _finish(code: int) -> NoReturn:
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run(spec: WorkerSpec) -> None:
    """Run the rank's script or module as ``__main__``, as ``python -u`` would. Its exceptions and
    ``SystemExit`` propagate: the interpreter reports them and exits as a cold worker would."""
    if spec.argv[0] == "-m":
        sys.argv = [spec.argv[1], *spec.argv[2:]]
        sys.path[0] = spec.cwd  # was the warm launcher's own entry (its directory)
        runpy.run_module(spec.argv[1], run_name="__main__", alter_sys=True)
        return
    script = os.path.join(spec.cwd, spec.argv[0])
    sys.argv = list(spec.argv)  # as given (runpy.run_path would make argv[0] the full path)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    with tokenize.open(script) as source:  # honours a coding cookie, as the interpreter does
        code = compile(source.read(), script, "exec")
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __cached__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", script))
    sys.modules["__main__"] = main
    exec(code, main.__dict__)  # noqa: S102 - the rank's own script, as `python script.py` runs it


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 2**20))
        if not chunk:
            raise RequestError("connection closed inside the request")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _reply(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.settimeout(1.0)
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the client is gone


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _state(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2]
