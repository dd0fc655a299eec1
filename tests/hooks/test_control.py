"""Control from the control plane on real torchrun: pause (checkpoint, then exit 85), a stale
generation (exit 86 at once, nothing written), and the word that a run is ending."""

from __future__ import annotations

import re

import pytest

from agents.hooks import verify
from agents.protocol.hooks import EXIT_PAUSED, EXIT_STALE_GENERATION
from tests.hooks.conftest import torchrun

pytestmark = pytest.mark.e2e

# Long enough never to finish on its own: only the control plane ends these runs.
ENDLESS = ["--steps", "100000", "--ckpt-every", "0", "--check-every", "5"]


def env_for(control_plane, tmp_path, generation):
    return {"NIGHTWATCH_URL": control_plane.url, "NIGHTWATCH_JOB": "job-9", "NIGHTWATCH_GENERATION": str(generation),
            "NIGHTWATCH_SPOOL_DIR": str(tmp_path / "spool")}


def assert_exited_with(output: str, code: int) -> None:
    """torchrun's summary: the first worker to exit (the root cause) carries ``code``; torchrun then
    SIGTERMs any worker still tearing down the interpreter, so the others show ``code`` or -15."""
    root = re.search(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", output, re.S)
    assert root and int(root.group(1)) == code, output[-3000:]
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", output)}
    assert codes <= {code, -15}, output[-3000:]


def test_pause_commits_a_checkpoint_on_every_rank_then_exits_with_the_paused_code(tmp_path, control_plane):
    control_plane.generation = 1
    control_plane.control = {"pause": True}
    run = torchrun([*ENDLESS, "--ckpt-dir", str(tmp_path / "ckpt")], env=env_for(control_plane, tmp_path, 1))
    assert_exited_with(run.output, EXIT_PAUSED)
    (ack,) = control_plane.events_of("pause_ack")
    (commit,) = control_plane.commits
    assert ack["detail"]["checkpoint"] == commit["path"] and ack["step"] == commit["step"]
    assert commit["step"] % 5 == 0  # ranks agree on the step at an exchange point
    assert verify(commit["path"], config_hash=commit["config_hash"]).ok
    assert len(run.lines("stopping training at step")) == 2  # both ranks, the same step
    assert control_plane.events_of("run_ending") == []  # a pause is not the end of the run
    assert len({line.split("step ")[1].split(":")[0] for line in run.lines("stopping training at step")}) == 1


def test_a_stale_generation_stops_at_once_without_writing_anything(tmp_path, control_plane):
    control_plane.generation = 2  # another generation took over the job
    run = torchrun([*ENDLESS, "--ckpt-dir", str(tmp_path / "ckpt")], env=env_for(control_plane, tmp_path, 1))
    assert_exited_with(run.output, EXIT_STALE_GENERATION)
    assert run.lines("this generation is stale")
    assert control_plane.reports == {} and control_plane.commits == []
    assert not list((tmp_path / "ckpt").glob("step-*"))


def test_the_end_of_the_loop_is_said_before_the_final_save(tmp_path, control_plane):
    """``run_ending`` reaches the control plane ahead of the final checkpoint's commit: its hang sweep
    waits for the end while the run saves, flushes and exits (jobs.progress, a 2 s floor)."""
    control_plane.generation = 1
    run = torchrun(["--steps", "12", "--ckpt-every", "0", "--check-every", "5", "--ckpt-dir", str(tmp_path / "ckpt")],
                   env=env_for(control_plane, tmp_path, 1))
    assert run.returncode == 0, run.output[-3000:]
    (said,) = control_plane.events_of("run_ending")
    assert (said["rank"], said["step"], said["detail"]) == (0, 12, {"step": 12, "max_steps": 12})
    assert control_plane.arrivals.index(("event:run_ending", 12)) < control_plane.arrivals.index(("commit", 12))
