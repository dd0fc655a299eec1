"""Where checkpoint files may be: every path the control plane reads, writes or deletes is confined here.

Paths come from training processes (a commit's ``path``) and from job specs (``replica_dir``):
hostile input. Two kinds of root, both from settings:

- a job's **checkpoint directory** (``checkpoint_dir``: the policy's ``dir``, else
  ``CHECKPOINT_ROOT/job-<id>``), which must itself lie inside ``NIGHTWATCH["CHECKPOINT_ROOT"]``;
  a commit's path and every primary copy must lie inside it;
- the **replica roots**: ``NIGHTWATCH["REPLICA_ROOTS"]`` plus ``CHECKPOINT_REPLICA_ROOT``;
  a replica is written, read and deleted only inside one of them.

``confine`` is lexical plus ``realpath``: absolute, no ``..``, inside the root, and no symlink on
the way down (``agents.hooks.manifest.CheckpointDir`` then opens it component by component with
``O_NOFOLLOW``, so a symlink swapped in after the check cannot redirect a read either).
"""

from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings

from agents.hooks.manifest import Budget, UnsafePath, inside
from checkpoints.policies import CheckpointPolicy


class OutsideRoot(UnsafePath):
    """A path outside its configured root, or reached through a symlink; nothing was touched."""


def checkpoint_root() -> str:
    return settings.NIGHTWATCH["CHECKPOINT_ROOT"]


def checkpoint_dir(job) -> str:
    """The directory the job's hooks write checkpoints into (the spec's ``dir`` or the default)."""
    configured = CheckpointPolicy.of(job).dir
    return configured or str(Path(checkpoint_root()) / f"job-{job.pk}")


def job_checkpoint_root(job) -> str:
    """The job's checkpoint directory, if it lies inside ``CHECKPOINT_ROOT``; else ``OutsideRoot``.

    Whatever the spec said: a directory outside the root confines nothing the control plane may touch.
    """
    directory = checkpoint_dir(job)
    confine_directory(directory, [checkpoint_root()], what=f"job {job.pk}'s checkpoint directory")
    return directory


def replica_roots() -> list[str]:
    configured = list(settings.NIGHTWATCH.get("REPLICA_ROOTS") or ())
    default = settings.NIGHTWATCH.get("CHECKPOINT_REPLICA_ROOT")
    return configured + ([default] if default else [])


def confine(path: str, roots: list[str], *, what: str) -> str:
    """The root of ``roots`` that holds ``path`` strictly inside it, with no symlink below the root
    (its real path lies there too); else ``OutsideRoot`` naming ``what`` and the roots."""
    if not isinstance(path, str) or not os.path.isabs(path) or ".." in Path(path).parts or "\0" in path:
        raise OutsideRoot(f"{what} {path!r} must be an absolute path without '..'")
    if not roots:
        raise OutsideRoot(f"{what} {path!r} is refused: no root is configured for it")
    for root in roots:
        try:
            relative = inside(path, root)
        except UnsafePath:
            continue
        real_root = os.path.realpath(root)
        expected = os.path.join(real_root, *relative.parts)
        if os.path.realpath(path) != expected:
            raise OutsideRoot(f"{what} {path!r} is reached through a symlink; refused")
        return root
    raise OutsideRoot(f"{what} {path!r} is outside {' and '.join(roots)}")


def confine_directory(path: str, roots: list[str], *, what: str) -> None:
    """Like ``confine``, but ``path`` may also be one of the roots itself (a directory to write into)."""
    if isinstance(path, str) and os.path.isabs(path) and ".." not in Path(path).parts and any(
        os.path.normpath(path) in (os.path.normpath(root), os.path.realpath(root)) for root in roots
    ):
        return
    confine(path, roots, what=what)


def verification_budget() -> Budget:
    """The control plane's limits on one verification (``NIGHTWATCH["CHECKPOINT_VERIFY_*"]``)."""
    nightwatch = settings.NIGHTWATCH
    return Budget(max_bytes=nightwatch["CHECKPOINT_VERIFY_MAX_BYTES"],
                  timeout_s=float(nightwatch["CHECKPOINT_VERIFY_TIMEOUT_S"]),
                  max_manifest_bytes=nightwatch["CHECKPOINT_MANIFEST_MAX_BYTES"])
