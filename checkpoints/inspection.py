"""Is the directory on disk the checkpoint the registry recorded, whole and complete?

The verifier's checks, in the order they run (cheap first):

1. the commit protocol (``agents.hooks.manifest.verify``): commit marker, manifest bound to it,
   config hash equal to the one the hooks reported, every file's size and sha256, every shard
   DCP's metadata names listed; read as hostile input (confined below ``root``, no symlinks,
   regular files only, within the ``Budget``; DCP metadata through a restricted unpickler);
2. the manifest is the one of *this* checkpoint: its step and data cursor are the recorded ones
   (a directory swapped for another step's would otherwise pass);
3. every required state part is present, both in the manifest's list and in DCP's metadata
   (what rank 0 claims and what was written), RNG for every rank of the world that saved it.

No tensor is ever loaded here: a load test deserialises what a training process wrote, so it
runs on a node (``python -m agents.hooks.loadtest``), and every resume loads the checkpoint anyway.
Plain values in, a ``Finding`` out: no models here, so the primary copy and the replica are
checked by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.hooks.manifest import Budget
from agents.hooks.manifest import verify as verify_commit

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
#: a sanity bound on a manifest's world size (it sizes a set of ranks here)
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class Finding:
    ok: bool
    reason: str = ""


def inspect_directory(path: str, *, root: str, budget: Budget, config_hash: str | None, step: int | None,
                      data_cursor: int | None) -> Finding:
    """Run the checks above on ``path`` (which must lie below ``root``); the first failure is the reason."""
    verdict = verify_commit(path, config_hash=config_hash or None, root=root, budget=budget)
    if not verdict.ok:
        return Finding(False, verdict.reason or "failed the commit-protocol check")
    manifest = verdict.manifest or {}
    if step is not None and manifest.get("step") != step:
        return Finding(False, f"the manifest on disk is for step {manifest.get('step')}, the registry recorded "
                              f"step {step} (directory replaced?)")
    if data_cursor is not None and manifest.get("data_cursor") != data_cursor:
        return Finding(False, f"the manifest's data cursor is {manifest.get('data_cursor')}, the registry "
                              f"recorded {data_cursor}")
    problem = missing_parts(manifest, verdict.dcp_keys or frozenset())
    if problem:
        return Finding(False, problem)
    return Finding(True)


def missing_parts(manifest: dict[str, Any], dcp_keys: set[str]) -> str | None:
    """Why the checkpoint lacks state a faithful resume needs, or None when it has it all."""
    required = dict(REQUIRED_PARTS)
    if manifest.get("amp"):
        required[AMP_PART[0]] = AMP_PART[1]
    parts, world_size = manifest.get("parts") or [], manifest.get("world_size") or 1
    if not isinstance(parts, list) or not all(isinstance(part, str) for part in parts):
        return "the manifest's parts is not a list of names"
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= MAX_WORLD_SIZE:
        return f"the manifest's world size {world_size!r} is not an integer from 1 to {MAX_WORLD_SIZE}"
    listed = set(parts)
    missing = [name for name in required if name not in listed]
    if missing:
        return "missing required state parts: " + ", ".join(f"{name} ({required[name]})" for name in missing)
    written = {_part_of(key) for key in dcp_keys}
    unwritten = sorted(listed - written)
    if unwritten:
        return f"the manifest lists parts {unwritten} that DCP's metadata does not contain (not written)"
    rng_ranks = {int(key[len(_RNG_PREFIX):]) for key in dcp_keys
                 if key.startswith(_RNG_PREFIX) and key[len(_RNG_PREFIX):].isdigit()}
    lost = sorted(set(range(world_size)) - rng_ranks)
    if lost:
        return f"RNG state of ranks {lost} is missing (world size {world_size}): those ranks would not resume " \
               "their random streams"
    return None


def _part_of(key: str) -> str:
    return "rng" if key.startswith(_RNG_PREFIX) else key.split(".", 1)[0]
