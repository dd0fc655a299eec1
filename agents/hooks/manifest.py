"""The commit protocol on disk, and the checks that decide whether a checkpoint may be restored.

A checkpoint is a directory. The ranks write their DCP shards and DCP's ``.metadata`` into it;
then rank 0, once every rank's shards are finished, writes:

1. ``manifest.json``: step, loss, config hash, world size, data cursor, generation, the state
   parts present, and every file with its size and sha256;
2. ``COMMITTED``: the commit marker, holding the manifest's own sha256.

Both are written to a temporary name, fsynced and renamed into place, so each appears whole or
not at all. No marker means no checkpoint. Binding the marker to the manifest's hash catches a
manifest that was truncated or rewritten after the commit.

``verify`` re-checks all of that; ``latest_verified`` walks a checkpoint directory from the newest
step down and returns the first checkpoint that passes, with the reason each newer one failed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("nightwatch.hooks")

MANIFEST = "manifest.json"
MARKER = "COMMITTED"
DCP_METADATA = ".metadata"
FORMAT = 1
#: ``step-00000040-g3-3fa2c1``: the step, the generation that wrote it, and an id unique to the
#: process group that wrote it, so a step reached again after a restart never shares a directory
#: with an earlier attempt's leftovers.
_STEP_DIR = re.compile(r"step-(\d+)-g(\d+)-[0-9a-f]+")
_REQUIRED = ("format", "step", "config_hash", "world_size", "data_cursor", "parts", "files")


@dataclass(frozen=True)
class Verdict:
    """The outcome of checking one checkpoint directory; ``reason`` says why it is not usable."""

    path: str
    ok: bool
    reason: str | None = None
    manifest: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def step(self) -> int | None:
        return self.manifest.get("step") if self.manifest else _step_from_name(self.path)


def checkpoint_dirname(step: int, generation: int, run_id: str) -> str:
    return f"step-{step:08d}-g{generation}-{run_id}"


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        # 4 MiB reads; hashlib releases the GIL on large buffers, so training keeps running.
        while chunk := handle.read(4 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """Hash every file of the checkpoint, write ``manifest.json``, then the commit marker."""
    files = []
    for path in sorted(p for p in directory.iterdir() if p.is_file() and not _is_ours(p.name)):
        files.append({"name": path.name, "size": path.stat().st_size, "sha256": file_digest(path)})
    manifest = {"format": FORMAT, **fields, "files": files}
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False).encode()
    _write_atomically(directory / MANIFEST, manifest_bytes)
    marker = {"manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(), "step": fields["step"]}
    _write_atomically(directory / MARKER, json.dumps(marker).encode())
    return manifest


def verify(path: str | os.PathLike[str], *, config_hash: str | None = None) -> Verdict:
    """Check a checkpoint directory: committed, manifest intact, compatible, every file whole.

    Cheap checks come first and hashing last, so an incompatible or uncommitted checkpoint is
    turned down without reading gigabytes.
    """
    directory = Path(path)
    where = str(directory)
    try:
        marker = json.loads((directory / MARKER).read_bytes())
    except FileNotFoundError:
        return Verdict(where, False, "no commit marker: the save never finished")
    except ValueError:
        return Verdict(where, False, "commit marker is unreadable")
    try:
        manifest_bytes = (directory / MANIFEST).read_bytes()
    except FileNotFoundError:
        return Verdict(where, False, "committed but manifest.json is missing")
    if hashlib.sha256(manifest_bytes).hexdigest() != marker.get("manifest_sha256"):
        return Verdict(where, False, "manifest.json does not match its commit marker (truncated or rewritten)")
    try:
        manifest = json.loads(manifest_bytes)
    except ValueError:
        return Verdict(where, False, "manifest.json is not valid JSON")
    missing = [key for key in _REQUIRED if key not in manifest]
    if missing or manifest["format"] != FORMAT:
        return Verdict(where, False, f"manifest lacks {missing} or has an unknown format", manifest)
    if config_hash is not None and manifest["config_hash"] != config_hash:
        return Verdict(where, False, f"config hash {manifest['config_hash']} differs from this run's "
                                     f"{config_hash} (incompatible configuration)", manifest)
    listed = {entry["name"] for entry in manifest["files"]}
    if DCP_METADATA not in listed:
        return Verdict(where, False, "manifest does not list the DCP metadata file", manifest)
    for entry in manifest["files"]:
        problem = _check_file(directory / entry["name"], entry)
        if problem:
            return Verdict(where, False, problem, manifest)
    # Last, with every file known to be intact: does DCP's own metadata name a shard the manifest
    # does not list? Then the manifest was written before every rank had finished.
    try:
        unlisted = _shards_named_by_metadata(directory) - listed
    except Exception as error:  # a DCP that cannot read its own metadata cannot restore from it
        return Verdict(where, False, f"DCP metadata unreadable: {error}", manifest)
    if unlisted:
        return Verdict(where, False, f"incomplete: shards {sorted(unlisted)} are not in the manifest", manifest)
    return Verdict(where, True, None, manifest)


def latest_verified(directory: str | os.PathLike[str], *, config_hash: str | None = None,
                    generation: int | None = None, exclude: Collection[str] = ()
                    ) -> tuple[Verdict | None, list[Verdict]]:
    """The newest checkpoint under ``directory`` that verifies, and why each newer one did not.

    With ``generation``, only checkpoints written by that generation are considered (used to
    pick up where a torchrun restart within one generation left off); paths in ``exclude`` were
    already turned down. Each rejection is logged.
    """
    rejected: list[Verdict] = []
    for candidate in _candidates(Path(directory)):
        if str(candidate) in exclude or (generation is not None and _generation_from_name(candidate) != generation):
            continue
        verdict = verify(candidate, config_hash=config_hash)
        if verdict.ok:
            return verdict, rejected
        log.warning("not restoring checkpoint %s: %s", verdict.path, verdict.reason)
        rejected.append(verdict)
    return None, rejected


def _candidates(directory: Path) -> list[Path]:
    """Checkpoint directories, newest step first (then newest written first)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: (_step_from_name(str(p)) or 0, _mtime(p)), reverse=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # removed by retention while we looked
        return 0.0


def _step_from_name(path: str) -> int | None:
    match = _STEP_DIR.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def _generation_from_name(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(2)) if match else None


def _check_file(path: Path, entry: dict[str, Any]) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"missing file {entry['name']}"
    if size != entry["size"]:
        return f"{entry['name']} is {size} bytes, the manifest says {entry['size']}"
    if file_digest(path) != entry["sha256"]:
        return f"{entry['name']} does not match its sha256 (corrupted)"
    return None


def _shards_named_by_metadata(directory: Path) -> set[str]:
    """The shard files DCP's own metadata points at: a manifest missing one was written too early."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory)).read_metadata()
    return {info.relative_path for info in (metadata.storage_data or {}).values()}


def _is_ours(name: str) -> bool:
    return name in (MANIFEST, MARKER) or name.endswith(".tmp")


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    # fsync the directory too, or the rename itself may not survive a power cut.
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
