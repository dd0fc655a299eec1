"""The supervisor: launches, watches, adopts and stops generations (see the package's docstring)."""

from __future__ import annotations

import dataclasses
import json
import logging
import logging.handlers
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agents.protocol import ProtocolError, dump
from agents.protocol.agent import (
    INPROCESS_RESTARTS_ENV,
    MAX_LOG_LINE,
    ExitReport,
    LaunchedDetail,
    LaunchPayload,
    LaunchSpecError,
    RankGone,
    RunningGeneration,
    inprocess_environment,
    module_files,
    nccl_environment,
    snapshot_environment,
    validate_launch,
)
from agents.supervisor.generation import _Generation, _read_record, _record_path
from agents.supervisor.launch import _TORCHRUN_ENV, DEFAULT_TORCHRUN, WARM_LAUNCHER, _file_of
from agents.supervisor.output import _derived_exit_code, classify_exit, decode_line
from agents.supervisor.procs import (
    _alive,
    _as_now,
    _dismiss,
    _family,
    _is_zygote,
    _proc_table,
    _signal_all,
    _stat,
    _worker_gone,
)
from agents.supervisor.warm_client import HOLD_FILE, REPLACEMENT_LINE
from agents.supervisor.zygote import private_socket_dir, remove_socket_dir, through_client, worker_pids

#: The package's name, as before the split into modules: the JSON log's "logger" field stays the same.
log = logging.getLogger(__package__)


def _cold_environment(env: dict[str, str], job: str, generation: int) -> dict[str, str]:
    """``env`` for a generation that starts cold (no warm launcher ready: two launches on this node
    within ``WARM_RESPAWN_DELAY_S``): without a zygote no rank can be replaced, so its ranks are told
    of no in-process restarts and torchrun's store is theirs as for any cold start."""
    if INPROCESS_RESTARTS_ENV not in env:
        return env
    log.warning("job %s generation %d starts cold (no warm launcher ready): no in-process restarts in it; "
                "a crash restarts the whole generation", job, generation)
    return {**{k: v for k, v in env.items() if k != INPROCESS_RESTARTS_ENV}, **_TORCHRUN_ENV}


def _hold(zygote_dir: Path | None, reason: str) -> None:
    if zygote_dir is not None:
        try:
            (zygote_dir / HOLD_FILE).write_text(reason[:500])
        except OSError:  # the generation has just ended and taken its directory along
            pass


class StaleGeneration(Exception):
    """A command names a generation older than the newest this node has seen for the job."""


# --- the supervisor ---------------------------------------------------------------------------

def _await_exit(gen: _Generation) -> None:
    """Block until torchrun exits, then tell the watcher. Our child is waited for without being
    reaped (see ``_exited``); an adopted one is polled in /proc."""
    if gen.proc is not None:
        try:
            os.waitid(os.P_PID, gen.proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # already reaped
            pass
    else:
        while not gen.torchrun_exited():
            time.sleep(ADOPTED_POLL_S)
    gen.over.set()


#: A new warm launcher is started this long after the last one was used, not at once: its
#: imports would compete for CPU with the workers the launch just started.
WARM_RESPAWN_DELAY_S = 5.0
#: How long a rank may take to act on torchrun's SIGTERM once torchrun closes the worker group
#: (a worker failed); after that it is killed rather than waited for (torchrun waits 30 s).
WORKER_CLOSE_GRACE_S = 2.0
#: The watcher's tick: how late the family is refreshed and a lingering rank noticed.
WATCH_TICK_S = 0.25
#: How often the log is read when there was nothing new, and an adopted torchrun's liveness checked.
LOG_POLL_S = 0.05
ADOPTED_POLL_S = 0.2
_READ_CHUNK = 65536
#: A rank's worker stopped (state T: SIGSTOP, SIGTSTP, a frozen cgroup's old freezer) this long is
#: hung: it holds its peers in their next collective for as long as it stays stopped. With in-process
#: restarts it is killed, and its warm client replaces it like a crashed one (the survivors' broken
#: collective starts the next round), in about a second instead of a progress timeout and a whole
#: restart. One second: four watch ticks, and no training process stops itself. A process stopped by
#: a debugger (state t, ptrace) is left alone.
STOPPED_WORKER_KILL_S = 1.0


class Supervisor:
    def __init__(self, work_dir: Path, *, on_exit: Callable[[str, int, ExitReport], None],
                 torchrun: Sequence[str] = DEFAULT_TORCHRUN, log_max_bytes: int = 20 * 2**20,
                 log_backups: int = 5, default_grace_s: float = 30.0, warm_launcher: bool = True,
                 warm_workers: bool = False, snapshot_dir: Path | None = None,
                 on_output: Callable[[str, int, str], None] | None = None,
                 on_rank_gone: Callable[[str, int, RankGone], None] | None = None):
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._on_exit = on_exit
        #: Every line of a generation's output, as it is read: (job, generation, line). The agent
        #: ships them (``agents.agent.logship``); it must not block.
        self._on_output = on_output
        #: A rank of a running generation is going down: (job, generation, RankGone). Called
        #: at the first sign, once per generation (twice if two threads see it at that moment:
        #: harmless, the agent keys the notice), from the thread that saw it; it must not block.
        #: The signs: a worker found gone (``rank_exited_at``), or a rank's uncaught exception in the
        #: output (its last line), which can come seconds before the rank exits (atexit handlers,
        #: threads) and torchrun closes the group; or a stopped worker this supervisor killed
        #: (``STOPPED_WORKER_KILL_S``).
        self._on_rank_gone = on_rank_gone
        #: Deaths told of (job, generation, ranks replaced in process before it); a few bytes each.
        self._told: set[tuple[str, int, int]] = set()
        self._torchrun = list(torchrun)
        self._warm_enabled = warm_launcher and tuple(torchrun) == DEFAULT_TORCHRUN
        #: Ranks forked from a zygote of the warm launcher (``agents.supervisor.zygote``), not cold.
        self._warm_workers = warm_workers and self._warm_enabled
        #: The node memory the ranks keep snapshots in (the hooks' default when None).
        self._snapshot_dir = snapshot_dir
        self._warm: subprocess.Popen[bytes] | None = None
        self._warm_timer: threading.Timer | None = None
        self._closed = False
        self._log_max_bytes = log_max_bytes
        self._log_backups = log_backups
        self._default_grace_s = default_grace_s
        self._lock = threading.Lock()
        self._running: dict[str, _Generation] = {}
        self._fence_path = self.work_dir / "generations.json"
        #: Why ranks are no longer replaced in process on this node (``hold_replacements``); None: they may be.
        self._held: str | None = None
        self._newest: dict[str, int] = json.loads(self._fence_path.read_text()) if self._fence_path.exists() else {}
        #: One record per generation that runs (see ``adopt``).
        self._records_dir = self.work_dir / "running"
        self._records_dir.mkdir(exist_ok=True)
        if self._warm_enabled:
            self._start_warm()

    @property
    def replacements_held(self) -> bool:
        return self._held is not None

    def hold_replacements(self, reason: str) -> None:
        """No rank of this node is replaced in process from now on (``warm_client``: the hold file
        beside each zygote's socket): the node failed its health check (an Xid) or is draining, so a
        crash there ends its generation and the control plane moves the job. Kept for the agent's life."""
        with self._lock:
            self._held = reason
            generations = list(self._running.values())
        for gen in generations:
            _hold(gen.zygote_dir, reason)

    def running(self) -> list[RunningGeneration]:
        with self._lock:
            generations = list(self._running.values())
        out = []
        for gen in generations:
            self._refresh_family(gen)
            out.append(RunningGeneration(job=gen.job, generation=gen.generation, started_at=gen.started_at,
                                         pids=sorted(p.pid for p in _alive(gen.seen))))
        return out

    def adopt(self) -> list[RunningGeneration]:
        """Take back the generations that an earlier process of the agent started here; those now running.

        The agent can die (SIGKILL, OOM, an upgrade) while its generations run on in their own
        sessions. A record whose torchrun still runs — same pid *and* same start time, so a pid
        the kernel reused is never taken for it — is watched again: it is listed by ``running``,
        its end is reported through ``on_exit`` and ``stop`` works on it. A record whose torchrun
        is gone is reported as exited, with what its log says, and removed. Call it once, before
        the first launch, when ``on_exit`` can take reports.
        """
        records = []
        for path in sorted(self._records_dir.glob("*.json")):
            try:
                records.append(_read_record(path))
            except (OSError, ValueError, ProtocolError) as exc:
                log.error("ignoring the unreadable generation record %s: %s", path, exc)
                path.unlink(missing_ok=True)
        adopted = []
        for record in sorted(records, key=lambda r: r["generation"]):
            job, generation = record["job"], record["generation"]
            now = _stat(record["pid"])
            alive = now is not None and now.started == record["pid_started"] and now.state != "Z"
            gen = _Generation(job=job, generation=generation, pid=record["pid"], pid_started=record["pid_started"],
                              proc=None, log_path=Path(record["log_path"]), launched=record["launched"],
                              started_at=record["started_at"],
                              started_monotonic=time.monotonic() - max(0.0, time.time() - record["started_at"]),
                              zygote_dir=Path(record["zygote_dir"]) if isinstance(record.get("zygote_dir"), str)
                              else None)
            # Its ranks are still replaced in process, and a stopped one still killed for that
            # (``_kill_stopped_workers``): adopted without it, a hang after an agent restart waited for
            # the control plane's progress timeout (9.9 s in bench.chaos, against 1.2 s).
            gen.inprocess = record.get("inprocess") is True and gen.zygote_dir is not None
            with self._lock:
                superseded = self._running.get(job)
                if alive:
                    self._running[job] = gen
                if generation > self._newest.get(job, -1):
                    self._newest[job] = generation
                    self._save_fences()
            if alive:
                adopted.append(gen)
                log.info("job %s generation %d: adopted torchrun pid %d, still running; log %s", job, generation,
                         gen.pid, gen.log_path)
            else:
                try:
                    gen.ended_at = max(gen.started_at, gen.log_path.stat().st_mtime)
                except OSError:
                    gen.ended_at = gen.started_at
                log.warning("job %s generation %d: torchrun pid %d ended while no agent watched it", job,
                            generation, gen.pid)
            threading.Thread(target=self._watch, args=(gen,), name=f"watch-{job}-{generation}", daemon=True).start()
            if alive and superseded is not None:  # one active generation per job, as in launch()
                log.warning("job %s: adopted generation %d supersedes generation %d; stopping it", job,
                            generation, superseded.generation)
                self._terminate(superseded, self._default_grace_s)
        return [r for r in self.running() if any(r.job == g.job and r.generation == g.generation for g in adopted)]

    def launch(self, job: str, generation: int, payload: LaunchPayload) -> LaunchedDetail:
        """Start torchrun for ``generation`` (idempotent for the generation already running).

        A payload whose script or module is not a file of the code directory, or whose profile
        is not allowed, raises ``LaunchSpecError`` before anything is stopped or started.
        """
        gen_dir = self.work_dir / "jobs" / job / f"generation-{generation}"
        cwd = str(payload.workdir or gen_dir)
        command = self._command(payload, Path(cwd))
        nccl_env = nccl_environment(payload.nccl_env, str(gen_dir))
        with self._lock:
            self._check_fence(job, generation)
            current = self._running.get(job)
        if current is not None and current.generation == generation:
            return current.launched
        if current is not None:  # one active generation per job: the newer one replaces it
            log.warning("job %s: generation %d supersedes running generation %d", job, generation,
                        current.generation)
            self.stop(job, current.generation, self._default_grace_s)
        gen_dir.mkdir(parents=True, exist_ok=True)
        log_path = gen_dir / "torchrun.log"
        env = self._environment(job, generation, payload, nccl_env, gen_dir)
        if payload.inprocess_restarts and self._warm_workers:
            env.update(inprocess_environment(payload))
            del env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]  # see inprocess_environment
        elif payload.inprocess_restarts:
            log.warning("job %s generation %d asks for in-process restarts, which need warm workers "
                        "(off on this agent): a crash restarts the whole generation", job, generation)
        # A fresh file for this launch (the reader starts at its beginning), appended to by torchrun.
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        zygote_dir = private_socket_dir() if self._warm_workers else None
        if self._held is not None:
            _hold(zygote_dir, self._held)
        try:
            proc = self._hand_to_warm(command[len(self._torchrun):], env, cwd, log_path, zygote_dir)
            warm = proc is not None
            if not warm and zygote_dir is not None:  # started cold: its ranks too
                remove_socket_dir(zygote_dir)
                zygote_dir = None
            if proc is None:
                env = _cold_environment(env, job, generation)
                proc = subprocess.Popen(  # an argument list, never a shell
                    command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                    stderr=subprocess.STDOUT, start_new_session=True)  # own group: stop signals all of it at once
        finally:
            os.close(log_fd)
        started = _stat(proc.pid)  # our child, not reaped before the watcher does it: still in /proc
        if started is None:
            raise RuntimeError(f"job {job} generation {generation}: torchrun pid {proc.pid} is not in /proc")
        launched = LaunchedDetail(pid=proc.pid, log_path=str(log_path), command=command, warm=warm)
        gen = _Generation(job=job, generation=generation, pid=proc.pid, pid_started=started.started, proc=proc,
                          log_path=log_path, launched=launched, started_at=time.time(),
                          started_monotonic=time.monotonic(), zygote_dir=zygote_dir,
                          inprocess=bool(payload.inprocess_restarts) and zygote_dir is not None)
        with self._lock:
            self._running[job] = gen
            self._newest[job] = generation
            self._save_fences()
        self._save_record(gen)
        threading.Thread(target=self._watch, args=(gen,), name=f"watch-{job}-{generation}", daemon=True).start()
        log.info("job %s generation %d: torchrun started (%s), pid %d, log %s", job, generation,
                 ("warm, warm workers" if zygote_dir else "warm") if warm else "cold", proc.pid, gen.log_path)
        return launched

    def stop(self, job: str, generation: int, grace_s: float | None = None) -> ExitReport | None:
        """Stop ``generation`` of ``job``; its exit report, or None if it does not run here."""
        grace_s = self._default_grace_s if grace_s is None else grace_s
        with self._lock:
            self._check_fence(job, generation)
            gen = self._running.get(job)
        if gen is None or gen.generation != generation:
            return None
        return self._terminate(gen, grace_s)

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
                # Until it is handed a generation (and its log), what it prints goes to a file of
                # its own: a pipe to the agent would break if the agent died.
                with open(self.work_dir / "warm-launcher.log", "ab") as output:
                    self._warm = subprocess.Popen(
                        [*WARM_LAUNCHER, *(["--workers"] if self._warm_workers else [])], cwd=self.work_dir,
                        env=env, stdin=subprocess.PIPE, stdout=output,
                        stderr=subprocess.STDOUT, start_new_session=True)
            except OSError:
                log.exception("cannot start a warm launcher; generations start cold")

    def _hand_to_warm(self, args: list[str], env: dict[str, str], cwd: str, log_path: Path,
                      zygote_dir: Path | None = None) -> subprocess.Popen[bytes] | None:
        """The warm launcher, now running ``args``; None when there is none ready (start cold).
        With ``zygote_dir``, its ranks are forked by a zygote listening there (warm workers)."""
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
        request: dict[str, Any] = {"args": args, "env": env, "cwd": cwd, "output": str(log_path)}
        if zygote_dir is not None:
            socket_path = str(zygote_dir / "sock")
            request.update(args=through_client(args, socket_path), zygote=socket_path)
        try:
            warm.stdin.write(json.dumps(request).encode() + b"\n")
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

    def _save_record(self, gen: _Generation) -> None:
        """Write ``gen``'s record atomically (and durably: it must survive the crash it is for)."""
        path = _record_path(self._records_dir, gen.job, gen.generation)
        record = {"job": gen.job, "generation": gen.generation, "pid": gen.pid, "pid_started": gen.pid_started,
                  "log_path": str(gen.log_path), "started_at": gen.started_at, "launched": dump(gen.launched),
                  "inprocess": gen.inprocess,
                  **({"zygote_dir": str(gen.zygote_dir)} if gen.zygote_dir is not None else {})}
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            log.exception("job %s generation %d: cannot record it; an agent restart would not adopt it",
                          gen.job, gen.generation)

    def _drop_record(self, gen: _Generation) -> None:
        _record_path(self._records_dir, gen.job, gen.generation).unlink(missing_ok=True)

    def _command(self, p: LaunchPayload, code_dir: Path) -> list[str]:
        """torchrun's argument list: its own options, then the script (or ``--module`` and the
        module), then the job's arguments verbatim. The target is checked again here, whoever
        built the payload: it must not read as a torchrun option and must be a file of
        ``code_dir`` (``LaunchSpecError`` otherwise)."""
        validate_launch(p)
        # The static rendezvous: the control plane placed the generation, so every node knows its
        # node rank and node rank 0 (the endpoint's address) hosts the store. c10d's dynamic
        # rendezvous numbered the nodes by the order they joined (it ignores --node-rank), left the
        # host to be guessed from addresses (two nodes of one machine both tried to host), and polls
        # its state once a second: the node that joined first waited up to a second after the last
        # one came, in every relaunch. Torchrun's own restarts are off (Nightwatch relaunches a
        # generation), which is all c10d would add.
        command = [*self._torchrun, f"--nnodes={p.nnodes}", f"--nproc-per-node={p.nproc_per_node}",
                   "--rdzv-backend=static", f"--rdzv-endpoint={p.rdzv_endpoint}", f"--rdzv-id={p.rdzv_id}",
                   f"--node-rank={p.node_rank}", "--max-restarts=0"]
        root = code_dir.resolve()
        if p.module is not None:
            if not any(all(_file_of(root, name) for name in files) for files in module_files(p.module)):
                raise LaunchSpecError("module", f"{p.module!r} is not a module of the code directory {root} (every "
                                                "package needs its __init__.py)")
            return [*command, "--module", p.module, *p.args]
        assert p.script is not None  # validate_launch: exactly one of script and module
        if not _file_of(root, p.script):
            raise LaunchSpecError("script", f"{p.script!r} is not a file inside the code directory {root}")
        return [*command, p.script, *p.args]

    def _environment(self, job: str, generation: int, p: LaunchPayload, nccl_env: dict[str, str],
                     gen_dir: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTWATCH_")}
        env.update(nccl_env)
        hooks = {"NIGHTWATCH_URL": p.hooks_url, "NIGHTWATCH_TOKEN": p.hooks_token, "NIGHTWATCH_JOB": job,
                 "NIGHTWATCH_GENERATION": str(generation), "NIGHTWATCH_CKPT_DIR": p.ckpt_dir,
                 "NIGHTWATCH_RESUME_FROM": p.resume_from, "NIGHTWATCH_SPOOL_DIR": str(gen_dir / "spool"),
                 "NIGHTWATCH_SKIP_DATA": ",".join(f"{a}-{b}" for a, b in p.skip_data) or None,
                 **snapshot_environment(p),
                 "NIGHTWATCH_SNAPSHOT_DIR": str(self._snapshot_dir) if self._snapshot_dir else None}
        env.update({k: v for k, v in hooks.items() if v is not None})
        env.update(_TORCHRUN_ENV)
        return env

    def _watch(self, gen: _Generation) -> None:
        reader = threading.Thread(target=self._read_output, args=(gen,), name=f"log-{gen.job}", daemon=True)
        reader.start()
        threading.Thread(target=_await_exit, args=(gen,), name=f"exit-{gen.job}", daemon=True).start()
        while not gen.over.wait(WATCH_TICK_S):
            self._refresh_family(gen)
            self._end_doomed_workers(gen)
            self._kill_stopped_workers(gen)
        if not gen.torchrun_exited():
            log.info("job %s generation %d: torchrun printed its failure table; not waiting for it to exit",
                     gen.job, gen.generation)
        # torchrun is done; whatever of its family is left (torchrun tearing down, a rank that
        # ignored SIGTERM, a grandchild that setsid'd away) belongs to a finished generation.
        self._kill_family(gen)
        ranks = sorted(gen.scan.ranks.values(), key=lambda r: r.rank)
        if gen.zygote_dir is not None:  # torchrun's table names the warm clients: report the ranks
            forked = worker_pids(gen.zygote_dir)
            ranks = [dataclasses.replace(r, pid=forked.get(r.pid, r.pid)) if r.pid is not None else r for r in ranks]
            remove_socket_dir(gen.zygote_dir)
        if gen.proc is not None:
            gen.proc.wait()  # reap only now: see _exited
        gen.output_done.set()  # nothing of the family writes any more: read the log to its end
        reader.join(timeout=5.0)
        exit_code = gen.proc.returncode if gen.proc is not None else _derived_exit_code(gen.scan)
        signature, error_line = (None, None) if gen.requested_stop else classify_exit(exit_code, gen.scan)
        runtime_s = (max(0.0, gen.ended_at - gen.started_at) if gen.ended_at is not None
                     else time.monotonic() - gen.started_monotonic)
        ended_at = gen.ended_at if gen.ended_at is not None else min(gen.failing_since or time.time(), time.time())
        gen.report = ExitReport(
            exit_code=exit_code, ranks=ranks,
            root_cause_rank=gen.scan.root_cause_rank, signature=signature, error_line=error_line,
            log_tail=list(gen.tail), log_path=str(gen.log_path),
            requested_stop=gen.requested_stop, runtime_s=runtime_s, ended_at=ended_at,
            rank_exited_at=gen.rank_exited_at, torchrun_failed_at=gen.scan.closing_logged_at)
        with self._lock:
            if self._running.get(gen.job) is gen:
                del self._running[gen.job]
        log.info("job %s generation %d: torchrun exited %s (%s)", gen.job, gen.generation, exit_code,
                 "stopped" if gen.requested_stop else signature or "success")
        try:  # before `ended`: whoever waits on stop() finds the exit already reported
            self._on_exit(gen.job, gen.generation, gen.report)
        except Exception:
            log.exception("job %s generation %d: exit callback failed", gen.job, gen.generation)
        # Only once reported: an agent that dies before this reports the exit again when it restarts.
        self._drop_record(gen)
        gen.ended.set()

    def _end_doomed_workers(self, gen: _Generation) -> None:
        """Kill the ranks torchrun is still waiting for, ``WORKER_CLOSE_GRACE_S`` after it began
        closing the worker group.

        torchrun SIGTERMs the surviving ranks when one fails and waits up to 30 s for them; a rank
        that is stopped (SIGSTOP, a debugger) or hung in the kernel cannot act on it, and the
        exit, with its root cause, would reach the control plane only then. The generation is
        lost already, so nothing is gained by waiting. Only torchrun's own children named in its
        closing lines are killed (SIGCONT first, so that a stopped one is not left half-dead);
        torchrun then records them and prints its failure table, root cause unchanged.
        """
        if gen.requested_stop or not gen.scan.closing_pids:
            return  # a requested stop has its own grace period
        now = time.monotonic()
        if gen.closing_since is None:
            gen.closing_since = now
            gen.failing_since = time.time()
            return
        if now - gen.closing_since < WORKER_CLOSE_GRACE_S:
            return
        table = _proc_table()
        doomed = [proc for pid in list(gen.scan.closing_pids)
                  if (proc := table.get(pid)) is not None and proc.ppid == gen.pid and proc.state != "Z"]
        if doomed:
            log.warning("job %s generation %d: ranks %s still there %.0f s after torchrun began closing the worker "
                        "group; killing them", gen.job, gen.generation, sorted(p.pid for p in doomed),
                        now - gen.closing_since)
            _signal_all(doomed, signal.SIGCONT)
            _signal_all(doomed, signal.SIGKILL)

    def _read_output(self, gen: _Generation) -> None:
        """Tail torchrun's log from its beginning until the watcher says the family is gone."""
        with open(gen.log_path, "rb") as stream:
            pending = b""
            while True:
                last_round = gen.output_done.is_set()  # read before reading: nothing written earlier is missed
                chunk = stream.read(_READ_CHUNK)
                if chunk:
                    pending = self._take_output(gen, pending + chunk)
                    if stream.tell() > self._log_max_bytes:
                        pending = self._rotate_log(gen, stream, pending)
                    continue
                if last_round:
                    break
                gen.output_done.wait(LOG_POLL_S)
            if pending:
                self._take_line(gen, pending)

    def _take_output(self, gen: _Generation, data: bytes) -> bytes:
        """Feed the complete lines of ``data``; the unfinished last line is returned to wait for more."""
        *lines, rest = data.split(b"\n")
        for raw in lines:
            self._take_line(gen, raw)
        if len(rest) >= _READ_CHUNK:  # a line without end in sight: take it in pieces
            self._take_line(gen, rest)
            rest = b""
        return rest

    def _take_line(self, gen: _Generation, raw: bytes) -> None:
        line = decode_line(raw)
        if self._on_output is not None:
            try:
                self._on_output(gen.job, gen.generation, line)
            except Exception:  # shipping output must never stop the reading that finds the exit
                log.exception("job %s generation %d: the output callback failed", gen.job, gen.generation)
        gen.tail.append(line[:MAX_LOG_LINE])
        if line.startswith(REPLACEMENT_LINE):
            # A rank died and its warm client replaces it: a death to tell of, unless the tree walk
            # did (a rank that lived less than a watch tick was never seen by it).
            if not gen.requested_stop:
                self._rank_gone(gen, time.time(), None)
            gen.replaced += 1  # the watcher re-arms the rank-gone notice (``_refresh_family``)
            gen.errors_told = len(gen.scan.error_lines)
            return
        gen.scan.feed(line)
        told = (gen.job, gen.generation, gen.replaced) in self._told
        if len(gen.scan.error_lines) > gen.errors_told and not gen.requested_stop and not told:
            # "[rank0]: RuntimeError: ...": the last line of a rank's uncaught exception.
            raised = next((error for rank, error in gen.scan.error_lines[gen.errors_told:] if rank is not None), None)
            if raised is not None:
                self._rank_gone(gen, time.time(), raised)
        if gen.scan.table_complete:
            gen.over.set()

    def _rotate_log(self, gen: _Generation, stream: Any, pending: bytes) -> bytes:
        """Move what the log holds to ``.1`` (older backups shift up) and empty the log.

        torchrun keeps the file open for appending, so renaming it would only rename what torchrun
        writes to: the content is copied and the file truncated instead (logrotate's
        copytruncate). Whatever is written between the last read and the truncation is lost: the
        few microseconds of two system calls.
        """
        position = stream.tell()
        if self._log_backups > 0:
            for n in range(self._log_backups - 1, 0, -1):
                older = Path(f"{gen.log_path}.{n}")
                if older.exists():
                    os.replace(older, f"{gen.log_path}.{n + 1}")
            with open(gen.log_path, "rb") as source, open(f"{gen.log_path}.1", "wb") as backup:
                shutil.copyfileobj(_Prefix(source, position), backup)
                late = stream.read()  # written while copying
                backup.write(late)
                os.truncate(gen.log_path, 0)
        else:
            late = stream.read()
            os.truncate(gen.log_path, 0)
        stream.seek(0)
        return self._take_output(gen, pending + late)

    def _refresh_family(self, gen: _Generation) -> None:
        if gen.torchrun_present():
            family = _family(gen.pid, gen.pid)
            if gen.replaced_seen < gen.replaced:
                # A rank was replaced in process: its death was told; the next one is news again. Only
                # the dead are forgotten: a process of the family that left it (a dead rank's orphaned
                # child) is still to be killed at the end.
                gen.replaced_seen = gen.replaced
                alive = {(p.pid, p.started) for p in _proc_table().values() if p.state != "Z"}
                gen.seen = {p for p in gen.seen if (p.pid, p.started) in alive}
                gen.rank_exited_at = None
            if gen.rank_exited_at is None and not gen.requested_stop and _worker_gone(gen.seen, family, gen.pid):
                gen.rank_exited_at = time.time()
                self._rank_gone(gen, gen.rank_exited_at, None)
            gen.seen |= family

    def _kill_stopped_workers(self, gen: _Generation) -> None:
        """Kill the workers of ``gen`` stopped (state T) for ``STOPPED_WORKER_KILL_S``, so that their
        warm clients replace them in process; told first, as a rank gone with ``stopped_s``. Only
        for a generation whose ranks are replaced in process, not being stopped, on a node not held:
        elsewhere a kill would only turn the hang into a crash of the whole generation, which the
        control plane's hang verdict already restarts."""
        if not gen.inprocess or gen.zygote_dir is None or gen.requested_stop or self._held is not None:
            return
        now = time.time()
        stopped = {}
        for pid in worker_pids(gen.zygote_dir).values():
            proc = _stat(pid)
            if proc is not None and proc.state == "T":
                stopped[(pid, proc.started)] = gen.stopped_since.get((pid, proc.started), now)
        gen.stopped_since = stopped
        for (pid, started), since in list(stopped.items()):
            if now - since < STOPPED_WORKER_KILL_S:
                continue
            del gen.stopped_since[(pid, started)]
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue  # gone meanwhile
            try:
                proc = _stat(pid)  # the pidfd holds the process: is it still the stopped worker?
                if proc is None or proc.started != started or proc.state != "T":
                    continue
                log.warning("job %s generation %d: rank worker pid %d has been stopped for %.1f s: killing it, "
                            "to be replaced in process", gen.job, gen.generation, pid, now - since)
                self._rank_gone(gen, since, None, stopped_s=round(now - since, 3))
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)

    def _rank_gone(self, gen: _Generation, at: float, error_line: str | None, *,
                   stopped_s: float | None = None) -> None:
        """Say at once that a rank of ``gen`` is going down: torchrun reports it seconds later, once
        it has closed the rest of the group, and a hang sweep must not take that silence for a hang."""
        told = (gen.job, gen.generation, gen.replaced)
        if self._on_rank_gone is None or told in self._told:
            return
        self._told.add(told)
        try:
            self._on_rank_gone(gen.job, gen.generation, RankGone(at=at, error_line=error_line, stopped_s=stopped_s))
        except Exception:  # the notice is a hint; the exit report still follows
            log.exception("job %s generation %d: the rank-gone callback failed", gen.job, gen.generation)

    def _terminate(self, gen: _Generation, grace_s: float) -> ExitReport | None:
        gen.requested_stop = True
        self._refresh_family(gen)
        family = _alive(gen.seen)
        _signal_all(family, signal.SIGTERM)
        # Then SIGCONT, as systemd does when it stops a unit: a stopped process (a debugger, a
        # SIGSTOP, a job-control accident) only acts on the pending SIGTERM once it runs again;
        # otherwise it would sit out the whole grace period and torchrun's own wait with it.
        _signal_all(family, signal.SIGCONT)
        if self._wait_gone(gen, grace_s, but_torchrun=True) and gen.torchrun_present() and not gen.torchrun_exited():
            # Every rank (and every process of theirs) is gone: nothing of the generation can write
            # any more, and what torchrun does next (close an empty worker group, print its
            # traceback, tear an interpreter with torch loaded down) took 0.3 s alone and 0.55-0.7 s
            # on a busy node, before the stop could be acknowledged and the next generation
            # launched (bench.node_loss). Its zygote dies with it.
            _signal_all(_alive([p for p in gen.seen if p.pid == gen.pid]), signal.SIGKILL)
        if not self._wait_gone(gen, grace_s):
            log.warning("job %s generation %d: still running %.0f s after SIGTERM; sending SIGKILL",
                        gen.job, gen.generation, grace_s)
            self._kill_family(gen)
        if not self._wait_gone(gen, 10.0):
            survivors = sorted(p.pid for p in _alive(gen.seen))
            raise RuntimeError(f"job {gen.job} generation {gen.generation}: processes {survivors} survived SIGKILL")
        gen.ended.wait(timeout=30)
        return gen.report

    def _wait_gone(self, gen: _Generation, timeout: float, *, but_torchrun: bool = False) -> bool:
        """Whether the whole family is gone within ``timeout``; ``but_torchrun``: all of it but
        torchrun and its zygote (which dies with it)."""
        deadline = time.monotonic() + timeout
        while True:
            self._refresh_family(gen)
            if but_torchrun:
                if not [p for p in _as_now(gen.seen) if p.pid != gen.pid and not _is_zygote(p, gen.pid)]:
                    return True
            elif gen.torchrun_exited() and not _alive(gen.seen):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _kill_family(self, gen: _Generation) -> None:
        self._refresh_family(gen)
        _signal_all(_alive(gen.seen), signal.SIGKILL)


class _Prefix:
    """The first ``size`` bytes of a binary file, as a readable file (for ``shutil.copyfileobj``)."""

    def __init__(self, source: Any, size: int):
        self._source = source
        self._left = size

    def read(self, n: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        data = self._source.read(self._left if n < 0 else min(n, self._left))
        self._left -= len(data)
        return data
