"""Removing and copying checkpoint directories: never anything that is not a checkpoint, never outside the roots."""

from __future__ import annotations

import os
import shutil

import pytest

from checkpoints import disk


def test_removal_refuses_what_is_not_a_checkpoint_directory(tmp_path):
    root = str(tmp_path)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(disk.UnsafePath, match="not a checkpoint directory"):
        disk.remove_checkpoint_dir(str(precious), [root])
    with pytest.raises(disk.UnsafePath, match="must be an absolute path"):
        disk.remove_checkpoint_dir("relative/step-1", [root])
    link = tmp_path / "step-00000001-g1-abc"
    os.symlink(precious, link)
    with pytest.raises(disk.UnsafePath):
        disk.remove_checkpoint_dir(str(link), [root])
    assert (precious / "notes.txt").read_text() == "keep me"
    assert disk.remove_checkpoint_dir(str(tmp_path / "gone"), [root]) is False


def test_removal_never_leaves_the_roots(tmp_path):
    """Outside the root, through `..`, or through a symlinked directory on the way down: refused."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    victim = outside / "step-00000001-g1-abc"
    victim.mkdir(parents=True)
    (victim / "COMMITTED").write_text("{}")  # looks like a checkpoint: only confinement saves it
    root.mkdir()
    os.symlink(outside, root / "job-1")
    for location, reason in [(str(victim), "is outside"),
                             (f"{root}/../outside/{victim.name}", "without '..'"),
                             (str(root / "job-1" / victim.name), "symlink")]:
        with pytest.raises(disk.UnsafePath, match=reason):
            disk.remove_checkpoint_dir(location, [str(root)])
    assert (victim / "COMMITTED").exists()


def test_removal_and_copy_of_a_real_checkpoint(example_runs, tmp_path):
    source = example_runs.path("A", 2)
    copy = tmp_path / "copy" / source.name
    disk.copy_checkpoint(str(source), str(example_runs.root), str(copy), str(tmp_path))
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in source.iterdir())
    with pytest.raises(OSError):  # never over an existing copy
        disk.copy_checkpoint(str(example_runs.path("A", 4)), str(example_runs.root), str(copy), str(tmp_path))
    assert not list(copy.parent.glob("*.copying"))  # the failed attempt cleaned up after itself
    assert disk.remove_checkpoint_dir(str(copy), [str(tmp_path)]) is True
    assert list(copy.parent.iterdir()) == []


def test_a_copy_takes_only_the_listed_regular_files(example_runs, tmp_path):
    """A symlink to a secret lying in the checkpoint directory is not copied: the manifest names what goes."""
    source = tmp_path / "src" / example_runs.path("A", 2).name
    shutil.copytree(example_runs.path("A", 2), source)
    secret = tmp_path / "secret"
    secret.write_text("root:x:0:0")
    os.symlink(secret, source / "stolen")
    copy = tmp_path / "replicas" / source.name
    disk.copy_checkpoint(str(source), str(tmp_path / "src"), str(copy), str(tmp_path / "replicas"))
    assert not (copy / "stolen").exists()
    with pytest.raises(disk.UnsafePath, match="is outside"):
        disk.copy_checkpoint(str(source), str(tmp_path / "src"), str(tmp_path / "elsewhere" / "x"),
                             str(tmp_path / "replicas"))
    assert not (tmp_path / "elsewhere").exists()
