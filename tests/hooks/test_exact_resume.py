"""Exact resume on real torchrun: a rank SIGKILLed mid-step at a seeded random step, restarted by
``torchrun --max-restarts``, ends bit-identical to a run that was never interrupted."""

from __future__ import annotations

import random
import re

import pytest
import torch

from tests.hooks.conftest import read_samples, torchrun

pytestmark = pytest.mark.e2e

STEPS = 24
COMMON = ["--steps", str(STEPS), "--ckpt-every", "4", "--check-every", "5", "--dropout", "0.1"]
# Seeded, so a failure reproduces; drawn, so the crash lands wherever it lands relative to the
# checkpoints (before, during or after an async save's commit).
CRASHES = [(rank, random.Random(f"nightwatch-{rank}").randint(6, STEPS - 2)) for rank in (0, 1)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    run = torchrun([*COMMON, "--ckpt-dir", str(directory / "ckpt"), "--log-samples", str(directory / "samples"),
                    "--final-state", str(directory / "final")])
    assert run.returncode == 0, run.output[-3000:]
    assert not run.lines("ranks disagree"), "identical replicas must pass the consistency check"
    return directory


@pytest.mark.parametrize(("crash_rank", "crash_at"), CRASHES)
def test_a_rank_killed_mid_step_resumes_bit_identical(tmp_path, uninterrupted, crash_rank, crash_at):
    run = torchrun([*COMMON, "--ckpt-dir", str(tmp_path / "ckpt"), "--log-samples", str(tmp_path / "samples"),
                    "--final-state", str(tmp_path / "final"), "--crash-at", str(crash_at),
                    "--crash-rank", str(crash_rank)], max_restarts=1)
    assert run.returncode == 0, run.output[-3000:]
    assert re.search(rf"exitcode: -9\) local_rank: {crash_rank}", run.output), "the rank was not SIGKILLed"

    resumed = {int(m) for m in re.findall(r"resumed from step (\d+) \(checkpoint ", run.output)}
    assert len(resumed) == 1, run.output[-3000:]  # both ranks resumed from the same checkpoint
    step = resumed.pop()
    assert step % 4 == 0 and 0 < step < crash_at

    assert_same_run(tmp_path, uninterrupted, STEPS)


def assert_same_run(actual_dir, expected_dir, steps: int) -> None:
    """Both ranks of the run in ``actual_dir`` ended bit-identical to the one in ``expected_dir``
    (``--final-state final``, ``--log-samples samples``) at ``steps``, having trained the same
    samples at every step: a step retrained after a resume replaces the attempt lost with a fault."""
    for rank in (0, 1):
        expected = torch.load(expected_dir / "final" / f"rank{rank}.pt")
        actual = torch.load(actual_dir / "final" / f"rank{rank}.pt")
        assert actual["step"] == expected["step"] == steps
        assert_identical(actual["model"], expected["model"])
        assert_identical(actual["optim"], expected["optim"])
        assert actual["scheduler"] == expected["scheduler"]
        assert read_samples(actual_dir / "samples", rank) == read_samples(expected_dir / "samples", rank)


def assert_identical(actual, expected, where="state"):
    """Bit-for-bit equality of nested state dicts (tensors compared with torch.equal)."""
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_identical(a, e, f"{where}.{i}")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), f"{where} differs"
    else:
        assert actual == expected, where
