"""The job's own pre-flight on the node, before torchrun starts: can this launch run here at all?

The node's health (``agents.health``) says whether the *node* may take a job. These checks say
whether the *job* can start on it, and a failure is the job's, not the node's: the entrypoint
must exist in the code directory, and the checkpoint directory must take a write. A launch that
fails them is refused with the reason in words ("file not found: /code/train.py", "checkpoint
directory /ckpt/job-4 is not writable: permission denied"), so the control plane pauses the job
with that reason instead of restarting it into the same wall until the restart budget is spent.

Stdlib only: the agent imports no Django.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from agents.protocol.agent import JOB_CHECKS, HealthCheck, LaunchPayload, module_files

__all__ = ["JOB_CHECKS", "check_launch"]
#: What the probe writes into the checkpoint directory (and removes): enough to need a block.
PROBE_BYTES = 64 * 1024


def check_launch(payload: LaunchPayload, code_dir: Path) -> list[HealthCheck]:
    """The job's pre-flight checks for ``payload`` run from ``code_dir`` (failed ones first)."""
    checks = [_entrypoint(payload, code_dir)]
    if payload.ckpt_dir:
        checks.append(_checkpoint_dir(Path(payload.ckpt_dir)))
    return sorted(checks, key=lambda c: c.ok)


def _entrypoint(payload: LaunchPayload, code_dir: Path) -> HealthCheck:
    root = code_dir.resolve()
    if payload.module is not None:
        candidates = [[root / name for name in files] for files in module_files(payload.module)]
        if any(all(path.is_file() for path in files) for files in candidates):
            return HealthCheck(name="entrypoint", ok=True, detail=f"module {payload.module} found in {root}")
        expected = " or ".join(str(files[-1]) for files in candidates)
        return HealthCheck(name="entrypoint", ok=False, detail=_clip(f"file not found: {expected} (module "
                                                                     f"{payload.module})"))
    path = root / (payload.script or "")
    if path.is_file():
        return HealthCheck(name="entrypoint", ok=True, detail=f"{path} found")
    what = "not a regular file" if path.exists() else "file not found"
    return HealthCheck(name="entrypoint", ok=False, detail=_clip(f"{what}: {path}"))


def _checkpoint_dir(directory: Path) -> HealthCheck:
    """Create the directory if needed and write, fsync and remove a probe file in it."""
    probe = directory / f".nightwatch-preflight-{uuid.uuid4().hex[:8]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            written = os.write(descriptor, b"\0" * PROBE_BYTES)
            if written != PROBE_BYTES:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    except OSError as error:
        words = os.strerror(error.errno).lower() if error.errno else str(error)
        return HealthCheck(name="checkpoint_dir", ok=False,
                           detail=_clip(f"checkpoint directory {directory} is not writable: {words}"))
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return HealthCheck(name="checkpoint_dir", ok=True, detail=f"checkpoint directory {directory} is writable")


def _clip(text: str) -> str:
    return text if len(text) <= 500 else text[:499] + "…"
