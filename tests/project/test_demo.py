"""The README's demo command: on SQLite with no server installed, the control plane, a worker, a
local agent and the 2-rank example job come up, a fault is injected, and Nightwatch recovers.

It runs in a real terminal (tmux), as a newcomer would run it: the terminal shows the URL, the
password and one live status line, and no log line (the logs go to files under the var dir)."""

from __future__ import annotations

import os
import shlex
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_demo_runs_the_job_recovers_from_a_fault_and_stops_cleanly(tmp_path):
    port = free_port()
    session = f"nw-demo-{port}"
    exit_file = tmp_path / "exit-code"
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "TMUX")}
    env["NIGHTWATCH_VAR_DIR"] = str(tmp_path)
    demo = shlex.join([sys.executable, "manage.py", "demo", "--port", str(port), "--fault-every", "20"])
    # The shell line only runs the demo and keeps its exit status for the test to read.
    subprocess.run(["tmux", "-L", session, "new-session", "-d", "-s", session, "-x", "220", "-y", "40",
                    "-c", str(ROOT), f"{demo}; echo $? > {shlex.quote(str(exit_file))}"], env=env, check=True)
    tmux = ["tmux", "-L", session]

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    def alive() -> bool:
        return not exit_file.exists()

    try:
        deadline = time.monotonic() + 90
        ready = None
        while time.monotonic() < deadline and alive():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
                    ready = response.status
                    break
            except OSError:
                time.sleep(0.2)
        assert ready == 200, "the demo did not become ready"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            assert response.status == 200
        # Embedded means SQLite under the var dir and the filesystem broker, nothing else.
        assert (tmp_path / "nightwatch.sqlite3").exists()
        assert (tmp_path / "broker" / "queue").is_dir()
        # The injected fault is detected and recovered from: a resolved incident, a second generation.
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and alive() and not _recovered(tmp_path):
            time.sleep(1)
        assert _recovered(tmp_path), "no recovery from the demo's injected fault\n" + screen()
        # The terminal: the URL and password, where the logs are, the status line; no log line.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "recovered in" not in screen():
            time.sleep(0.5)
        shown = screen()
        password = (tmp_path / "demo_password").read_text().strip()
        assert "Nightwatch is up" in shown and f"http://127.0.0.1:{port}/jobs/" in shown and password in shown
        assert f"Logs: {tmp_path}/logs/" in shown and "fault injected: SIGKILL rank" in shown
        status = [line for line in shown.splitlines() if line.startswith("job ")]
        assert len(status) == 1 and " · gen " in status[0] and "recovered in" in status[0], shown
        assert not any(marker in shown for marker in ('"level"', "HTTP GET", "Task ", "[INFO", "Traceback")), shown
        assert (tmp_path / "logs" / "web.log").stat().st_size > 0 and (tmp_path / "logs" / "agent.log").exists()
        # Beat is a process of its own, as in production; the worker runs none.
        assert "Sending due task" in (tmp_path / "logs" / "beat.log").read_text()
        assert "beat: Starting" not in (tmp_path / "logs" / "worker.log").read_text()
    finally:
        subprocess.run([*tmux, "send-keys", "-t", session, "C-c"], check=False)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and alive():
            time.sleep(0.2)
        subprocess.run([*tmux, "kill-server"], check=False)
    assert exit_file.read_text().strip() == "0", screen()


def _recovered(var: Path) -> bool:
    with sqlite3.connect(var / "nightwatch.sqlite3", timeout=10) as db:
        resolved = db.execute("SELECT count(*) FROM jobs_incident WHERE state = 'resolved'").fetchone()[0]
        generations = db.execute("SELECT max(number) FROM jobs_generation").fetchone()[0] or 0
    return resolved >= 1 and generations >= 2
