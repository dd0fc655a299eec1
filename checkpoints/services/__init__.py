"""Verbs on checkpoints. The package's modules, by concern:

- ``registry``: record commits, lineage queries (path to root, active branch, the whole tree),
  pin / unpin / delete with their protections;
- ``verification``: verify a checkpoint (after commit, on demand, before restore) and choose the
  restore point, falling back to a replica;
- ``replicas``: copy verified checkpoints to a second location and verify the copies;
- ``retention``: the keep/delete plan per job and the sweep, storage used.

A job is passed in as the ``jobs.Job`` row and read by its fields (the checkpoints app sits below
``jobs`` and does not import it). What needs the job's own tables lives in ``jobs``: the hooks'
commit fenced by generation (``jobs.checkpointing``) and the Young/Daly interval
(``jobs.checkpoint_interval``).

Callers import from here (``from checkpoints.services import restore_point``).
"""

from checkpoints.services.registry import (
    Branch,
    CheckpointError,
    Lineage,
    ProtectedCheckpoint,
    TreeNode,
    active_branch,
    active_resumptions,
    delete_checkpoint,
    latest_verified_checkpoint,
    lineage,
    lineage_tree,
    pin,
    protection_reasons,
    record_commit,
    unpin,
)
from checkpoints.services.replicas import replica_location_for, replica_sweep, replicate, restore_from_replica
from checkpoints.services.retention import (
    RetentionDecision,
    RetentionPlan,
    StorageUsage,
    apply_retention,
    purge_deleted_files,
    retention_sweep,
    storage_used,
)
from checkpoints.services.verification import restore_point, verified_copy, verify

__all__ = [
    "Branch", "CheckpointError", "Lineage", "ProtectedCheckpoint", "RetentionDecision", "RetentionPlan",
    "StorageUsage", "TreeNode", "active_branch", "active_resumptions", "apply_retention", "delete_checkpoint",
    "latest_verified_checkpoint", "lineage", "lineage_tree", "pin", "protection_reasons", "purge_deleted_files",
    "record_commit", "replica_location_for", "replica_sweep", "replicate", "restore_from_replica", "restore_point",
    "retention_sweep", "storage_used", "unpin", "verified_copy", "verify",
]
