"""The worker's liveness file and the check supervisors run (``python -m core.liveness``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from core import liveness


def test_fresh_stale_and_missing(tmp_path):
    path = str(tmp_path / "alive")
    assert liveness.verdict(path, 60)[0] is False
    liveness.touch(path)
    assert liveness.verdict(path, 60)[0] is True
    alive, why = liveness.verdict(path, 60, now=time.time() + 61)
    assert not alive and "stuck or dead" in why


def test_the_check_kills_the_process_of_a_stale_worker(tmp_path):
    path, pidfile = tmp_path / "alive", tmp_path / "worker.pid"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pidfile.write_text(f"{sleeper.pid}\n")
        liveness.touch(str(path))
        os.utime(path, (time.time() - 120, time.time() - 120))
        check = subprocess.run([sys.executable, "-m", "core.liveness", str(path), "--max-age", "60",
                                "--kill-pidfile", str(pidfile)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 1 and "killed process" in check.stdout, check.stdout
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()
    liveness.touch(str(path))
    ok = subprocess.run([sys.executable, "-m", "core.liveness", str(path)], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stdout


def test_a_worker_still_starting_is_not_killed(tmp_path):
    path, pidfile = str(tmp_path / "alive"), tmp_path / "worker.pid"
    pidfile.write_text("12345\n")
    assert liveness.verdict(path, 60, pidfile=str(pidfile))[0] is True
    assert liveness.verdict(path, 60, pidfile=str(pidfile), now=time.time() + 61)[0] is False
