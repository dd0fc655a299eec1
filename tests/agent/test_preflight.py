"""agents.preflight: the job's own checks on the node before torchrun starts (issue 24, items 3
and 7): a missing entrypoint is "file not found" with the path, a checkpoint directory that takes no
write is found with the reason. Real file systems; the read-only and full ones are small tmpfs
mounts (root, as CI runs; skipped elsewhere, a failure under CI=1)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from agents.preflight import PROBE_BYTES, check_launch
from agents.protocol.agent import LaunchPayload


def payload(**overrides) -> LaunchPayload:
    values = {"nnodes": 1, "nproc_per_node": 2, "node_rank": 0, "rdzv_endpoint": "127.0.0.1:29500",
              "rdzv_id": "nw-1-g1", "script": "train.py"}
    return LaunchPayload(**{**values, **overrides})


def failed(checks):
    return {c.name: c.detail for c in checks if not c.ok}


def test_a_missing_entrypoint_is_file_not_found_with_its_path(tmp_path):
    assert failed(check_launch(payload(script="examples/trian.py"), tmp_path)) == {
        "entrypoint": f"file not found: {tmp_path.resolve()}/examples/trian.py"}
    (tmp_path / "train.py").write_text("print('hi')\n")
    checks = check_launch(payload(), tmp_path)
    assert not failed(checks) and [c.name for c in checks] == ["entrypoint"]


def test_a_module_needs_its_files(tmp_path):
    assert "file not found" in failed(check_launch(payload(script=None, module="pkg.train"), tmp_path))["entrypoint"]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("")
    assert not failed(check_launch(payload(script=None, module="pkg.train"), tmp_path))


def test_the_checkpoint_directory_is_created_and_left_clean(tmp_path):
    (tmp_path / "train.py").write_text("")
    ckpt = tmp_path / "ckpt" / "job-4"
    assert not failed(check_launch(payload(ckpt_dir=str(ckpt)), tmp_path))
    assert ckpt.is_dir() and list(ckpt.iterdir()) == []  # the probe is gone


def test_a_checkpoint_directory_that_cannot_exist_is_refused_with_the_reason(tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "a-file").write_text("in the way")
    reasons = failed(check_launch(payload(ckpt_dir=str(tmp_path / "a-file" / "ckpt")), tmp_path))
    assert reasons == {
        "checkpoint_dir": f"checkpoint directory {tmp_path}/a-file/ckpt is not writable: not a directory"}


@pytest.fixture
def mount(tmp_path):
    """mount(options) -> a fresh tmpfs with those options, unmounted at the end."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the pre-flight storage tests mount a tmpfs and need root (CI runs as root)")
        pytest.skip("mounting a tmpfs needs root")
    mounted = []

    def make(options: str) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "nightwatch-preflight", str(where)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.fail(f"cannot mount a tmpfs: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "--lazy", str(where)], check=False, capture_output=True)


def test_a_read_only_or_full_checkpoint_file_system_is_refused(tmp_path, mount):
    (tmp_path / "train.py").write_text("")
    read_only = mount("size=1m,ro")
    assert failed(check_launch(payload(ckpt_dir=str(read_only)), tmp_path)) == {
        "checkpoint_dir": f"checkpoint directory {read_only} is not writable: read-only file system"}
    full = mount("size=256k")
    filler = os.open(full / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(filler, b"\0" * 4096):
            pass
    except OSError:
        pass  # full
    finally:
        os.close(filler)
    assert os.statvfs(full).f_bavail * os.statvfs(full).f_frsize < PROBE_BYTES
    reasons = failed(check_launch(payload(ckpt_dir=str(full / "job-1")), tmp_path))
    assert reasons["checkpoint_dir"].endswith("is not writable: no space left on device"), reasons
