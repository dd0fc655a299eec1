"""A job's checkpoint policy, typed: what ``Job.checkpoint_policy`` holds.

The checkpoints app reads it (where the files go, how many to keep, how often to save), so it is
defined here, below ``jobs``; ``jobs.api.serializers`` takes its defaults from this class, and every
reader goes through ``CheckpointPolicy.of(job)``. The defaults are written here and nowhere else.

A stored policy may lack a field (a launch that sent none stores ``{}``; a row written before the
field existed), so ``of`` fills in the default for a missing or null field and ignores a field it no
longer knows (the same rule as ``jobs.policies.RecoveryPolicy``). Pure Python: no Django.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol


class _HasCheckpointPolicy(Protocol):
    checkpoint_policy: Mapping[str, Any] | None


@dataclass(frozen=True)
class CheckpointPolicy:
    #: Checkpoint directory; None: ``<checkpoint root>/job-<id>``.
    dir: str | None = None
    #: Second storage location for verified checkpoints; None: the replica root's default, if any.
    replica_dir: str | None = None
    #: auto: follow the Young/Daly recommendation pushed to the hooks.
    interval: Literal["fixed", "auto"] = "fixed"
    #: fixed: save every this many steps (pushed to the hooks, overriding the script's
    #: ``checkpoint_every``); None: the script's ``checkpoint_every``. Refused with ``auto``.
    interval_steps: int | None = None
    keep_last: int = 3
    #: 0 disables permanent checkpoints.
    permanent_every_hours: int = 12
    #: Disk pressure below this much free space (percent of the file system; at least room for two
    #: saves): retention deletes the oldest unprotected checkpoints first (``services.retention``).
    min_free_percent: int = 5
    #: Under disk pressure, permanent checkpoints that retention promoted itself may go too (never
    #: one an operator pinned).
    release_permanent_under_pressure: bool = True
    #: In-memory snapshots, copied to a partner rank, every this many steps (``agents.hooks.snapshot``):
    #: a relaunch after a crash resumes from the newest one of the job's lineage branch. 0: the
    #: script's own ``Hooks(snapshot_every=)`` (off unless it sets one).
    snapshot_every: int = 0

    @classmethod
    def of(cls, job: _HasCheckpointPolicy) -> CheckpointPolicy:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (job.checkpoint_policy or {}).items() if k in known and v is not None})
