"""A control-plane outage during a real torchrun run: training carries on, and once the control
plane is back every report arrives, once, in order."""

from __future__ import annotations

import threading
import time

import pytest

from tests.hooks.conftest import torchrun

pytestmark = pytest.mark.e2e

STEPS = 120


def test_reports_spooled_during_an_outage_arrive_exactly_once_afterwards(tmp_path, control_plane):
    control_plane.down()  # the port is known; nothing listens on it until halfway through the run
    ckpt = tmp_path / "ckpt"
    halfway = threading.Event()

    def bring_back_at_halfway() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not halfway.is_set():
            if any((p / "COMMITTED").exists() for p in ckpt.glob(f"step-{STEPS // 2:08d}-*")):
                control_plane.up()
                halfway.set()
            time.sleep(0.05)

    watcher = threading.Thread(target=bring_back_at_halfway, daemon=True)
    watcher.start()
    env = {"NIGHTWATCH_URL": control_plane.url, "NIGHTWATCH_JOB": "job-5", "NIGHTWATCH_GENERATION": "2",
           "NIGHTWATCH_SPOOL_DIR": str(tmp_path / "spool")}
    control_plane.generation = 2
    # Steps of at least 50 ms: the first half lasts >= 3 s, several of the reporter's 1 s flushes,
    # so the hooks meet the outage however fast this machine trains (an idle one once reached the
    # halfway checkpoint before the first flush).
    run = torchrun(["--steps", str(STEPS), "--ckpt-dir", str(ckpt), "--ckpt-every", str(STEPS // 2),
                    "--min-step-time", "0.05"], env=env)
    halfway.set()
    watcher.join()
    assert run.returncode == 0, run.output[-3000:]
    assert run.lines("control plane unreachable")  # the outage was real

    # Rank 0 speaks for the job; rank 1 flagged nothing, so its timings came only in rank 0's windows.
    assert sorted(control_plane.reports) == [(2, 0, step) for step in range(1, STEPS + 1)]
    sent = [r["step"] for batch in control_plane.received for r in batch["reports"]]
    assert sent == list(range(1, STEPS + 1))  # sent once each, oldest first
    assert sorted(control_plane.windows) == [(2, 0, s - 1) for s in range(10, STEPS + 1, 10)]
    assert {w["ranks"] for w in control_plane.windows.values()} == {2}
    assert [c["step"] for c in control_plane.commits] == [STEPS // 2, STEPS]
