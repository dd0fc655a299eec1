"""Copying and removing checkpoint directories, carefully.

The control plane deletes directories named by rows that came over the network: removal refuses
anything that does not look like a checkpoint directory, so a bad ``location`` can never turn
into ``rm -rf`` of something else.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from agents.hooks.manifest import DCP_METADATA, MANIFEST, MARKER

_CHECKPOINT_FILES = (MARKER, MANIFEST, DCP_METADATA)
TRASH_SUFFIX = ".deleting"


class UnsafePath(Exception):
    """The path does not look like a checkpoint directory; nothing was touched."""


def looks_like_checkpoint(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and any((path / name).exists() for name in _CHECKPOINT_FILES)


def remove_checkpoint_dir(location: str) -> bool:
    """Remove a checkpoint directory; returns False when it was already gone.

    1. Refuse relative paths, symlinks and directories holding none of the commit-protocol files.
    2. Rename it to ``<name>.<id>.deleting`` first (atomic): the hooks' directory scan and the
       verifier no longer see a half-removed checkpoint, even if we crash while removing.
    3. Remove the renamed tree.
    """
    path = Path(location)
    if not path.is_absolute():
        raise UnsafePath(f"refusing to remove {location!r}: not an absolute path")
    if not path.exists() and not path.is_symlink():
        return False
    if not looks_like_checkpoint(path):
        raise UnsafePath(f"refusing to remove {location!r}: not a checkpoint directory (no {MARKER}, "
                         f"{MANIFEST} or {DCP_METADATA} inside, or a symlink)")
    trash = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{TRASH_SUFFIX}")
    os.replace(path, trash)
    shutil.rmtree(trash)
    return True


def copy_dir_atomically(source: str, target: str) -> None:
    """Copy ``source`` to ``target`` so that ``target`` appears whole or not at all.

    Files go to a temporary sibling (fsynced), which is renamed to ``target``; a crash leaves only
    a ``.copying`` directory behind, never a partial ``target``. ``target`` must not exist.
    """
    destination = Path(target)
    destination.parent.mkdir(parents=True, exist_ok=True)
    temporary = destination.with_name(f"{destination.name}.{uuid.uuid4().hex[:8]}.copying")
    try:
        shutil.copytree(source, temporary, symlinks=False)
        for entry in temporary.iterdir():
            _fsync(entry)
        _fsync(temporary)
        os.rename(temporary, destination)  # fails if target appeared meanwhile: no silent overwrite
        _fsync(destination.parent)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
