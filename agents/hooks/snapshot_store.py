"""In-memory snapshots on the node: their layout in a tmpfs, their commit discipline, retention.

A snapshot must outlive the rank's process (a SIGKILL, a torchrun restart) but not the node, so
it lives in node memory outside the process: files in a tmpfs, ``/dev/shm/nightwatch`` unless
``NIGHTWATCH_SNAPSHOT_DIR`` says otherwise. Under the root, one directory per job (its id and a
hash of where its checkpoints go, so two standalone jobs on one machine never share one)::

    <root>/<job key>/rank<owner>/own/step-00000042-g3-3fa2c1/   the owner's copy, written by the owner
    <root>/<job key>/rank<owner>/copy/step-00000042-g3-3fa2c1/  its partner's copy, written by the partner

Each snapshot directory holds ``state.pt`` (the rank's whole state, ``torch.save`` of plain
tensors, numbers, strings and opaque blobs), ``manifest.json`` (step, generation, run, job,
config hash, world size, owner rank, data cursor, the shard's size and sha256) and the marker
``COMMITTED`` (the manifest's sha256), written last by atomic rename, as for disk checkpoints
(``manifest.py``). No marker, no snapshot.

The owner writes its own marker only after its partner said that the copy is committed on its
side (``snapshot.py``): an owner's marker therefore proves that both copies were complete, and a
partner's copy marker proves that the owner had written its own copy (it writes before sending).

Retention: at most ``KEEP`` committed snapshots per owner and kind; an older one is removed only
after a newer one committed, so a crash at any moment leaves at least one committed snapshot.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("nightwatch.hooks")

SHARD = "state.pt"
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
FORMAT = 1
KEEP = 2  # committed snapshots kept per owner and kind: the newest, and the one before it
OWN, COPY = "own", "copy"
_NAME = re.compile(r"step-(\d{8})-g(\d+)-([0-9a-f]+)")
_REQUIRED = {"format": int, "step": int, "generation": int, "run_id": str, "job": str, "config_hash": str,
             "world_size": int, "owner": int, "data_cursor": int, "size": int, "sha256": str}
_MAX_MANIFEST_BYTES = 64 << 10


def default_root(configured: str | None) -> Path:
    """``configured`` (``NIGHTWATCH_SNAPSHOT_DIR``), else ``/dev/shm/nightwatch`` (node memory),
    else a temp directory."""
    if configured:
        return Path(configured)
    # Node memory that outlives the process; the job's directory under it is the user's alone (0700).
    shm = Path("/dev/shm")  # noqa: S108
    return shm / "nightwatch" if shm.is_dir() else Path(tempfile.gettempdir()) / "nightwatch-snapshots"


def job_key(job: str, anchor: str | None) -> str:
    """The job's directory name: its id, and a hash of its checkpoint directory (or working
    directory), so that two standalone jobs (both called "local") keep apart."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)[:64]
    where = os.path.realpath(anchor) if anchor else os.getcwd()
    return f"{safe}-{hashlib.sha256(where.encode()).hexdigest()[:10]}"


@dataclass(frozen=True)
class SnapshotKey:
    """Which snapshot: the step, the generation and the run (one process group) that took it."""

    step: int
    generation: int
    run_id: str

    @property
    def dirname(self) -> str:
        return f"step-{self.step:08d}-g{self.generation}-{self.run_id}"

    @classmethod
    def parse(cls, name: str) -> SnapshotKey | None:
        match = _NAME.fullmatch(name)
        return cls(int(match.group(1)), int(match.group(2)), match.group(3)) if match else None


@dataclass(frozen=True)
class Found:
    """A committed snapshot as listed (marker and manifest checked, the shard not yet hashed)."""

    path: Path
    key: SnapshotKey
    manifest: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class Verified:
    """A snapshot read whole and checked: ``data`` is the shard, matching its sha256."""

    path: Path
    manifest: dict[str, Any] = field(repr=False)
    data: bytes = field(repr=False)


class Refused(Exception):
    """A snapshot that must not be restored; the message says why."""


class SnapshotStore:
    """The snapshots of one job on this node (see the module docstring for the layout)."""

    def __init__(self, root: Path, key: str):
        self.directory = root / key

    def place(self, owner: int, kind: str) -> Path:
        return self.directory / f"rank{owner}" / kind

    def start(self, owner: int, kind: str, key: SnapshotKey, shard: bytes | memoryview,
              manifest: dict[str, Any]) -> Path:
        """Write the shard and the manifest of a snapshot (not yet committed)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.place(owner, kind) / key.dirname
        path.mkdir(parents=True, exist_ok=True)
        _publish(path / SHARD, shard)
        _publish(path / MANIFEST, manifest_bytes(manifest))
        return path

    def commit(self, path: Path) -> None:
        """Write the marker (binding the manifest as written), then drop what retention allows."""
        manifest = (path / MANIFEST).read_bytes()
        _publish(path / MARKER, json.dumps({"manifest_sha256": hashlib.sha256(manifest).hexdigest()}).encode())
        self.prune(path.parent, keep_also=(path,))

    def prune(self, place: Path, keep_also: Iterable[Path] = ()) -> None:
        """Keep the ``KEEP`` newest committed snapshots in ``place`` (and ``keep_also``); remove the
        rest, uncommitted leftovers of earlier runs included (never the one being written now:
        only one snapshot per owner and kind is in flight, and it is the newest)."""
        kept = {p.name for p in keep_also}
        committed = [found.path for found in self.committed(place)]
        kept.update(p.name for p in committed[:KEEP])
        newest_committed = SnapshotKey.parse(committed[0].name) if committed else None
        for entry in _entries(place):
            key = SnapshotKey.parse(entry.name)
            if entry.name in kept or key is None:
                continue
            in_flight = newest_committed is None or key.step > newest_committed.step
            if (entry / MARKER).exists() or not in_flight:
                shutil.rmtree(entry, ignore_errors=True)

    def keep_only(self, owner: int, kind: str, keep: SnapshotKey | None) -> None:
        """Remove every snapshot of ``owner`` and ``kind`` except ``keep``: a new run owns the job's
        snapshots from the moment it chose where to resume, and nothing else there is its lineage."""
        for entry in _entries(self.place(owner, kind)):
            if keep is None or entry.name != keep.dirname:
                shutil.rmtree(entry, ignore_errors=True)

    def remove_empty(self) -> None:
        """Remove the job's directories that hold nothing any more (another rank's may still be in use).

        Every rank of the node does this as it finishes, at the same moment: a directory another
        rank removed after it was listed here is not an error (``glob`` raised on it).
        """
        for owner in _entries(self.directory):
            if not owner.name.startswith("rank"):
                continue
            for kind in _entries(owner):
                with contextlib.suppress(OSError):
                    kind.rmdir()
            with contextlib.suppress(OSError):
                owner.rmdir()
        with contextlib.suppress(OSError):
            self.directory.rmdir()

    def owners(self) -> list[int]:
        """The ranks whose snapshots (either copy) this node holds for the job."""
        return sorted(int(entry.name[4:]) for entry in _entries(self.directory)
                      if entry.name.startswith("rank") and entry.name[4:].isdigit())

    def keep_places(self, places: set[tuple[int, str]], keep: SnapshotKey | None) -> None:
        """Keep ``keep`` in each of ``places`` ((owner, kind), where this node's ranks now write)
        and nothing else: a snapshot in any other place is an earlier numbering's (the ranks were
        numbered anew after a node was lost), and never restored again once this run chose."""
        for owner in self.owners():
            for kind in (OWN, COPY):
                self.keep_only(owner, kind, keep if (owner, kind) in places else None)

    def uncommitted(self, owner: int, kind: str) -> list[SnapshotKey]:
        """Snapshots of ``owner`` and ``kind`` begun here and never committed (torn)."""
        keys = (SnapshotKey.parse(entry.name) for entry in _entries(self.place(owner, kind))
                if not (entry / MARKER).exists())
        return [key for key in keys if key is not None]

    def committed(self, place: Path) -> list[Found]:
        """Committed snapshots in ``place``, newest step first; damaged ones are logged and left out."""
        found = []
        for entry in _entries(place):
            key = SnapshotKey.parse(entry.name)
            if key is None or not (entry / MARKER).exists():
                continue
            try:
                manifest = read_manifest(entry)
            except Refused as error:
                log.warning("not restoring snapshot %s: %s", entry, error)
                continue
            if (manifest["step"], manifest["generation"], manifest["run_id"]) != (key.step, key.generation,
                                                                                  key.run_id):
                log.warning("not restoring snapshot %s: its manifest names another snapshot", entry)
                continue
            found.append(Found(entry, key, manifest))
        return sorted(found, key=lambda f: (f.key.step, f.key.generation), reverse=True)


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return json.dumps({"format": FORMAT, **manifest}, sort_keys=True, allow_nan=False).encode()


def read_manifest(path: Path) -> dict[str, Any]:
    """The committed manifest of the snapshot at ``path``, checked against its marker and shape."""
    try:
        marker = json.loads(_read_small(path / MARKER))
        raw = _read_small(path / MANIFEST)
    except FileNotFoundError as missing:
        raise Refused(f"{Path(missing.filename or '').name} is missing") from None
    except ValueError:
        raise Refused("the commit marker is unreadable") from None
    if not isinstance(marker, dict) or hashlib.sha256(raw).hexdigest() != marker.get("manifest_sha256"):
        raise Refused("manifest.json does not match its commit marker (truncated or rewritten)")
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise Refused("manifest.json is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise Refused("manifest.json has an unknown format")
    for name, kind in _REQUIRED.items():
        if not isinstance(manifest.get(name), kind) or isinstance(manifest.get(name), bool):
            raise Refused(f"manifest.json: {name} missing or not a {kind.__name__}")
    return manifest


def read_verified(path: Path) -> Verified:
    """Read the committed snapshot at ``path`` whole; refuse it unless the shard matches its sha256.

    The bytes returned are the ones hashed: nothing is read twice, so a file changed after the
    check cannot slip through it.
    """
    manifest = read_manifest(path)
    try:
        descriptor = os.open(path / SHARD, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise Refused(f"{SHARD} is missing") from None
    except OSError as error:
        raise Refused(f"{SHARD} cannot be opened: {error}") from None
    with os.fdopen(descriptor, "rb") as handle:
        data = handle.read(manifest["size"] + 1)
    if len(data) != manifest["size"]:
        raise Refused(f"{SHARD} has {len(data)} bytes, the manifest says {manifest['size']} (truncated or torn)")
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise Refused(f"{SHARD} does not match its sha256 (corrupted)")
    return Verified(path, manifest, data)


def _entries(place: Path) -> list[Path]:
    try:
        return [entry for entry in place.iterdir() if entry.is_dir() and not entry.is_symlink()]
    except FileNotFoundError:
        return []


def _read_small(path: Path) -> bytes:
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "rb") as handle:
        data = handle.read(_MAX_MANIFEST_BYTES + 1)
    if len(data) > _MAX_MANIFEST_BYTES:
        raise ValueError(f"{path.name} is over {_MAX_MANIFEST_BYTES} bytes")
    return data


def _publish(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` under a temporary name and rename it into place: whole or absent. No fsync:
    a tmpfs does not outlive a power cut anyway, and the snapshot is not meant to."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as handle:
        handle.write(data)
    os.replace(temporary, path)
