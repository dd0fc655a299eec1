"""The verifier on hostile checkpoint directories: what a training process (arbitrary code) can write.

Each test builds a real, committed checkpoint, then turns it into an attack with a manifest and
commit marker that are consistent (so only the checks under test can stop it): symlinks, device
files, names leaving the directory, paths outside the root, oversized claims, a stalled budget,
and a crafted DCP ``.metadata`` pickle that would run a command.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import stat
from pathlib import Path

import pytest

from agents.hooks.manifest import DCP_METADATA, MANIFEST, MARKER, Budget, DcpMetadataUnpickler, verify
from checkpoints.inspection import inspect_directory
from tests.checkpoints.conftest import build_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CONFIG = "c0ffee"


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return build_checkpoint(tmp_path / "root" / "job-1" / "step-00000010-g1-abc", step=10, data_cursor=40,
                            config_hash=CONFIG)


def reseal(directory: Path, mutate) -> None:
    """Rewrite the manifest through ``mutate`` and commit it with a matching marker, as a hostile writer would."""
    manifest = json.loads((directory / MANIFEST).read_text())
    mutate(manifest)
    raw = json.dumps(manifest).encode()
    (directory / MANIFEST).write_bytes(raw)
    (directory / MARKER).write_text(json.dumps({"manifest_sha256": hashlib.sha256(raw).hexdigest(), "step": 10}))


def listing(name: str, data: bytes) -> dict:
    return {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def check(path: Path, root: Path, budget: Budget | None = None):
    return inspect_directory(str(path), root=str(root), budget=budget or Budget(), config_hash=CONFIG, step=10,
                             data_cursor=40)


def test_an_intact_checkpoint_inside_its_root_passes(checkpoint, tmp_path):
    assert check(checkpoint, tmp_path / "root").ok


class _Payload:
    """Unpickling this runs ``touch <marker>``: what a crafted ``.metadata`` did to the control plane."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_metadata_pickle_is_refused_and_never_executed(checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    crafted = pickle.dumps(_Payload(marker))
    (checkpoint / DCP_METADATA).write_bytes(crafted)
    reseal(checkpoint, lambda m: m["files"].__setitem__(
        next(i for i, e in enumerate(m["files"]) if e["name"] == DCP_METADATA), listing(DCP_METADATA, crafted)))

    finding = check(checkpoint, tmp_path / "root")
    assert not finding.ok
    assert "DCP metadata unreadable" in finding.reason and "not a DCP metadata type" in finding.reason
    assert not marker.exists()
    # The unpickler on its own, too: the global is refused before anything is imported or called.
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        DcpMetadataUnpickler(io.BytesIO(crafted)).load()
    assert not marker.exists()


def test_the_restricted_unpickler_reads_real_dcp_metadata(checkpoint):
    verdict = verify(checkpoint, config_hash=CONFIG)
    assert verdict.ok and {"progress", "rng.rank0"} <= verdict.dcp_keys


@pytest.mark.parametrize(("name", "reason"), [
    ("../../../etc/shadow", "must be a plain file name"),
    ("/etc/shadow", "must be a plain file name"),
    ("sub/file", "must be a plain file name"),
    ("..", "must be a plain file name"),
])
def test_manifest_names_never_leave_the_directory(checkpoint, tmp_path, name, reason):
    reseal(checkpoint, lambda m: m["files"].append({"name": name, "size": 1, "sha256": "0" * 64}))
    finding = check(checkpoint, tmp_path / "root")
    assert not finding.ok and reason in finding.reason
    assert "bytes" not in finding.reason  # nothing about the named file was read, not even its size


def test_a_symlinked_file_is_refused(checkpoint, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:x:0:0")
    os.symlink(secret, checkpoint / "stolen")
    reseal(checkpoint, lambda m: m["files"].append(listing("stolen", secret.read_bytes())))
    finding = check(checkpoint, tmp_path / "root")
    assert not finding.ok and "stolen is a symlink" in finding.reason


def test_a_manifest_naming_dev_zero_fails_fast(checkpoint, tmp_path):
    reseal(checkpoint, lambda m: m["files"].append({"name": "/dev/zero", "size": 1 << 40, "sha256": "0" * 64}))
    finding = check(checkpoint, tmp_path / "root", Budget(timeout_s=5))
    assert not finding.ok and "'/dev/zero': must be a plain file name" in finding.reason


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device node needs root")
def test_a_device_file_in_the_directory_fails_fast_instead_of_hanging(checkpoint, tmp_path):
    os.mknod(checkpoint / "zero", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    reseal(checkpoint, lambda m: m["files"].append({"name": "zero", "size": 0, "sha256": "0" * 64}))
    finding = check(checkpoint, tmp_path / "root", Budget(timeout_s=5))
    assert not finding.ok and "zero is not a regular file" in finding.reason


def test_a_symlink_to_a_device_is_refused(checkpoint, tmp_path):
    os.symlink("/dev/zero", checkpoint / "zero")
    reseal(checkpoint, lambda m: m["files"].append({"name": "zero", "size": 0, "sha256": "0" * 64}))
    finding = check(checkpoint, tmp_path / "root", Budget(timeout_s=5))
    assert not finding.ok and "zero is a symlink" in finding.reason


def test_a_fifo_is_refused_without_blocking(checkpoint, tmp_path):
    os.mkfifo(checkpoint / "pipe")
    reseal(checkpoint, lambda m: m["files"].append({"name": "pipe", "size": 0, "sha256": hashlib.sha256().hexdigest()}))
    finding = check(checkpoint, tmp_path / "root")
    assert not finding.ok and "pipe is not a regular file" in finding.reason


def test_a_directory_outside_the_root_is_never_opened(checkpoint, tmp_path):
    finding = check(checkpoint, tmp_path / "elsewhere")
    assert not finding.ok and "is outside" in finding.reason
    finding = check(Path(f"{tmp_path}/root/../root/job-1/{checkpoint.name}"), tmp_path / "root")
    assert not finding.ok and "without '..'" in finding.reason


def test_a_symlinked_directory_component_is_refused(checkpoint, tmp_path):
    os.symlink(tmp_path / "root" / "job-1", tmp_path / "root" / "job-2")
    finding = check(tmp_path / "root" / "job-2" / checkpoint.name, tmp_path / "root")
    assert not finding.ok and "job-2 is a symlink" in finding.reason
    os.symlink(checkpoint, tmp_path / "root" / "job-1" / "step-00000011-g1-abc")
    finding = check(tmp_path / "root" / "job-1" / "step-00000011-g1-abc", tmp_path / "root")
    assert not finding.ok and "is a symlink" in finding.reason


def test_a_checkpoint_over_the_size_budget_is_not_hashed(checkpoint, tmp_path):
    reseal(checkpoint, lambda m: m["files"][0].__setitem__("size", 1 << 50))
    finding = check(checkpoint, tmp_path / "root", Budget(max_bytes=1 << 40))
    assert not finding.ok and "over the verification budget of 1099511627776 bytes" in finding.reason


def test_an_oversized_manifest_is_refused(checkpoint, tmp_path):
    finding = check(checkpoint, tmp_path / "root", Budget(max_manifest_bytes=16))
    assert not finding.ok and "manifest.json is" in finding.reason and "over the limit of 16 bytes" in finding.reason


def test_verification_stops_at_its_time_budget(checkpoint, tmp_path):
    finding = check(checkpoint, tmp_path / "root", Budget(timeout_s=0))
    assert not finding.ok and "did not finish within its budget of 0 s" in finding.reason


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda m: m["files"][0].__setitem__("size", -1), "size must be a non-negative integer"),
    (lambda m: m["files"][0].__setitem__("sha256", "x"), "sha256 must be 64 hexadecimal digits"),
    (lambda m: m.__setitem__("files", "all"), "files is not a list"),
    (lambda m: m.__setitem__("world_size", 10**12), "world size 1000000000000 is not an integer"),
    (lambda m: m.__setitem__("parts", 7), "parts is not a list of names"),
])
def test_malformed_manifest_fields_are_reasons_not_crashes(checkpoint, tmp_path, mutate, reason):
    reseal(checkpoint, mutate)
    finding = check(checkpoint, tmp_path / "root")
    assert not finding.ok and reason in finding.reason
