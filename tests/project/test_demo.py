"""The README's demo command: on SQLite with no server installed, the control plane, a worker, a
local agent and the 2-rank example job come up, a fault is injected, and Nightwatch recovers."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_demo_runs_the_job_recovers_from_a_fault_and_stops_cleanly(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env["NIGHTWATCH_VAR_DIR"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "manage.py", "demo", "--port", str(port), "--fault-every", "20"],
                            cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        ready = None
        while time.monotonic() < deadline and proc.poll() is None:
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
        while time.monotonic() < deadline and proc.poll() is None and not _recovered(tmp_path):
            time.sleep(1)
        assert _recovered(tmp_path), "no recovery from the demo's injected fault"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
    assert proc.returncode == 0, output
    assert "Nightwatch is up" in output


def _recovered(var: Path) -> bool:
    with sqlite3.connect(var / "nightwatch.sqlite3", timeout=10) as db:
        resolved = db.execute("SELECT count(*) FROM jobs_incident WHERE state = 'resolved'").fetchone()[0]
        generations = db.execute("SELECT max(number) FROM jobs_generation").fetchone()[0] or 0
    return resolved >= 1 and generations >= 2
