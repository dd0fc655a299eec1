"""The embedded demo: everything on this machine, nothing to install.

``make demo`` runs this. It migrates (SQLite), makes a demo on-call user, starts the ASGI server
(daphne), a Celery worker and beat (its own process) on the filesystem broker, a second worker for the
``checkpoints`` and ``background`` queues (verification, replication, retention, straggler checks,
roll-ups: never in front of failure handling),
and a node agent with a scripted GPU; then launches the example job (a 2-rank CPU ``torchrun`` of
``examples/train.py``) and, every ``--fault-every`` seconds, injects a fault — a SIGKILLed rank — so
a newcomer watches Nightwatch detect it and resume from the last verified checkpoint within a
minute. Everything is supervised until Ctrl-C: if a part dies the demo stops rather than limping
on half-alive.

The terminal stays readable: each process logs to a file of its own under ``<var>/logs/`` (the
terminal says where), and after the URL and the password the demo shows one status line — the
job's state, generation, step, ETTR and its last incident with the time its recovery took — that
updates in place on a terminal, and is printed again whenever it changes otherwise.
"""

from __future__ import annotations

import io
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from dashboard import demo_fleet
from jobs import services
from jobs.goodput import goodput_of
from jobs.models import Job
from nodes.models import Node
from nodes.services import issue_bootstrap_token

DEMO_SCENARIO = "gpus: 1\nbaseline: {temperature: 45, utilization: 80}\n"


#: The demo's Celery workers: ``celery -A controlplane worker`` and these options, by name. The first
#: has failure handling (the declared queues: the default one, and ``sweeps``, the checks that find
#: what expired) to itself. Verification, replication and retention
#: (``checkpoints``) and judgement and upkeep (``background``; ``settings.CELERY_TASK_ROUTES``) share
#: the second, so neither ever delays the handling of the fault the demo injects.
WORKERS: dict[str, list[str]] = {
    "worker": ["--pool=solo", "--loglevel=INFO", "-n", "demo@%h"],
    "checkpoint-worker": ["-Q", "checkpoints,background", "--pool=solo", "--loglevel=INFO",
                          "-n", "demo-checkpoints@%h"],
}

#: Wildcard addresses the web process may listen on, and the address this machine reaches it by.
LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "127.0.0.1"}  # noqa: S104 - names, not a bind


class Command(BaseCommand):
    help = "Run the embedded demo (SQLite, embedded broker, worker, agent, a 2-rank job with faults) until Ctrl-C."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--ready-timeout", type=float, default=60.0)
        parser.add_argument("--no-job", action="store_true", help="only the control plane and the worker")
        parser.add_argument("--fault-every", type=float, default=60.0,
                            help="seconds between injected faults (0: none)")
        parser.add_argument("--steps", type=int, default=100_000, help="length of the demo job")
        parser.add_argument("--fleet", type=int, default=0, metavar="N",
                            help="add N simulated nodes of 8 GPUs (scripted readings, no agent) to look at")

    def handle(self, host, port, ready_timeout, no_job, fault_every, steps, fleet, **options):
        if not 0 <= fleet <= 4096:
            raise CommandError("--fleet must be between 0 and 4096")
        call_command("migrate", interactive=False, verbosity=0)
        password = self._demo_user()
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
        # Listening on every address (--host 0.0.0.0): this machine reaches it on loopback, which the
        # default ALLOWED_HOSTS admit; "0.0.0.0" is no host a request can name.
        url = f"http://{LOOPBACK.get(host, host)}:{port}"
        env.setdefault("NIGHTWATCH_PUBLIC_URL", url)
        python = sys.executable
        var = Path(settings.VAR_DIR)
        logs = var / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = logs
        _log_to(logs / "demo.log")  # this process's own log lines (e.g. kombu's) too
        children = {
            "web": _spawn(logs, "web", [python, "-m", "daphne", "-b", host, "-p", str(port),
                                        "controlplane.asgi:application"], env),
            **{name: _spawn(logs, name, [python, "-m", "celery", "-A", "controlplane", "worker", *options], env)
               for name, options in WORKERS.items()},
            # Beat on its own, as in production: a worker that dies takes no schedule with it.
            "beat": _spawn(logs, "beat", [python, "-m", "celery", "-A", "controlplane", "beat", "--loglevel=INFO",
                                          "-s", str(var / "celerybeat-schedule")], env),
        }
        self.status = StatusLine(self.stdout, tty=self.stdout.isatty())
        stop = {"now": False}

        def request_stop(signum, frame):
            stop["now"] = True

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)
        try:
            self._wait_ready(url, children, ready_timeout)
            if not no_job:
                children["agent"] = self._start_agent(url, env, var)
                self._wait_for_node(children, ready_timeout)
                job = self._launch_job(steps)
            # The dashboard opens on the demo job's page: its chart, breaker banner and recoveries.
            dashboard = f"{url}/jobs/{job.pk}/" if not no_job else f"{url}/"
            self.stdout.write(self.style.SUCCESS(
                f"\nNightwatch is up. Open the dashboard: {dashboard}\n"
                f"  log in as 'demo' (on-call) with password {password}\n"
                f"Overview: {url}/   nodes: {url}/nodes/   API docs: {url}/api/docs/   readiness: {url}/readyz\n"
                f"Logs: {logs}/ (web, worker, beat, checkpoint-worker, agent; the job's output under "
                f"{var}/demo-agent)\n"
                + (f"{fleet} simulated nodes (8 GPUs each, no agent) fill {url}/nodes/\n" if fleet else "")
                + "Ctrl-C stops everything.\n"
            ))
            simulated = demo_fleet.seed(fleet) if fleet else []
            next_fault = time.monotonic() + fault_every
            next_reading = time.monotonic()
            while not stop["now"]:
                if simulated and time.monotonic() >= next_reading:
                    demo_fleet.tick(simulated)
                    next_reading = time.monotonic() + 10
                for name, proc in children.items():
                    if proc.poll() is not None:
                        raise CommandError(f"the {name} process exited with code {proc.returncode} "
                                           f"(its log: {logs / name}.log)")
                if not no_job and fault_every and time.monotonic() >= next_fault:
                    self._inject_fault(job.pk)
                    next_fault = time.monotonic() + fault_every
                if not no_job:
                    self.status.show(job_status(job.pk))
                time.sleep(0.5)
        finally:
            self.status.done()
            _stop_all(children.values())

    def _demo_user(self) -> str:
        """A demo on-call user whose password is stored under var/ and shown on start."""
        path = settings.VAR_DIR / "demo_password"
        if not path.exists():
            path.write_text(secrets.token_urlsafe(12))
            path.chmod(0o600)
        password = path.read_text().strip()
        call_command("nightwatch_user", "demo", role="oncall", staff=True, stdout=io.StringIO())
        user = get_user_model().objects.get(username="demo")
        user.set_password(password)
        user.save(update_fields=["password"])
        return password

    def _start_agent(self, url: str, env: dict, var: Path) -> subprocess.Popen:
        """A node agent for this machine, registered with a fresh single-use bootstrap token (issued
        for the demo node when the database has it already: a generic token cannot re-register it)."""
        home = var / "demo-agent"
        home.mkdir(parents=True, exist_ok=True)
        (home / "scenario.yaml").write_text(DEMO_SCENARIO)
        argv = [sys.executable, "-m", "agents.agent", "--control-plane-url", url, "--work-dir", str(home),
                "--hostname", "demo-node", "--address", "127.0.0.1", "--telemetry-source", "scripted",
                "--scenario", str(home / "scenario.yaml"), "--heartbeat-interval-s", "2",
                "--telemetry-interval-s", "5", "--telemetry-batch-s", "10",
                "--stop-grace-s", "5", "--code-dir", str(settings.BASE_DIR)]
        if not (home / "node-token.json").exists():
            _, raw = issue_bootstrap_token(name="demo-bootstrap", hostname="demo-node", actor="system:demo",
                                           node=Node.objects.filter(hostname="demo-node").first())
            token_file = home / "bootstrap-token"
            token_file.write_text(raw)
            token_file.chmod(0o600)
            argv += ["--bootstrap-token-file", str(token_file)]
        return _spawn(self.logs, "agent", argv, env)

    def _wait_for_node(self, children: dict, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not Node.objects.filter(hostname="demo-node", health="healthy").exists():
            if children["agent"].poll() is not None or time.monotonic() > deadline:
                raise CommandError("the demo agent did not register and report healthy")
            time.sleep(0.2)

    def _launch_job(self, steps: int):
        """The example job, launched like a CI pipeline would (same service as the API)."""
        running = Job.objects.filter(name="demo-tiny-lm").exclude(state__in=["completed", "failed", "cancelled"])
        if running.exists():
            return running.first()
        spec = {"name": "demo-tiny-lm", "entrypoint": "examples/train.py", "nnodes": 1, "nproc_per_node": 2,
                "accelerator": "cpu", "rdzv_port": 29431,
                "args": ["--steps", str(steps), "--ckpt-every", "25", "--min-step-time", "0.2",
                         "--dataset-size", "4096"],
                "checkpoint_policy": {"interval": "fixed", "interval_steps": 25, "keep_last": 3,
                                      "permanent_every_hours": 12},
                "recovery_policy": {"max_restarts": 20, "window_minutes": 60, "backoff_seconds": 0,
                                    "allow_shrink": False, "progress_timeout_s": 30, "loss_spike_limit": 3}}
        job = services.launch_job(spec, actor="system:demo")
        self.stdout.write(f"launched job {job.pk} ({job.name}): a 2-rank torchrun of examples/train.py")
        return job

    def _inject_fault(self, job_id: int) -> None:
        """SIGKILL one rank of the running generation, as a failing GPU or OOM-killer would."""
        job = Job.objects.get(pk=job_id)
        if job.state != "running":
            return
        pids = _rank_pids(job.pk, job.generation, marker=str(settings.VAR_DIR))
        if pids:
            rank, pid = max(pids.items())
            os.kill(pid, signal.SIGKILL)
            self.status.say(self.style.WARNING(
                f"fault injected: SIGKILL rank {rank} (pid {pid}) of job {job.pk} generation {job.generation}"))

    def _wait_ready(self, url: str, children: dict, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in children.items():
                if proc.poll() is not None:
                    raise CommandError(f"the {name} process exited with code {proc.returncode} during start-up")
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:  # noqa: S310 - our own URL
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise CommandError(f"the control plane did not become ready at {url} within {timeout:.0f}s")


class StatusLine:
    """One line that a terminal redraws in place (and a pipe gets again only when it changes);
    messages go above it."""

    def __init__(self, out, *, tty: bool):
        self.out, self.tty, self.last = out, tty, ""

    def show(self, text: str) -> None:
        if text == self.last:
            return
        self.last = text
        if self.tty:
            self.out.write(f"\r\x1b[2K{text}", ending="")
            self.out.flush()
        else:
            self.out.write(text)

    def say(self, message: str) -> None:
        if self.tty:
            self.out.write(f"\r\x1b[2K{message}\n{self.last}", ending="")
            self.out.flush()
        else:
            self.out.write(message)

    def done(self) -> None:
        if self.tty and self.last:
            self.out.write("")


def job_status(job_id: int) -> str:
    """The demo job in one line: state, generation, step, ETTR, its last incident and recovery."""
    job = Job.objects.get(pk=job_id)
    parts = [f"job {job.pk} {job.state}", f"gen {job.generation}", f"step {job.last_step or 0}",
             f"ETTR {goodput_of(job).ettr:.2f}"]
    incident = job.incidents.order_by("-detected_at").first()
    if incident is not None:
        what = incident.classification or incident.kind
        if incident.first_step_at and incident.fault_at:
            what += f", recovered in {(incident.first_step_at - incident.fault_at).total_seconds():.1f} s"
        else:
            what += f", {incident.state}"
        parts.append(f"last incident: {what}")
    return " · ".join(parts)


def _log_to(path: Path) -> None:
    """Point every logging handler that writes to the terminal at ``path`` instead."""
    stream = open(path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process
    for logger in [logging.getLogger(), *(logging.getLogger(name) for name in logging.root.manager.loggerDict)]:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setStream(stream)


def _spawn(logs: Path, name: str, argv: list[str], env: dict) -> subprocess.Popen:
    """Start a part of the demo with its output going to ``logs/<name>.log`` (appended)."""
    with open(logs / f"{name}.log", "ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _rank_pids(job_id: int, generation: int, marker: str) -> dict[int, int]:
    """Training processes of a job's generation run by this demo's agent (their environment names
    its directory), by global rank, from /proc."""
    wanted = (f"NIGHTWATCH_JOB={job_id}".encode(), f"NIGHTWATCH_GENERATION={generation}".encode())
    found = {}
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            environ = (pid_dir / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((e for e in environ if e.startswith(b"RANK=")), None)
        if rank and all(w in environ for w in wanted) and marker.encode() in b"\0".join(environ):
            found[int(rank.split(b"=")[1])] = int(pid_dir.name)
    return found


def _stop_all(procs) -> None:
    # The agent first: it stops its torchrun before exiting.
    procs = sorted((p for p in procs if p.poll() is None), key=lambda p: "agents.agent" not in " ".join(p.args))
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + 15
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
