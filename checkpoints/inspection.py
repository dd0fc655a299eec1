"""Is the directory on disk the checkpoint the registry recorded, whole, complete and loadable?

The verifier's checks, in the order they run (cheap first, the load test last):

1. the commit protocol (``agents.hooks.manifest.verify``): commit marker, manifest bound to it,
   config hash equal to the one the hooks reported, every file's size and sha256, every shard
   DCP's metadata names listed;
2. the manifest is the one of *this* checkpoint: its step and data cursor are the recorded ones
   (a directory swapped for another step's would otherwise pass);
3. every required state part is present, both in the manifest's list and in DCP's metadata
   (what rank 0 claims and what was written), RNG for every rank of the world that saved it;
4. optionally, a load test on CPU in a child process (``checkpoints.loadtest``).

Plain values in, a ``Finding`` out: no models here, so the primary copy and the replica are
checked by the same code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: manifest part name -> what it is. A resume without any of these silently differs from an
#: uninterrupted run (the reference's checklist: the LR scheduler and the data-loader position
#: are the parts most often forgotten). "progress" holds the step and the global data cursor.
REQUIRED_PARTS = {
    "model": "model weights",
    "optim": "optimizer state",
    "scheduler": "LR scheduler",
    "progress": "step and data-loader position",
    "rng": "RNG states",
}
#: required as well when the manifest says the run used mixed precision (``"amp": true``)
AMP_PART = ("scaler", "AMP grad scaler")
_RNG_PREFIX = "rng.rank"
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Finding:
    ok: bool
    reason: str = ""


def inspect_directory(path: str, *, config_hash: str | None, step: int | None, data_cursor: int | None,
                      load_test: bool = False, load_test_timeout_s: float = 600.0) -> Finding:
    """Run the checks above on ``path``; the first failure is the reason."""
    from agents.hooks.manifest import verify as verify_commit

    verdict = verify_commit(path, config_hash=config_hash or None)
    if not verdict.ok:
        return Finding(False, verdict.reason or "failed the commit-protocol check")
    manifest = verdict.manifest or {}
    if step is not None and manifest.get("step") != step:
        return Finding(False, f"the manifest on disk is for step {manifest.get('step')}, the registry recorded "
                              f"step {step} (directory replaced?)")
    if data_cursor is not None and manifest.get("data_cursor") != data_cursor:
        return Finding(False, f"the manifest's data cursor is {manifest.get('data_cursor')}, the registry "
                              f"recorded {data_cursor}")
    problem = missing_parts(manifest, _dcp_keys(path, _metadata_sha256(manifest)))
    if problem:
        return Finding(False, problem)
    if load_test:
        return run_load_test(path, step=manifest.get("step"), data_cursor=manifest.get("data_cursor"),
                             timeout_s=load_test_timeout_s)
    return Finding(True)


def missing_parts(manifest: dict[str, Any], dcp_keys: set[str]) -> str | None:
    """Why the checkpoint lacks state a faithful resume needs, or None when it has it all."""
    required = dict(REQUIRED_PARTS)
    if manifest.get("amp"):
        required[AMP_PART[0]] = AMP_PART[1]
    listed = set(manifest.get("parts") or ())
    missing = [name for name in required if name not in listed]
    if missing:
        return "missing required state parts: " + ", ".join(f"{name} ({required[name]})" for name in missing)
    written = {_part_of(key) for key in dcp_keys}
    unwritten = sorted(listed - written)
    if unwritten:
        return f"the manifest lists parts {unwritten} that DCP's metadata does not contain (not written)"
    world_size = manifest.get("world_size") or 1
    rng_ranks = {int(key[len(_RNG_PREFIX):]) for key in dcp_keys
                 if key.startswith(_RNG_PREFIX) and key[len(_RNG_PREFIX):].isdigit()}
    lost = sorted(set(range(world_size)) - rng_ranks)
    if lost:
        return f"RNG state of ranks {lost} is missing (world size {world_size}): those ranks would not resume " \
               "their random streams"
    return None


def _part_of(key: str) -> str:
    return "rng" if key.startswith(_RNG_PREFIX) else key.split(".", 1)[0]


def _metadata_sha256(manifest: dict[str, Any]) -> str | None:
    from agents.hooks.manifest import DCP_METADATA

    return next((entry.get("sha256") for entry in manifest.get("files") or () if entry.get("name") == DCP_METADATA),
                None)


def _dcp_keys(path: str, metadata_sha256: str | None) -> frozenset[str]:
    """The state-dict keys DCP's metadata names; parsed once per distinct metadata file.

    Unpickling ``.metadata`` was over half of a warm verification (the commit-protocol check
    unpickles it too), and recovery re-verifies the checkpoint it restores from. The commit-protocol
    check has just proved that the file's bytes hash to ``metadata_sha256``, so keys parsed from
    bytes with that hash are the keys of this file: the cache is keyed by content, not by path.
    """
    if metadata_sha256 is None:
        return _read_dcp_keys(path)
    cached = _DCP_KEYS_BY_SHA256.get(metadata_sha256)
    if cached is None:
        cached = _read_dcp_keys(path)
        _DCP_KEYS_BY_SHA256[metadata_sha256] = cached
        while len(_DCP_KEYS_BY_SHA256) > _DCP_KEYS_CACHE_SIZE:
            _DCP_KEYS_BY_SHA256.pop(next(iter(_DCP_KEYS_BY_SHA256)))  # oldest first: dicts keep insertion order
    return cached


def _read_dcp_keys(path: str) -> frozenset[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return frozenset(FileSystemReader(path).read_metadata().state_dict_metadata)


#: metadata sha256 -> its state-dict keys; enough for the recent checkpoints of many jobs
_DCP_KEYS_CACHE_SIZE = 256
_DCP_KEYS_BY_SHA256: dict[str, frozenset[str]] = {}


def run_load_test(path: str, *, step: int | None, data_cursor: int | None, timeout_s: float) -> Finding:
    """``python -m checkpoints.loadtest`` in a child process on CPU; its JSON line is the verdict."""
    command = [sys.executable, "-m", "checkpoints.loadtest", path]
    if step is not None:
        command += ["--step", str(step)]
    if data_cursor is not None:
        command += ["--data-cursor", str(data_cursor)]
    # CPU only: the control plane's host may have no GPU, and must never grab one a job needs.
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=environment,
                              cwd=REPO_ROOT, check=False)
    except subprocess.TimeoutExpired:
        return Finding(False, f"load test did not finish within {timeout_s:g} s")
    lines = done.stdout.strip().splitlines()
    try:
        verdict = json.loads(lines[-1]) if lines else None
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict):
        tail = (done.stderr or done.stdout).strip()[-300:]
        return Finding(False, f"load test crashed (exit {done.returncode}): {tail}")
    return Finding(bool(verdict.get("ok")), verdict.get("reason") or "")
