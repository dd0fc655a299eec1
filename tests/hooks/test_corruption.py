"""Damaged checkpoints on real torchrun: each one is passed over, with its reason in the log, and the
newest intact checkpoint is the one restored."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.hooks.conftest import torchrun

pytestmark = pytest.mark.e2e

COMMON = ["--ckpt-every", "4", "--check-every", "5"]


def checkpoint(directory: Path, step: int) -> Path:
    (path,) = directory.glob(f"step-{step:08d}-*")
    return path


def test_damaged_checkpoints_are_never_restored_and_the_log_says_why(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = torchrun([*COMMON, "--steps", "20", "--ckpt-dir", str(ckpt)])  # checkpoints at 4, 8, ... 20
    assert run.returncode == 0, run.output[-3000:]
    other = torchrun(["--ckpt-every", "24", "--steps", "24", "--lr", "0.001", "--ckpt-dir", str(tmp_path / "other")])
    assert other.returncode == 0, other.output[-3000:]
    foreign = checkpoint(tmp_path / "other", 24)
    shutil.move(foreign, ckpt / foreign.name)  # the newest of all, but trained with another config

    shard = next(checkpoint(ckpt, 20).glob("__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    next(checkpoint(ckpt, 16).glob("__0_*.distcp")).unlink()
    manifest = checkpoint(ckpt, 12) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-40])
    (checkpoint(ckpt, 8) / "COMMITTED").unlink()

    expected_reasons = {
        foreign: "(incompatible configuration)",
        checkpoint(ckpt, 20): f"{shard.name} does not match its sha256 (corrupted)",
        checkpoint(ckpt, 16): "missing file __0_0.distcp",
        checkpoint(ckpt, 12): "manifest.json does not match its commit marker",
        checkpoint(ckpt, 8): "no commit marker",
    }
    intact = checkpoint(ckpt, 4)

    resumed = torchrun([*COMMON, "--steps", "26", "--ckpt-dir", str(ckpt)])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.lines(f"resumed from step 4 (checkpoint {intact})")
    for damaged, reason in expected_reasons.items():
        name = ckpt / damaged.name
        assert [line for line in resumed.lines(f"not restoring checkpoint {name}: ") if reason in line], (
            name, resumed.output[-3000:])
