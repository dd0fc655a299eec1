"""Runs ``torchrun`` for one generation of a job on this node, reports how it ended, and stops it
completely.

- One generation per job at a time, and the generation is the fencing token: a launch or stop
  for a generation older than the newest one seen here raises ``StaleGeneration`` (persisted, so
  an agent restart does not forget it).
- torchrun runs in its own session and process group with ``--max-restarts=0`` (Nightwatch
  decides restarts), the job's validated NCCL profile and the hooks' variables.
- Its output goes to a size-rotated log; a tail is kept in memory for the exit report, and
  the whole stream is scanned for torchrun's failure table (per-rank exit codes, first rank
  to fail), exception lines and failure signatures.
- ``stop`` sends SIGTERM to the process group, SIGKILL after the grace period, and confirms in
  /proc that every process of the generation is gone, children that left the group included.
- Restarts are fast because nothing waits that need not: a warm launcher (``agents.launcher``,
  torch already imported) is handed each new generation instead of a cold interpreter, and a
  generation counts as ended as soon as torchrun has printed its failure table — by then its
  workers are stopped and its rendezvous closed, and what is left is a torchrun tearing its
  interpreter down (≈ 0.4 s), which the supervisor cuts short.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import logging.handlers
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agents.protocol.agent import (
    MAX_LOG_LINE,
    MAX_LOG_TAIL_LINES,
    ExitReport,
    LaunchedDetail,
    LaunchPayload,
    RankExit,
    RunningGeneration,
    validate_nccl_profile,
)
from agents.protocol.hooks import EXIT_PAUSED, EXIT_RESUME_REFUSED, EXIT_STALE_GENERATION

log = logging.getLogger(__name__)

#: The agent's own interpreter: torch is installed next to the agent on a GPU node.
DEFAULT_TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
#: torch 2.13 shares the rendezvous store across restarts and restarted workers then dial a dead
#: peer (see PLATFORM-NOTES). Unbuffered: a crash must not eat the last lines.
_TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}


class StaleGeneration(Exception):
    """A command names a generation older than the newest this node has seen for the job."""


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
_EXIT_CODE_SIGNATURES = {EXIT_PAUSED: "paused", EXIT_STALE_GENERATION: "stale_generation",
                         EXIT_RESUME_REFUSED: "resume_refused"}


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


# --- /proc ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    pgid: int
    state: str
    started: int  # clock ticks after boot: tells a process from a later one with the same pid


def _proc_table() -> dict[int, _Proc]:
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited while we looked
        fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) ", comm may hold spaces
        table[int(entry)] = _Proc(pid=int(entry), state=fields[0], ppid=int(fields[1]), pgid=int(fields[2]),
                                  started=int(fields[19]))
    return table


def _alive(procs: Iterable[_Proc]) -> list[_Proc]:
    """Those still running; a zombie has finished (it only waits for its parent to reap it)."""
    table = _proc_table()
    return [p for p in procs if (now := table.get(p.pid)) and now.started == p.started and now.state != "Z"]


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


def _await_exit(gen: _Generation) -> None:
    """Block until torchrun exits (without reaping it: see ``_exited``), then tell the watcher."""
    try:
        os.waitid(os.P_PID, gen.proc.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # already reaped
        pass
    gen.over.set()


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


# --- the supervisor ---------------------------------------------------------------------------

@dataclass
class _Generation:
    job: str
    generation: int
    proc: subprocess.Popen[bytes]
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


#: Command line of the warm launcher; it only replaces the default torchrun, not a custom one.
WARM_LAUNCHER = (sys.executable, "-m", "agents.launcher")
#: A new warm launcher is started this long after the last one was used, not at once: its
#: imports would compete for CPU with the workers the launch just started.
WARM_RESPAWN_DELAY_S = 5.0


class Supervisor:
    def __init__(self, work_dir: Path, *, on_exit: Callable[[str, int, ExitReport], None],
                 torchrun: Sequence[str] = DEFAULT_TORCHRUN, log_max_bytes: int = 20 * 2**20,
                 log_backups: int = 5, default_grace_s: float = 30.0, warm_launcher: bool = True):
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._on_exit = on_exit
        self._torchrun = list(torchrun)
        self._warm_enabled = warm_launcher and tuple(torchrun) == DEFAULT_TORCHRUN
        self._warm: subprocess.Popen[bytes] | None = None
        self._warm_timer: threading.Timer | None = None
        self._closed = False
        self._log_max_bytes = log_max_bytes
        self._log_backups = log_backups
        self._default_grace_s = default_grace_s
        self._lock = threading.Lock()
        self._running: dict[str, _Generation] = {}
        self._fence_path = self.work_dir / "generations.json"
        self._newest: dict[str, int] = json.loads(self._fence_path.read_text()) if self._fence_path.exists() else {}
        if self._warm_enabled:
            self._start_warm()

    def running(self) -> list[RunningGeneration]:
        with self._lock:
            generations = list(self._running.values())
        out = []
        for gen in generations:
            self._refresh_family(gen)
            out.append(RunningGeneration(job=gen.job, generation=gen.generation, started_at=gen.started_at,
                                         pids=sorted(p.pid for p in _alive(gen.seen))))
        return out

    def launch(self, job: str, generation: int, payload: LaunchPayload) -> LaunchedDetail:
        """Start torchrun for ``generation`` (idempotent for the generation already running)."""
        nccl_env = validate_nccl_profile(payload.nccl_env)
        with self._lock:
            self._check_fence(job, generation)
            current = self._running.get(job)
        if current is not None and current.generation == generation:
            return current.launched
        if current is not None:  # one active generation per job: the newer one replaces it
            log.warning("job %s: generation %d supersedes running generation %d", job, generation,
                        current.generation)
            self.stop(job, current.generation, self._default_grace_s)
        gen_dir = self.work_dir / "jobs" / job / f"generation-{generation}"
        gen_dir.mkdir(parents=True, exist_ok=True)
        command = self._command(payload)
        env = self._environment(job, generation, payload, nccl_env, gen_dir)
        cwd = str(payload.workdir or gen_dir)
        proc = self._hand_to_warm(command[len(self._torchrun):], env, cwd)
        warm = proc is not None
        if proc is None:
            proc = subprocess.Popen(  # an argument list, never a shell
                command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True)  # own group: stop signals all of it at once
        launched = LaunchedDetail(pid=proc.pid, log_path=str(gen_dir / "torchrun.log"), command=command, warm=warm)
        gen = _Generation(job=job, generation=generation, proc=proc, log_path=gen_dir / "torchrun.log",
                          launched=launched, started_at=time.time(), started_monotonic=time.monotonic())
        with self._lock:
            self._running[job] = gen
            self._newest[job] = generation
            self._save_fences()
        threading.Thread(target=self._watch, args=(gen,), name=f"watch-{job}-{generation}", daemon=True).start()
        log.info("job %s generation %d: torchrun started (%s), pid %d, log %s", job, generation,
                 "warm" if warm else "cold", proc.pid, gen.log_path)
        return launched

    def stop(self, job: str, generation: int, grace_s: float | None = None) -> ExitReport | None:
        """Stop ``generation`` of ``job``; its exit report, or None if it does not run here."""
        grace_s = self._default_grace_s if grace_s is None else grace_s
        with self._lock:
            self._check_fence(job, generation)
            gen = self._running.get(job)
        if gen is None or gen.generation != generation:
            return None
        gen.requested_stop = True
        self._refresh_family(gen)
        _signal_all(_alive(gen.seen), signal.SIGTERM)
        if not self._wait_gone(gen, grace_s):
            log.warning("job %s generation %d: still running %.0f s after SIGTERM; sending SIGKILL",
                        job, generation, grace_s)
            self._kill_family(gen)
        if not self._wait_gone(gen, 10.0):
            survivors = sorted(p.pid for p in _alive(gen.seen))
            raise RuntimeError(f"job {job} generation {generation}: processes {survivors} survived SIGKILL")
        gen.ended.wait(timeout=30)
        return gen.report

    def shutdown(self, grace_s: float | None = None) -> None:
        with self._lock:
            running = [(g.job, g.generation) for g in self._running.values()]
            self._closed = True
            timer, warm, self._warm_timer, self._warm = self._warm_timer, self._warm, None, None
        if timer is not None:
            timer.cancel()
        if warm is not None:
            _dismiss(warm)
        for job, generation in running:
            self.stop(job, generation, grace_s)

    # --- the warm launcher -----------------------------------------------------------------------

    def _start_warm(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTWATCH_")}
        env.update(_TORCHRUN_ENV)
        with self._lock:
            self._warm_timer = None
            if self._closed or self._warm is not None:
                return
            try:
                self._warm = subprocess.Popen(
                    WARM_LAUNCHER, cwd=self.work_dir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, start_new_session=True)
            except OSError:
                log.exception("cannot start a warm launcher; generations start cold")

    def _hand_to_warm(self, args: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen[bytes] | None:
        """The warm launcher, now running ``args``; None when there is none ready (start cold)."""
        if not self._warm_enabled:
            return None
        with self._lock:
            warm, self._warm = self._warm, None
            if not self._closed and self._warm_timer is None:
                self._warm_timer = threading.Timer(WARM_RESPAWN_DELAY_S, self._start_warm)
                self._warm_timer.daemon = True
                self._warm_timer.start()
        if warm is None or warm.poll() is not None:
            if warm is not None:
                log.warning("the warm launcher had exited (%s); starting this generation cold", warm.returncode)
            return None
        assert warm.stdin is not None  # started with stdin=PIPE
        try:
            warm.stdin.write(json.dumps({"args": args, "env": env, "cwd": cwd}).encode() + b"\n")
            warm.stdin.close()
        except OSError:
            log.warning("the warm launcher did not take the launch; starting this generation cold")
            _dismiss(warm)
            return None
        return warm

    # --- internals -----------------------------------------------------------------------------

    def check_fence(self, job: str, generation: int) -> None:
        """Raise ``StaleGeneration`` if ``generation`` is older than the newest seen for ``job``."""
        with self._lock:
            self._check_fence(job, generation)

    def _check_fence(self, job: str, generation: int) -> None:
        newest = self._newest.get(job)
        if newest is not None and generation < newest:
            raise StaleGeneration(f"job {job}: generation {generation} is older than generation {newest}")

    def _save_fences(self) -> None:
        tmp = self._fence_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._newest))
        os.replace(tmp, self._fence_path)

    def _command(self, p: LaunchPayload) -> list[str]:
        command = [*self._torchrun, f"--nnodes={p.nnodes}", f"--nproc-per-node={p.nproc_per_node}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint={p.rdzv_endpoint}", f"--rdzv-id={p.rdzv_id}",
                   f"--node-rank={p.node_rank}", "--max-restarts=0"]
        if p.rdzv_is_host:
            command.append("--rdzv-conf=is_host=1")
        return [*command, p.script, *p.args]

    @staticmethod
    def _environment(job: str, generation: int, p: LaunchPayload, nccl_env: dict[str, str],
                     gen_dir: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTWATCH_")}
        env.update(nccl_env)
        hooks = {"NIGHTWATCH_URL": p.hooks_url, "NIGHTWATCH_TOKEN": p.hooks_token, "NIGHTWATCH_JOB": job,
                 "NIGHTWATCH_GENERATION": str(generation), "NIGHTWATCH_CKPT_DIR": p.ckpt_dir,
                 "NIGHTWATCH_RESUME_FROM": p.resume_from, "NIGHTWATCH_SPOOL_DIR": str(gen_dir / "spool"),
                 "NIGHTWATCH_SKIP_DATA": ",".join(f"{a}-{b}" for a, b in p.skip_data) or None}
        env.update({k: v for k, v in hooks.items() if v is not None})
        env.update(_TORCHRUN_ENV)
        return env

    def _watch(self, gen: _Generation) -> None:
        pump = threading.Thread(target=self._pump_output, args=(gen,), name=f"log-{gen.job}", daemon=True)
        pump.start()
        threading.Thread(target=_await_exit, args=(gen,), name=f"exit-{gen.job}", daemon=True).start()
        while not gen.over.wait(0.5):
            self._refresh_family(gen)
        if not _exited(gen.proc):
            log.info("job %s generation %d: torchrun printed its failure table; not waiting for it to exit",
                     gen.job, gen.generation)
        # torchrun is done; whatever of its family is left (torchrun tearing down, a rank that
        # ignored SIGTERM, a grandchild that setsid'd away) belongs to a finished generation.
        self._kill_family(gen)
        gen.proc.wait()  # reap only now: see _exited
        pump.join(timeout=5.0)
        signature, error_line = (None, None) if gen.requested_stop else classify_exit(gen.proc.returncode, gen.scan)
        gen.report = ExitReport(
            exit_code=gen.proc.returncode, ranks=sorted(gen.scan.ranks.values(), key=lambda r: r.rank),
            root_cause_rank=gen.scan.root_cause_rank, signature=signature, error_line=error_line,
            log_tail=list(gen.tail), log_path=str(gen.log_path),
            requested_stop=gen.requested_stop, runtime_s=time.monotonic() - gen.started_monotonic)
        with self._lock:
            if self._running.get(gen.job) is gen:
                del self._running[gen.job]
        log.info("job %s generation %d: torchrun exited %s (%s)", gen.job, gen.generation, gen.proc.returncode,
                 "stopped" if gen.requested_stop else signature or "success")
        try:  # before `ended`: whoever waits on stop() finds the exit already reported
            self._on_exit(gen.job, gen.generation, gen.report)
        except Exception:
            log.exception("job %s generation %d: exit callback failed", gen.job, gen.generation)
        gen.ended.set()

    def _pump_output(self, gen: _Generation) -> None:
        handler = logging.handlers.RotatingFileHandler(gen.log_path, maxBytes=self._log_max_bytes,
                                                       backupCount=self._log_backups)
        handler.setFormatter(logging.Formatter("%(message)s"))
        stream = gen.proc.stdout
        assert stream is not None  # Popen was given stdout=PIPE
        try:
            for raw in iter(lambda: stream.readline(65536), b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))
                gen.tail.append(line[:MAX_LOG_LINE])
                gen.scan.feed(line)
                if gen.scan.table_complete:
                    gen.over.set()
        finally:
            handler.close()
            stream.close()

    def _refresh_family(self, gen: _Generation) -> None:
        if gen.proc.returncode is None:  # reaped: its pid may belong to someone else by now
            gen.seen |= _family(gen.proc.pid, gen.proc.pid)

    def _wait_gone(self, gen: _Generation, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self._refresh_family(gen)
            if _exited(gen.proc) and not _alive(gen.seen):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _kill_family(self, gen: _Generation) -> None:
        self._refresh_family(gen)
        _signal_all(_alive(gen.seen), signal.SIGKILL)
