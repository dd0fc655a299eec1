"""A user's own script, before and after the hooks (examples/byo): the adaptation stays small, and the
adapted script keeps its sampler, its loader and its gradient accumulation, yet resumes bit-identically
after a SIGKILL, after a hang and after a kill in the middle of a checkpoint commit, with a resume
that lands inside an accumulation window.

The runs are real torchrun (gloo on CPU, 2 ranks, free ports through ``--standalone``). Faults are
planted from outside the script by ``tests/hooks/byo_run.py``. The reference is the user's *plain*
script, run uninterrupted: the watched script must end with exactly its weights, optimizer and
scheduler state, so the hooks change nothing about the training itself.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.hooks.conftest import REPO, _kill_tree
from tests.hooks.test_exact_resume import assert_identical

BYO = REPO / "examples" / "byo"
ACCUM = 4  # micro-batches per step (the scripts' default)
STEPS = 24  # 3 epochs of 256 samples, 2 ranks × 4 per micro-batch × 4 micro-batches per step: 8 steps an epoch
ARGS = ["--epochs", "3", "--ckpt-every", "4"]
LOADERS = ["DataLoader", "StatefulDataLoader"]


def changed_lines(before: str, after: str) -> list[str]:
    """The lines a unified diff adds or removes."""
    diff = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_adopting_the_hooks_changes_at_most_15_lines_of_the_plain_script():
    changed = changed_lines((BYO / "plain_ddp.py").read_text(), (BYO / "watched.py").read_text())
    assert 0 < len(changed) <= 15, "\n".join(changed)
    # What it keeps: its sampler (set_epoch now comes from the hooks), its loader, its accumulation.
    kept = (BYO / "watched.py").read_text()
    assert "sampler=sampler" in kept and "accumulation_steps=args.accum" in kept and "loader=loader" in kept


def test_the_measure_counts_added_and_removed_lines():
    assert len(changed_lines("a\nb\nc\n", "a\nB\nc\nd\n")) == 3


# -- real torchrun -----------------------------------------------------------------------------


def start(script: str, args: list[str], *, ckpt_dir: Path, generation: int, max_restarts: int = 0,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
               "-m", "tests.hooks.byo_run", str(BYO / script), *args]
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("NIGHTWATCH_", "BYO_"))}
    environment.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                        "NIGHTWATCH_CKPT_DIR": str(ckpt_dir), "NIGHTWATCH_GENERATION": str(generation),
                        **(env or {})})
    return subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish(process: subprocess.Popen, timeout: float = 150.0) -> str:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(process)
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish within {timeout}s:\n{output[-4000:]}")
    finally:
        _kill_tree(process)
    assert process.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The user's plain script, never interrupted and without the hooks."""
    out = tmp_path_factory.mktemp("plain") / "final.pt"
    finish(start("plain_ddp.py", [*ARGS[:2], "--out", str(out)], ckpt_dir=out.parent / "unused", generation=0))
    return out


def assert_matches_reference(final: Path, reference: Path) -> None:
    actual, expected = torch.load(final), torch.load(reference)
    assert actual["scheduler"]["last_epoch"] == expected["scheduler"]["last_epoch"] == STEPS
    assert_identical(actual["model"], expected["model"], "model")
    assert_identical(actual["optim"], expected["optim"], "optim")
    assert actual["scheduler"] == expected["scheduler"]


def resumed_step(output: str) -> int:
    steps = {int(m) for m in re.findall(r"resumed from step (\d+) \(checkpoint ", output)}
    assert len(steps) == 1, output[-3000:]  # both ranks resumed from the same checkpoint
    return steps.pop()


@pytest.mark.e2e
@pytest.mark.parametrize("loader", LOADERS)
def test_a_rank_sigkilled_inside_an_accumulation_window_resumes_bit_identical(tmp_path, reference, loader):
    # Rank 1 dies at its 42nd micro-batch: step 11's second, one micro-batch of the window trained.
    # The newest checkpoint is step 8, the end of the first epoch: the resume starts a new epoch.
    kill_at = 10 * ACCUM + 2
    final = tmp_path / "final.pt"
    output = finish(start("watched.py", [*ARGS, "--out", str(final)], ckpt_dir=tmp_path / "ckpt", generation=1,
                          max_restarts=1, env={"BYO_FAULT": f"kill:1:{kill_at}", "BYO_LOADER": _kind(loader)}))
    assert re.search(r"exitcode: -9\) local_rank: 1", output), "the rank was not SIGKILLed"
    step = resumed_step(output)
    assert step % 4 == 0 and step <= kill_at // ACCUM
    assert_matches_reference(final, reference)


@pytest.mark.e2e
@pytest.mark.parametrize("loader", LOADERS)
def test_a_hung_rank_is_killed_and_the_relaunch_resumes_bit_identical(tmp_path, reference, loader):
    # Rank 0 freezes (SIGSTOP) at its 53rd micro-batch, step 14's first: rank 1 then waits in the
    # all-reduce forever. Watching progress, as the node agent does, the test sees no step for 3 s,
    # kills the whole group and relaunches it as the next generation on the same checkpoints.
    stop_at = 13 * ACCUM + 1
    final, beats = tmp_path / "final.pt", tmp_path / "heartbeat"
    beats.mkdir()
    hung = start("watched.py", [*ARGS, "--out", str(final)], ckpt_dir=tmp_path / "ckpt", generation=1,
                 env={"BYO_FAULT": f"stop:0:{stop_at}", "BYO_HEARTBEAT": str(beats), "BYO_LOADER": _kind(loader)})
    try:
        wait_for_a_hang(hung, beats, quiet_s=3.0, timeout=120.0)
    finally:
        _kill_tree(hung)
        hung.communicate()
    assert hung.returncode != 0
    assert int((beats / "rank0").read_text()) == stop_at - 1  # it froze where it was told to
    output = finish(start("watched.py", [*ARGS, "--out", str(final)], ckpt_dir=tmp_path / "ckpt", generation=2,
                          env={"BYO_LOADER": _kind(loader)}))
    step = resumed_step(output)
    assert step % 4 == 0 and 0 < step <= stop_at // ACCUM
    assert_matches_reference(final, reference)


@pytest.mark.e2e
@pytest.mark.parametrize("loader", LOADERS)
def test_a_rank_killed_inside_a_checkpoint_commit_resumes_from_the_checkpoint_before(tmp_path, reference, loader):
    # Rank 0 dies in its third commit (step 12's), with the shards and manifest.json written and the
    # commit marker not: a torn save that must never be restored. The relaunch takes step 8's.
    final, ckpt = tmp_path / "final.pt", tmp_path / "ckpt"
    output = finish(start("watched.py", [*ARGS, "--out", str(final)], ckpt_dir=ckpt, generation=1, max_restarts=1,
                          env={"BYO_FAULT": "commit:0:3", "BYO_LOADER": _kind(loader)}))
    assert re.search(r"exitcode: -9\) local_rank: 0", output), "rank 0 was not SIGKILLed"
    torn = re.search(r"killed inside the commit of (step-00000012-\S+)", output)
    assert torn, output[-3000:]
    assert (ckpt / torn[1] / "manifest.json").is_file() and not (ckpt / torn[1] / "COMMITTED").exists()
    assert resumed_step(output) == 8
    assert_matches_reference(final, reference)


def wait_for_a_hang(process: subprocess.Popen, beats: Path, *, quiet_s: float, timeout: float) -> None:
    """Return once the ranks made progress and then none for ``quiet_s``; fail on exit or timeout."""
    deadline = time.monotonic() + timeout
    last, changed = "", time.monotonic()
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"torchrun exited ({process.returncode}) instead of hanging")
        now = "/".join(p.read_text() for p in sorted(beats.iterdir()))
        if now != last:
            last, changed = now, time.monotonic()
        elif last and time.monotonic() - changed >= quiet_s:
            return
        time.sleep(0.1)
    pytest.fail(f"no hang within {timeout}s (progress {last!r})")


def _kind(loader: str) -> str:
    return "stateful" if loader == "StatefulDataLoader" else "plain"
