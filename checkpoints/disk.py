"""Copying and removing checkpoint directories, carefully.

The control plane deletes and copies directories named by rows that came over the network. So:

- every path is confined to its roots (``checkpoints.paths.confine``) right before it is used;
- the directory is reached from the root one component at a time with ``O_NOFOLLOW``
  (``open_directory_beneath``), and the final rename and removal work on descriptors, so a
  symlink swapped in after the check changes nothing;
- removal refuses anything that does not look like a checkpoint directory, so a bad
  ``location`` can never turn into ``rm -rf`` of something else;
- a copy takes only the regular files the manifest lists (plus the manifest and the marker),
  never a symlink, device or anything else lying in the directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import uuid

from agents.hooks.manifest import (
    DCP_METADATA,
    MANIFEST,
    MARKER,
    Budget,
    CheckpointDir,
    UnsafePath,
    inside,
    open_directory_beneath,
)
from checkpoints.paths import confine

__all__ = ["SAVE_DIRNAME", "TRASH_SUFFIX", "UnsafePath", "copy_checkpoint", "free_space", "remove_checkpoint_dir",
           "remove_torn_dir"]

_CHECKPOINT_FILES = (MARKER, MANIFEST, DCP_METADATA)
MANIFEST_MAX_BYTES = Budget().max_manifest_bytes
TRASH_SUFFIX = ".deleting"


def remove_checkpoint_dir(location: str, roots: list[str]) -> bool:
    """Remove a checkpoint directory that lies inside one of ``roots``; False when it was already gone.

    1. Confine it (``UnsafePath`` when outside, or reached through a symlink): checked here, right
       before deleting, whatever was checked when the row was written.
    2. Open its parent without following symlinks; refuse a final symlink and a directory holding
       none of the commit-protocol files.
    3. Rename it to ``<name>.<id>.deleting`` (atomic): the hooks' directory scan and the verifier
       no longer see a half-removed checkpoint, even if we crash while removing; then remove that.
    """
    root = confine(location, roots, what="checkpoint directory to remove")
    *parents, name = inside(location, root).parts
    try:
        parent = open_directory_beneath(root, tuple(parents))
    except FileNotFoundError:
        return False
    try:
        try:
            status = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(status.st_mode) or not _holds_checkpoint_files(name, parent):
            raise UnsafePath(f"refusing to remove {location!r}: not a checkpoint directory (no {MARKER}, "
                             f"{MANIFEST} or {DCP_METADATA} inside, or a symlink)")
        trash = f"{name}.{uuid.uuid4().hex[:8]}{TRASH_SUFFIX}"
        os.rename(name, trash, src_dir_fd=parent, dst_dir_fd=parent)
        shutil.rmtree(trash, dir_fd=parent)
    finally:
        os.close(parent)
    return True


def _holds_checkpoint_files(name: str, parent: int) -> bool:
    descriptor = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    try:
        present = set(os.listdir(descriptor))
    finally:
        os.close(descriptor)
    return any(file in present for file in _CHECKPOINT_FILES)


def copy_checkpoint(source: str, source_root: str, target: str, target_root: str) -> None:
    """Copy the files ``source``'s manifest lists (and the manifest and marker) to ``target``, whole or not at all.

    Both lie inside their roots (``UnsafePath`` otherwise). Files go to a temporary sibling
    (fsynced), which is renamed to ``target``; a crash leaves only a ``.copying`` directory
    behind, never a partial ``target``. ``target`` must not exist.
    """
    confine(source, [source_root], what="checkpoint to copy")
    confine(target, [target_root], what="replica directory")
    *parents, name = inside(target, target_root).parts
    os.makedirs(target_root, exist_ok=True)  # the root is configuration, trusted; below it, nothing is
    _make_directories(target_root, parents)
    parent = open_directory_beneath(target_root, tuple(parents))
    temporary = f"{name}.{uuid.uuid4().hex[:8]}.copying"
    try:
        os.mkdir(temporary, 0o750, dir_fd=parent)
        try:
            with CheckpointDir(source, root=source_root) as origin:
                destination = open_directory_beneath(target_root, (*parents, temporary))
                try:
                    for file in dict.fromkeys([*_listed_files(origin), MANIFEST, MARKER]):
                        _copy_file(origin, file, destination)
                    os.fsync(destination)
                finally:
                    os.close(destination)
            os.rename(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)  # fails if target appeared meanwhile
            os.fsync(parent)
        except BaseException:
            shutil.rmtree(temporary, dir_fd=parent, ignore_errors=True)
            raise
    finally:
        os.close(parent)


def _listed_files(origin: CheckpointDir) -> list[str]:
    """The file names the manifest on disk lists (each is checked again when opened)."""
    try:
        files = json.loads(origin.read_small(MANIFEST, MANIFEST_MAX_BYTES))["files"]
        return [str(entry["name"]) for entry in files]
    except (ValueError, KeyError, TypeError) as error:
        raise UnsafePath(f"{MANIFEST} does not list the checkpoint's files: {error}") from error


def _copy_file(origin: CheckpointDir, name: str, destination: int) -> None:
    source, _ = origin.open_file(name)
    try:
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640, dir_fd=destination)
        with open(target, "wb") as handle:
            while chunk := os.read(source, 4 << 20):
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
    finally:
        os.close(source)


def _make_directories(root: str, parts: list[str]) -> None:
    """Create ``root/parts...`` as needed, each level reached without following a symlink."""
    for depth in range(len(parts)):
        parent = open_directory_beneath(root, tuple(parts[:depth]))
        try:
            os.mkdir(parts[depth], 0o750, dir_fd=parent)
        except FileExistsError:
            pass
        finally:
            os.close(parent)


#: A save directory's name as the hooks make it (``agents.hooks.manifest.checkpoint_dirname``), and
#: what ``remove_checkpoint_dir`` leaves behind when it is interrupted.
SAVE_DIRNAME = re.compile(r"step-(\d+)-g(\d+)-[0-9a-f]+")
TRASH_DIRNAME = re.compile(r"step-\d+-g\d+-[0-9a-f]+\.[0-9a-f]{8}" + re.escape(TRASH_SUFFIX))


def remove_torn_dir(location: str, roots: list[str]) -> int:
    """Remove a save directory that was never committed (a torn save); returns the bytes freed
    (0 when it was already gone).

    The same care as ``remove_checkpoint_dir``: confined to ``roots`` right before, reached without
    following a symlink, renamed away before it is removed. It must be named as the hooks name a
    save (or be an interrupted removal's ``.deleting`` directory), hold no commit marker and only
    regular files: anything else is refused (``UnsafePath``), never touched.
    """
    root = confine(location, roots, what="torn save directory to remove")
    *parents, name = inside(location, root).parts
    if not (SAVE_DIRNAME.fullmatch(name) or TRASH_DIRNAME.fullmatch(name)):
        raise UnsafePath(f"refusing to remove {location!r}: not named as a checkpoint save")
    try:
        parent = open_directory_beneath(root, tuple(parents))
    except FileNotFoundError:
        return 0
    try:
        try:
            directory = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
        except FileNotFoundError:
            return 0
        except (NotADirectoryError, OSError) as error:
            raise UnsafePath(f"refusing to remove {location!r}: not a directory ({error})") from error
        try:
            size = 0
            for entry in os.listdir(directory):
                status = os.stat(entry, dir_fd=directory, follow_symlinks=False)
                if entry == MARKER or not stat.S_ISREG(status.st_mode):
                    raise UnsafePath(f"refusing to remove {location!r}: it holds {entry!r} (committed, or not "
                                     "a save's file)")
                size += status.st_size
        finally:
            os.close(directory)
        trash = name if TRASH_DIRNAME.fullmatch(name) else f"{name}.{uuid.uuid4().hex[:8]}{TRASH_SUFFIX}"
        if trash != name:
            os.rename(name, trash, src_dir_fd=parent, dst_dir_fd=parent)
        shutil.rmtree(trash, dir_fd=parent)
    finally:
        os.close(parent)
    return size


def free_space(directory: str) -> tuple[int, int]:
    """(bytes free to an unprivileged writer, bytes in all) of the file system holding ``directory``."""
    status = os.statvfs(directory)
    return status.f_bavail * status.f_frsize, status.f_blocks * status.f_frsize
