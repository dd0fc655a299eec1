"""The embedded demo: the control plane, a Celery worker and the dashboard, with nothing to install.

``make demo`` runs this. It migrates, makes a demo on-call user, starts the ASGI server (daphne)
and a Celery worker on the embedded broker, and supervises both until Ctrl-C: if either dies the
demo stops rather than limping on half-alive.
"""

from __future__ import annotations

import io
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Run the embedded demo (SQLite, embedded broker, worker, dashboard) until interrupted."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--ready-timeout", type=float, default=60.0)

    def handle(self, host, port, ready_timeout, **options):
        call_command("migrate", interactive=False, verbosity=0)
        password = self._demo_user()
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
        python = sys.executable
        children = {
            "web": subprocess.Popen([python, "-m", "daphne", "-b", host, "-p", str(port),
                                     "controlplane.asgi:application"], env=env),
            "worker": subprocess.Popen([python, "-m", "celery", "-A", "controlplane", "worker", "--pool=solo",
                                        "--concurrency=1", "--loglevel=INFO", "-n", "demo@%h"], env=env),
        }
        stop = {"now": False}

        def request_stop(signum, frame):
            stop["now"] = True

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)
        try:
            url = f"http://{host}:{port}"
            self._wait_ready(url, children, ready_timeout)
            self.stdout.write(self.style.SUCCESS(
                f"\nNightwatch is up: {url}/  (log in as 'demo' with password {password})\n"
                f"API docs: {url}/api/docs/   readiness: {url}/readyz\nCtrl-C stops everything.\n"
            ))
            while not stop["now"]:
                for name, proc in children.items():
                    if proc.poll() is not None:
                        raise CommandError(f"the {name} process exited with code {proc.returncode}")
                time.sleep(0.5)
        finally:
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


def _stop_all(procs) -> None:
    procs = [p for p in procs if p.poll() is None]
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
