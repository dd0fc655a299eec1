"""Resume on a different world size (real torchrun): the global sample sequence continues exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hooks.conftest import read_samples, torchrun

pytestmark = pytest.mark.e2e

# 64 samples, 4 per rank per step: the runs below cross an epoch boundary, so the cursor has to
# carry the epoch too.
COMMON = ["--batch-size", "4", "--dataset-size", "64", "--ckpt-every", "0", "--check-every", "5"]


def global_sequence(samples: Path, world_size: int) -> list[int]:
    """Sample ids in (step, rank) order: the order of the global stream."""
    per_rank = [read_samples(samples, rank) for rank in range(world_size)]
    return [i for step in sorted(per_rank[0]) for rank in per_rank for i in rank[step]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[int]:
    """What an uninterrupted run trains on: 20 steps of one rank = the first 80 global samples."""
    directory = tmp_path_factory.mktemp("reference")
    run = torchrun([*COMMON, "--steps", "20", "--ckpt-dir", str(directory / "ckpt"),
                    "--log-samples", str(directory / "samples")], nproc=1)
    assert run.returncode == 0, run.output[-3000:]
    return global_sequence(directory / "samples", 1)


@pytest.mark.parametrize(("before", "after", "first_steps", "last_step"), [
    (2, 1, 6, 14),  # 6 steps x 8 samples, then 8 steps x 4 samples = 80
    (1, 2, 6, 13),  # 6 steps x 4 samples, then 7 steps x 8 samples = 80
])
def test_a_job_resumed_on_another_world_size_trains_the_next_global_samples_in_order(
        tmp_path, reference, before, after, first_steps, last_step):
    ckpt = str(tmp_path / "ckpt")
    first = torchrun([*COMMON, "--steps", str(first_steps), "--ckpt-dir", ckpt,
                      "--log-samples", str(tmp_path / "first")], nproc=before)
    assert first.returncode == 0, first.output[-3000:]
    second = torchrun([*COMMON, "--steps", str(last_step), "--ckpt-dir", ckpt,
                       "--log-samples", str(tmp_path / "second")], nproc=after)
    assert second.returncode == 0, second.output[-3000:]
    assert second.lines(f"resumed from step {first_steps} (checkpoint {ckpt}/step-{first_steps:08d}-g0-")
    assert second.lines(f"world size changed from {before} to {after}; continuing at global sample")

    trained = global_sequence(tmp_path / "first", before) + global_sequence(tmp_path / "second", after)
    assert trained == reference  # the same samples, in the same order: nothing repeated, nothing skipped
    assert len(trained) == 80 and len(set(trained[:64])) == 64  # a whole epoch, each sample once
