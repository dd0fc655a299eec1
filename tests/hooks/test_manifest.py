"""verify / latest_verified on real DCP checkpoints: every way a checkpoint can be unusable."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agents.hooks import state
from agents.hooks.checkpointer import Checkpointer
from agents.hooks.manifest import MANIFEST, MARKER, latest_verified, verify
from agents.hooks.topology import Topology
from tests.hooks.conftest import REPO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CONFIG = "cafe0123cafe0123"


def save_checkpoints(directory: Path, steps, *, config_hash=CONFIG, generation=0, run="aa") -> list[Path]:
    """Real single-process DCP checkpoints of a small model + Adam, committed by the Checkpointer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters())
    checkpointer = Checkpointer(directory, Topology(), generation=generation, run_id=run)
    paths = []
    for step in steps:
        model(torch.randn(2, 16)).sum().backward()
        optimizer.step()
        progress = state.Progress(step=step, data_cursor=step * 2, world_size=1, generation=generation)
        snapshot = state.collect_state(model, optimizer, scheduler=None, scaler=None, progress=progress, rank=0)
        checkpointer.save(step, snapshot, {"loss": 1.5, "config_hash": config_hash, "world_size": 1,
                                           "data_cursor": step * 2, "generation": generation,
                                           "parts": state.saved_parts(set(snapshot))})
        paths.append(Path(checkpointer.wait().path))
    checkpointer.close()
    return paths


@pytest.fixture
def checkpoints(tmp_path) -> list[Path]:
    return save_checkpoints(tmp_path, [5, 10])


def shard(path: Path) -> Path:
    return next(path.glob("*.distcp"))


def flip_a_byte(path: Path) -> None:
    data = bytearray(shard(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard(path).write_bytes(bytes(data))


def reseal(path: Path, manifest: dict) -> None:
    """Rewrite the manifest and a matching marker, as a buggy (or hostile) writer would."""
    raw = json.dumps(manifest).encode()
    (path / MANIFEST).write_bytes(raw)
    (path / MARKER).write_text(json.dumps({"manifest_sha256": hashlib.sha256(raw).hexdigest()}))


def test_a_committed_checkpoint_verifies_and_its_manifest_is_complete(checkpoints):
    verdict = verify(checkpoints[-1], config_hash=CONFIG)
    assert verdict.ok and verdict.reason is None and verdict.step == 10
    manifest = verdict.manifest
    assert (manifest["step"], manifest["data_cursor"], manifest["world_size"]) == (10, 20, 1)
    assert manifest["parts"] == ["model", "optim", "progress", "rng"]
    names = {f["name"] for f in manifest["files"]}
    assert ".metadata" in names and shard(checkpoints[-1]).name in names
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in manifest["files"])


CORRUPTIONS = {
    "flipped byte in a shard": (flip_a_byte, "does not match its sha256"),
    "missing shard": (lambda p: shard(p).unlink(), "missing file"),
    "truncated manifest": (lambda p: (p / MANIFEST).write_bytes((p / MANIFEST).read_bytes()[:100]),
                           "does not match its commit marker"),
    "no commit marker": (lambda p: (p / MARKER).unlink(), "no commit marker"),
    "shard of another size": (lambda p: shard(p).write_bytes(shard(p).read_bytes() + b"x"), "bytes, the manifest says"),
    "manifest missing a shard DCP needs": (
        lambda p: reseal(p, {**(m := json.loads((p / MANIFEST).read_bytes())),
                             "files": [f for f in m["files"] if not f["name"].endswith(".distcp")]}),
        "incomplete"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_damaged_checkpoint_is_refused_and_the_previous_one_chosen(checkpoints, corruption, caplog):
    damage, reason = CORRUPTIONS[corruption]
    damage(checkpoints[-1])
    assert reason in verify(checkpoints[-1], config_hash=CONFIG).reason
    with caplog.at_level(logging.WARNING, logger="nightwatch.hooks"):
        chosen, rejected = latest_verified(checkpoints[0].parent, config_hash=CONFIG)
    assert Path(chosen.path) == checkpoints[0]
    assert [(Path(r.path), reason in r.reason) for r in rejected] == [(checkpoints[-1], True)]
    assert reason in caplog.text and checkpoints[-1].name in caplog.text


def test_a_checkpoint_from_another_config_is_incompatible(tmp_path):
    ours = save_checkpoints(tmp_path, [5])
    theirs = save_checkpoints(tmp_path, [10], config_hash="0000000000000000", run="bb")
    verdict = verify(theirs[0], config_hash=CONFIG)
    assert not verdict.ok and "incompatible configuration" in verdict.reason
    assert verify(theirs[0]).ok  # without a config to compare with, it is intact
    chosen, rejected = latest_verified(tmp_path, config_hash=CONFIG)
    assert Path(chosen.path) == ours[0] and [Path(r.path) for r in rejected] == [theirs[0]]


def test_an_empty_or_missing_directory_has_nothing_to_offer(tmp_path):
    assert latest_verified(tmp_path / "nowhere") == (None, [])
    (tmp_path / "step-00000005-g0-aa").mkdir()  # a save that died before writing anything
    chosen, rejected = latest_verified(tmp_path)
    assert chosen is None and "no commit marker" in rejected[0].reason


def test_generation_filter_and_exclusions(tmp_path):
    older = save_checkpoints(tmp_path, [5], generation=1, run="aa")
    newer = save_checkpoints(tmp_path, [10], generation=2, run="bb")
    assert Path(latest_verified(tmp_path, generation=1)[0].path) == older[0]
    assert Path(latest_verified(tmp_path)[0].path) == newer[0]
    assert Path(latest_verified(tmp_path, exclude={str(newer[0])})[0].path) == older[0]


def test_the_control_plane_can_verify_without_importing_torch_up_front():
    probe = "import sys, agents.hooks.manifest; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    assert result.stdout.strip() == "False"
