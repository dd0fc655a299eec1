"""A whole Nightwatch on one machine, for end-to-end tests: real processes, real services.

``Cluster`` starts the control plane (daphne), a Celery worker with embedded beat (and, for the
benchmarks, one for the ``checkpoints`` queue) against the test's PostgreSQL database and a private Redis database, then
node agents (``python -m agents.agent``) that register with one-time bootstrap tokens and run
real ``torchrun``. Every process gets its own session so ``close()`` can kill it with all its
children, and every wait is a poll with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml

from tests.ports import free_port
from tests.waiting import wait_for

__all__ = ["Cluster", "Proc", "api", "rank_pids", "wait_for"]

ROOT = Path(__file__).resolve().parents[2]
#: The queue ``CELERY_TASK_ROUTES`` sends checkpoint-side tasks to, and the suffix of its worker's name.
CHECKPOINTS_QUEUE = "checkpoints"
BACKGROUND_QUEUE = "background"
#: Failure handling: the default queue, and ``sweeps``, the periodic checks that find what expired.
FAILURE_QUEUES = "celery,sweeps"
CHECKPOINTS_WORKER_SUFFIX = "-checkpoints"


class Proc:
    """A child process in its own session, logging to a file; ``stop()`` takes its whole group."""

    def __init__(self, name: str, argv: list[str], *, env: dict, log_dir: Path, cwd: Path = ROOT):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 10.0) -> None:
        if self.alive:
            self.kill(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # stragglers of the group, even when the leader exited
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


class Cluster:
    def __init__(self, tmp_path: Path, *, database_name: str, redis_db: int, settings: dict | None = None,
                 host: str = "127.0.0.1"):
        """``host``: the address the control plane listens on, and that agents and training
        processes are given (e.g. a bridge address when nodes live in network namespaces)."""
        self.tmp = tmp_path
        self.logs = tmp_path / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.procs: dict[str, Proc] = {}
        base = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "REDIS_URL", "NIGHTWATCH"))}
        if host != "127.0.0.1":  # Django answers 400 to a Host header it does not know
            base["ALLOWED_HOSTS"] = ",".join(["localhost", "127.0.0.1", "[::1]", "testserver", host])
        self.env = {
            **base,
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{database_name}",
            "REDIS_URL": f"redis://127.0.0.1:6379/{redis_db}",
            "NIGHTWATCH_VAR_DIR": str(tmp_path / "var"),
            "NIGHTWATCH_PUBLIC_URL": self.url,
            "NIGHTWATCH_CHECKPOINT_ROOT": str(tmp_path / "checkpoints"),
            "NIGHTWATCH_HEARTBEAT_INTERVAL_S": "1",
            "NIGHTWATCH_HEARTBEAT_MISSES": "3",
            "NIGHTWATCH_SWEEP_INTERVAL_S": "0.5",
            "NIGHTWATCH_QUIESCE_TIMEOUT_S": "30",
            "PYTHONUNBUFFERED": "1",
            **(settings or {}),
        }
        import redis

        redis.Redis.from_url(self.env["REDIS_URL"]).flushdb()

    # --- control plane ------------------------------------------------------------------------
    def start_web(self, bind: str | None = None) -> None:
        """Serve on ``bind`` (default: the cluster's ``host``, which is also the URL everyone is given)."""
        self.procs["web"] = Proc("web", [sys.executable, "-m", "daphne", "-b", bind or self.host, "-p", str(self.port),
                                         "controlplane.asgi:application"], env=self.env, log_dir=self.logs)
        wait_for(self._healthy, timeout=60, what="the control plane to answer /healthz")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:  # noqa: S310
                return response.status == 200
        except OSError:
            return False

    def start_worker(self, name: str = "worker", *, checkpoint_worker: bool = False) -> Proc:
        """Start the Celery worker ``name`` (with beat) and wait until it is ready; returns it.

        By default it consumes the default queue, ``sweeps``, ``checkpoints`` and ``background`` (a
        valid deployment for a small control plane, and one Django + torch process less per test
        cluster). With ``checkpoint_worker`` (the benchmarks), checkpoint work and the background's
        judgement and upkeep get a solo worker ``<name>-checkpoints`` of their own, as production's
        separate services: neither then sits in front of failure handling (``jobs.tasks.handle_exit``).
        A restarted default worker (``start_worker("worker2", ...)`` after killing ``worker``) reuses
        the checkpoints worker that is still alive.
        """
        queues = ["-Q", FAILURE_QUEUES if checkpoint_worker
                  else f"{FAILURE_QUEUES},{CHECKPOINTS_QUEUE},{BACKGROUND_QUEUE}"]
        proc = self._start_celery(name, ["-B", "-s", str(self.tmp / f"{name}-beat"), *queues])
        started = [proc]
        if checkpoint_worker and not any(p.alive for n, p in self.procs.items()
                                         if n.endswith(CHECKPOINTS_WORKER_SUFFIX)):
            started.append(self._start_celery(f"{name}{CHECKPOINTS_WORKER_SUFFIX}",
                                              ["-Q", f"{CHECKPOINTS_QUEUE},{BACKGROUND_QUEUE}"]))
        for worker in started:
            wait_for(lambda w=worker: "ready." in w.log() or not w.alive, timeout=60,
                     what=f"celery {worker.name} to be ready")
            assert worker.alive, worker.log()
        return proc

    def _start_celery(self, name: str, options: list[str]) -> Proc:
        proc = Proc(name, [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--pool=solo",
                           "--loglevel=INFO", "-n", f"{name}@%h", *options], env=self.env, log_dir=self.logs)
        self.procs[name] = proc
        return proc

    # --- nodes --------------------------------------------------------------------------------
    def start_agent(self, hostname: str, *, bootstrap_token: str | None = None, scenario: dict | None = None,
                    address: str = "127.0.0.1", extra: list[str] | None = None, env: dict | None = None,
                    wrap: list[str] | None = None) -> Proc:
        """Start a node agent; the first start registers with ``bootstrap_token``. ``wrap`` is put in
        front of the command line, e.g. ``["ip", "netns", "exec", NS]`` to run the agent (and so its
        torchrun) in a network namespace; it must exec the agent, so that stopping works."""
        home = self.tmp / "agents" / hostname
        home.mkdir(parents=True, exist_ok=True)
        scenario_path = home / "scenario.yaml"
        if scenario is not None or not scenario_path.exists():
            scenario_path.write_text(yaml.safe_dump(scenario or {"gpus": 1}))
        argv = [*(wrap or []), sys.executable, "-m", "agents.agent", "--control-plane-url", self.url,
                "--work-dir", str(home), "--hostname", hostname, "--address", address, "--heartbeat-interval-s", "1",
                "--telemetry-interval-s", "1", "--telemetry-batch-s", "2",
                "--telemetry-source", "scripted", "--scenario", str(scenario_path),
                "--probe-port", str(free_port()), "--stop-grace-s", "5", "--code-dir", str(ROOT), *(extra or [])]
        if bootstrap_token:
            token_file = home / "bootstrap-token"
            token_file.write_text(bootstrap_token)
            token_file.chmod(0o600)
            argv += ["--bootstrap-token-file", str(token_file)]
        proc = Proc(f"agent-{hostname}", argv, env={**self.env, **(env or {})}, log_dir=self.logs)
        self.procs[proc.name] = proc
        return proc

    def close(self) -> None:
        # Agents first (they stop their torchruns), then the workers, then the web server.
        for name in sorted(self.procs, key=lambda n: (not n.startswith("agent"), n == "web")):
            self.procs[name].stop()
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        """torchrun runs in a session of its own: a SIGKILLed agent leaves it behind. Anything
        still running with this cluster's directories in its environment goes now."""
        marker = str(self.tmp).encode()
        for pid_dir in Path("/proc").glob("[0-9]*"):
            try:
                if int(pid_dir.name) != os.getpid() and marker in (pid_dir / "environ").read_bytes():
                    os.kill(int(pid_dir.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue

    def dump_logs(self, limit: int = 4000) -> str:
        return "\n".join(f"===== {name} =====\n{proc.log()[-limit:]}" for name, proc in self.procs.items())


def rank_pids(job_id: int, generation: int, marker: Path | None = None) -> dict[int, int]:
    """The training processes of a job's generation on this machine, by global rank; with
    ``marker`` (a cluster's tmp path), only those of that cluster (other test sessions number
    their jobs from 1 too)."""
    wanted = (f"NIGHTWATCH_JOB={job_id}".encode(), f"NIGHTWATCH_GENERATION={generation}".encode())
    found: dict[int, int] = {}
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            environ = (pid_dir / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if not all(w in environ for w in wanted):
            continue
        if marker is not None and str(marker).encode() not in b"\0".join(environ):
            continue
        ranks = [e for e in environ if e.startswith(b"RANK=")]
        if ranks and b"TORCHELASTIC_RUN_ID=" in b"\0".join(environ):
            found[int(ranks[0].split(b"=")[1])] = int(pid_dir.name)
    return found


def worker_of(pid: int) -> int:
    """The process that trains for ``pid``, a rank ``rank_pids`` found: with warm workers that is a
    warm client (``agents/supervisor/warm_client.py``, the process whose environment names the rank),
    and the rank's own process is the one the zygote forked for it (recorded beside its socket);
    otherwise ``pid`` itself. A fault that kills *the rank* (the OOM killer's choice) kills this one."""
    from agents.supervisor.zygote import worker_pids

    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return pid
    at = next((i for i, arg in enumerate(argv) if arg.endswith(b"warm_client.py")), None)
    if at is None or at + 1 >= len(argv):
        return pid
    return worker_pids(Path(argv[at + 1].decode()).parent).get(pid, pid)


def api(cluster: Cluster, token: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """One JSON request to the cluster's API with a bearer token."""
    import json
    import urllib.error

    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{cluster.url}{path}", data=data, method=method,  # noqa: S310
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")
