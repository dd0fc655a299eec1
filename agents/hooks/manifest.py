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

The control plane runs ``verify`` too, on directories a training process (arbitrary code) wrote:
so it reads only regular files named in the manifest, never through a symlink, within a byte and
time ``Budget``, and parses DCP's pickled ``.metadata`` with ``DcpMetadataUnpickler``, which
builds DCP's metadata classes and refuses every other global. Nothing here loads tensors.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import re
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
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
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MARKER_MAX_BYTES = 4096
_CHUNK = 4 << 20


class UnsafePath(Exception):
    """The path leaves its root, crosses a symlink or names something that is not a regular file."""


class OverBudget(Exception):
    """Verification would read more, or take longer, than its budget allows."""


@dataclass(frozen=True)
class Budget:
    """How much one verification may read and how long it may take; None is unlimited.

    The hooks verify their own checkpoints unbounded; the control plane passes its settings, so
    that a manifest claiming a petabyte, or storage that stalls, cannot hold a worker forever.
    """

    max_bytes: int | None = None
    timeout_s: float | None = None
    max_manifest_bytes: int = 16 << 20
    max_metadata_bytes: int = 256 << 20

    def started(self) -> _Running:
        return _Running(self, None if self.timeout_s is None else time.monotonic() + self.timeout_s)


@dataclass(frozen=True)
class _Running:
    limits: Budget
    deadline: float | None

    def check(self, doing: str) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise OverBudget(f"verification did not finish within its budget of {self.limits.timeout_s:g} s "
                             f"(while {doing})")


@dataclass(frozen=True)
class Verdict:
    """The outcome of checking one checkpoint directory; ``reason`` says why it is not usable."""

    path: str
    ok: bool
    reason: str | None = None
    manifest: dict[str, Any] | None = field(default=None, repr=False)
    #: the state-dict keys DCP's metadata names (set when the checkpoint verified)
    dcp_keys: frozenset[str] | None = field(default=None, repr=False)

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


def verify(path: str | os.PathLike[str], *, config_hash: str | None = None, root: str | None = None,
           budget: Budget | None = None) -> Verdict:
    """Check a checkpoint directory: committed, manifest intact, compatible, every file whole.

    Cheap checks come first and hashing last, so an incompatible or uncommitted checkpoint is
    turned down without reading gigabytes. Everything in the directory is treated as hostile
    (the control plane runs this on what a training process wrote): no symlink is followed (below
    ``root`` when given, else at ``path`` itself), only regular files are read, at most as many
    bytes as the manifest declares, within ``budget``; DCP's metadata is parsed by a restricted
    unpickler that builds only DCP's own metadata classes.
    """
    where = str(path)
    budget = budget or Budget()
    try:
        with CheckpointDir(where, root=root) as directory:
            return _verify_open(directory, where, config_hash, budget.started())
    except (UnsafePath, OverBudget) as error:
        return Verdict(where, False, str(error))
    except FileNotFoundError:
        return Verdict(where, False, "the checkpoint directory does not exist")
    except NotADirectoryError:
        return Verdict(where, False, "the checkpoint path is not a directory")


def _verify_open(directory: CheckpointDir, where: str, config_hash: str | None, budget: _Running) -> Verdict:
    try:
        marker = json.loads(directory.read_small(MARKER, _MARKER_MAX_BYTES))
    except FileNotFoundError:
        return Verdict(where, False, "no commit marker: the save never finished")
    except ValueError:
        return Verdict(where, False, "commit marker is unreadable")
    try:
        manifest_bytes = directory.read_small(MANIFEST, budget.limits.max_manifest_bytes)
    except FileNotFoundError:
        return Verdict(where, False, "committed but manifest.json is missing")
    if not isinstance(marker, dict) or hashlib.sha256(manifest_bytes).hexdigest() != marker.get("manifest_sha256"):
        return Verdict(where, False, "manifest.json does not match its commit marker (truncated or rewritten)")
    try:
        manifest = json.loads(manifest_bytes)
    except ValueError:
        return Verdict(where, False, "manifest.json is not valid JSON")
    problem = _manifest_problem(manifest, budget.limits)
    if problem:
        return Verdict(where, False, problem, manifest if isinstance(manifest, dict) else None)
    if config_hash is not None and manifest["config_hash"] != config_hash:
        return Verdict(where, False, f"config hash {manifest['config_hash']} differs from this run's "
                                     f"{config_hash} (incompatible configuration)", manifest)
    metadata_bytes = b""
    for entry in manifest["files"]:
        keep = entry["name"] == DCP_METADATA
        problem, content = directory.check_file(entry, budget, keep=keep)
        if problem:
            return Verdict(where, False, problem, manifest)
        if keep:
            metadata_bytes = content
    # Last, with every file known to be intact: does DCP's own metadata name a shard the manifest
    # does not list? Then the manifest was written before every rank had finished.
    try:
        keys, shards = dcp_metadata_summary(metadata_bytes)
    except Exception as error:  # a DCP that cannot read its own metadata cannot restore from it
        return Verdict(where, False, f"DCP metadata unreadable: {error}", manifest)
    unlisted = shards - {entry["name"] for entry in manifest["files"]}
    if unlisted:
        return Verdict(where, False, f"incomplete: shards {sorted(unlisted)} are not in the manifest", manifest)
    return Verdict(where, True, None, manifest, dcp_keys=keys)


def _manifest_problem(manifest: Any, limits: Budget) -> str | None:
    """Why the manifest's shape is unusable (hostile input: every field is checked before use)."""
    if not isinstance(manifest, dict):
        return "manifest.json is not a JSON object"
    missing = [key for key in _REQUIRED if key not in manifest]
    if missing or manifest["format"] != FORMAT:
        return f"manifest lacks {missing} or has an unknown format"
    files = manifest["files"]
    if not isinstance(files, list) or not all(isinstance(entry, dict) for entry in files):
        return "manifest's files is not a list of entries"
    names = set()
    for entry in files:
        problem = _entry_problem(entry)
        if problem:
            return problem
        if entry["name"] in names:
            return f"manifest lists {entry['name']!r} twice"
        names.add(entry["name"])
    if DCP_METADATA not in names:
        return "manifest does not list the DCP metadata file"
    total = sum(entry["size"] for entry in files)
    if limits.max_bytes is not None and total > limits.max_bytes:
        return f"the manifest lists {total} bytes, over the verification budget of {limits.max_bytes} bytes"
    return None


def _entry_problem(entry: dict[str, Any]) -> str | None:
    name, size, digest = entry.get("name"), entry.get("size"), entry.get("sha256")
    problem = name_problem(name)
    if problem:
        return f"manifest entry {name!r}: {problem}"
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"manifest entry {name!r}: size must be a non-negative integer"
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        return f"manifest entry {name!r}: sha256 must be 64 hexadecimal digits"
    return None


def name_problem(name: Any) -> str | None:
    """Why ``name`` is not a plain file name inside the checkpoint directory (None when it is).

    The hooks write every file flat into the directory, so a name with a separator, ``..`` or an
    absolute part can only be an attempt to reach outside it.
    """
    if not isinstance(name, str) or not name or len(name) > 255:
        return "not a file name"
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        return "must be a plain file name inside the checkpoint directory (no '/', '..' or absolute path)"
    return None


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


# --- reading a directory someone else wrote ---------------------------------------------------

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it anyway.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def inside(path: str, root: str) -> PurePosixPath:
    """``path`` relative to ``root``, refusing anything that is not strictly beneath it.

    Lexical, so that the caller can then walk the components one by one without following a
    symlink (``CheckpointDir``): ``path`` must be absolute, hold no ``..``, and start with
    ``root`` as configured or with its real path.
    """
    if not os.path.isabs(path) or ".." in PurePosixPath(path).parts or "\0" in path:
        raise UnsafePath(f"{path!r} must be an absolute path without '..'")
    normal = os.path.normpath(path)
    for base in dict.fromkeys((os.path.normpath(root), os.path.realpath(root))):
        relative = os.path.relpath(normal, base)
        if relative != "." and not relative.startswith(".."):
            return PurePosixPath(relative)
    raise UnsafePath(f"{path} is outside {root}")


class CheckpointDir:
    """An open checkpoint directory whose files are read by name, never through a symlink.

    With ``root``, the directory is reached from the root one component at a time with
    ``O_NOFOLLOW``, so a symlinked directory anywhere below the root is refused too, and a symlink
    swapped in after a path check cannot redirect the walk.
    """

    def __init__(self, path: str, *, root: str | None = None):
        self.path = path
        self.fd = _open_beneath(path, root)

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def open_file(self, name: str) -> tuple[int, os.stat_result]:
        """A descriptor of the regular file ``name`` and its status; refuses symlinks and devices."""
        problem = name_problem(name)
        if problem:
            raise UnsafePath(f"{name!r}: {problem}")
        try:
            descriptor = os.open(name, _FILE_FLAGS, dir_fd=self.fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UnsafePath(f"{name} is a symlink; checkpoint files must be regular files") from error
            raise
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            os.close(descriptor)
            raise UnsafePath(f"{name} is not a regular file (a directory, device, FIFO or socket)")
        return descriptor, status

    def read_small(self, name: str, limit: int) -> bytes:
        """The whole of a small file (marker, manifest); one larger than ``limit`` is refused."""
        descriptor, status = self.open_file(name)
        try:
            if status.st_size > limit:
                raise OverBudget(f"{name} is {status.st_size} bytes, over the limit of {limit} bytes")
            with os.fdopen(descriptor, "rb", closefd=False) as handle:
                return handle.read(limit + 1)[:limit]
        finally:
            os.close(descriptor)

    def check_file(self, entry: dict[str, Any], budget: _Running, *, keep: bool = False) -> tuple[str | None, bytes]:
        """Why the file of a manifest entry is not the one committed (None: it is), and with
        ``keep`` its content, hashed and returned from the same read (no second open to race)."""
        name, size = entry["name"], entry["size"]
        budget.check(f"opening {name}")
        try:
            descriptor, status = self.open_file(name)
        except FileNotFoundError:
            return f"missing file {name}", b""
        try:
            if status.st_size != size:
                return f"{name} is {status.st_size} bytes, the manifest says {size}", b""
            if keep and size > budget.limits.max_metadata_bytes:
                raise OverBudget(f"{name} is {size} bytes, over the limit of {budget.limits.max_metadata_bytes}")
            digest, content = _hash_open_file(descriptor, name, size, budget, keep=keep)
        finally:
            os.close(descriptor)
        if digest != entry["sha256"]:
            return f"{name} does not match its sha256 (corrupted)", b""
        return None, content


def _open_beneath(path: str, root: str | None) -> int:
    if root is None:
        return _open_directory(path, None)
    return open_directory_beneath(root, inside(path, root).parts)


def open_directory_beneath(root: str, parts: tuple[str, ...]) -> int:
    """A descriptor of ``root/parts...``, walked one component at a time without following a symlink."""
    descriptor = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            following = _open_directory(part, descriptor)
            os.close(descriptor)
            descriptor = following
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _open_directory(name: str, parent: int | None) -> int:
    try:
        return os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)
    except OSError as error:
        # Linux answers ENOTDIR, not ELOOP, for a symlink opened with O_DIRECTORY | O_NOFOLLOW.
        if error.errno == errno.ELOOP or (error.errno == errno.ENOTDIR and _is_symlink(name, parent)):
            raise UnsafePath(f"{name} is a symlink; checkpoint directories are never reached through one") from error
        raise


def _is_symlink(name: str, parent: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _hash_open_file(descriptor: int, name: str, size: int, budget: _Running, *, keep: bool) -> tuple[str, bytes]:
    """sha256 of the first ``size`` bytes (a file that grew is caught by its hash), within budget."""
    digest, kept, left = hashlib.sha256(), [], size + 1
    while left > 0:
        chunk = os.read(descriptor, min(_CHUNK, left))
        if not chunk:
            break
        left -= len(chunk)
        digest.update(chunk)
        if keep:
            kept.append(chunk)
        budget.check(f"hashing {name}")
    return digest.hexdigest(), b"".join(kept)


# --- DCP's metadata, without unpickling anything else --------------------------------------------

#: What a DCP ``.metadata`` pickle may name: DCP's metadata dataclasses and the few torch and
#: standard types their fields hold. Anything else (``os.system``, ``builtins.eval``, ...) is
#: refused before it is even imported: this is the whole defence against a crafted pickle.
_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class DcpMetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file and nothing else: ``find_class`` admits only the globals
    above, plus torch's dtype constants (``torch.float32``: values, not callables)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and name.isidentifier():
            # torch only when a DCP file is read: the control plane verifies manifests without it
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise pickle.UnpicklingError(f"DCP metadata names {module}.{name}, which is not a DCP metadata type")


def dcp_metadata_summary(data: bytes) -> tuple[frozenset[str], frozenset[str]]:
    """(state-dict keys, shard files) named by the bytes of a DCP ``.metadata`` file.

    Parsed once per distinct content: recovery re-verifies the checkpoint it restores from, and
    the bytes were just proved to hash to what the manifest says.
    """
    key = hashlib.sha256(data).hexdigest()
    cached = _SUMMARIES.get(key)
    if cached is None:
        # torch only when a DCP file is read: the control plane verifies manifests without it
        from torch.distributed.checkpoint.metadata import Metadata

        metadata = DcpMetadataUnpickler(io.BytesIO(data)).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP Metadata")
        shards = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
        cached = frozenset(map(str, metadata.state_dict_metadata)), frozenset(str(s) for s in shards)
        _SUMMARIES[key] = cached
        while len(_SUMMARIES) > _SUMMARY_CACHE_SIZE:
            _SUMMARIES.pop(next(iter(_SUMMARIES)))  # oldest first: dicts keep insertion order
    return cached


#: metadata sha256 -> its summary; enough for the recent checkpoints of many jobs
_SUMMARY_CACHE_SIZE = 256
_SUMMARIES: dict[str, tuple[frozenset[str], frozenset[str]]] = {}


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
