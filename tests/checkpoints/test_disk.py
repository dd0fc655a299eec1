"""Removing and copying checkpoint directories: never anything that is not a checkpoint."""

from __future__ import annotations

import os

import pytest

from checkpoints import disk


def test_removal_refuses_what_is_not_a_checkpoint_directory(tmp_path):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(disk.UnsafePath, match="not a checkpoint directory"):
        disk.remove_checkpoint_dir(str(precious))
    with pytest.raises(disk.UnsafePath, match="not an absolute path"):
        disk.remove_checkpoint_dir("relative/step-1")
    link = tmp_path / "step-00000001-g1-abc"
    os.symlink(precious, link)
    with pytest.raises(disk.UnsafePath):
        disk.remove_checkpoint_dir(str(link))
    assert (precious / "notes.txt").read_text() == "keep me"
    assert disk.remove_checkpoint_dir(str(tmp_path / "gone")) is False


def test_removal_and_copy_of_a_real_checkpoint(example_runs, tmp_path):
    copy = tmp_path / "copy" / example_runs.path("A", 2).name
    disk.copy_dir_atomically(str(example_runs.path("A", 2)), str(copy))
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in example_runs.path("A", 2).iterdir())
    with pytest.raises(OSError):  # never over an existing copy
        disk.copy_dir_atomically(str(example_runs.path("A", 4)), str(copy))
    assert not list(copy.parent.glob("*.copying"))  # the failed attempt cleaned up after itself
    assert disk.remove_checkpoint_dir(str(copy)) is True
    assert list(copy.parent.iterdir()) == []
