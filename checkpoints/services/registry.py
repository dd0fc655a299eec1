"""The registry: record commits, walk the lineage tree, pin, unpin and delete.

The lineage is a tree of Checkpoint rows (``parent``). A branch is the path from a root to a
leaf; the *active* branch is the one recovery restores from (``active_branch``: everything until
a rollback starts a new branch at ``Job.branch_root``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import Case, Q, Value, When

from agents.protocol import hooks as hooks_protocol

# The module, not its tasks: checkpoints.tasks imports these services in turn, and its tasks are
# looked up when a commit is enqueued, by which time both modules are loaded.
from checkpoints import disk, paths, tasks
from checkpoints.choices import CheckpointState, ReplicaState
from checkpoints.models import Checkpoint
from core.events import EventKind, record_event
from core.models import Event

log = logging.getLogger(__name__)


class CheckpointError(Exception):
    """A checkpoint verb that contradicts the checkpoint's state; the API answers 409."""

    http_status = 409


class ProtectedCheckpoint(CheckpointError):
    def __init__(self, checkpoint: Checkpoint, reasons: list[str]):
        super().__init__(f"checkpoint {checkpoint.pk} (step {checkpoint.step}) is protected: {'; '.join(reasons)}")
        self.reasons = reasons


def checkpoint_event(kind: EventKind, checkpoint: Checkpoint, *, actor: str, reason: str, old_state: str = "",
                     new_state: str = "", **evidence) -> Event:
    """Record ``kind`` about one checkpoint: its row names the checkpoint and its step."""
    return record_event(kind, actor=actor, job=checkpoint.job_id, old_state=old_state, new_state=new_state,
                        reason=reason, evidence={"checkpoint": checkpoint.pk, "step": checkpoint.step, **evidence})


# --- commits ---------------------------------------------------------------------------------------

@transaction.atomic
def record_commit(job, commit: hooks_protocol.CheckpointCommit, *, generation, actor: str
                  ) -> tuple[Checkpoint, bool]:
    """Register a committed checkpoint of ``job`` written by ``generation`` (its row, or None when
    the job has no such generation); returns ``(checkpoint, created)``.

    The caller has fenced the generation (``jobs.checkpointing.commit_checkpoint``: the hooks'
    endpoint goes through it). The path must lie inside the job's checkpoint directory, itself
    inside ``CHECKPOINT_ROOT`` (``paths.OutsideRoot`` otherwise: the API answers 400), and be no
    other job's checkpoint. Idempotent on (job, location): a replay after an outage returns the
    existing row. The parent is the newest earlier checkpoint of the same generation, or for a
    generation's first checkpoint the one it resumed from — so a rollback naturally starts a new
    branch. The save cost the hooks measured is kept on the row: the interval policy reads it.
    """
    paths.confine(commit.path, [paths.job_checkpoint_root(job)], what="the checkpoint path")
    existing = Checkpoint.objects.filter(job=job, location=commit.path).first()
    if existing is not None:
        return existing, False
    if Checkpoint.objects.filter(location=commit.path).exists():
        raise CheckpointError(f"{commit.path} is another job's checkpoint")
    parent = (
        Checkpoint.objects.filter(job=job, generation=generation, step__lt=commit.step).order_by("-step").first()
        if generation is not None else None
    )
    if parent is None and generation is not None:
        parent = generation.resumed_from
    checkpoint = Checkpoint.objects.create(
        job=job, generation=generation, step=commit.step, location=commit.path, manifest=commit.manifest,
        parent=parent, config_hash=commit.config_hash, data_cursor=commit.data_cursor,
        loss=commit.loss if commit.loss == commit.loss and abs(commit.loss) != float("inf") else None,
        size_bytes=commit.size_bytes, world_size=commit.world_size,
        blocking_s=commit.blocking_s, total_s=commit.total_s,
    )
    record_event(EventKind.CHECKPOINT_COMMIT, actor=actor, job=job, generation=commit.generation,
                 reason=f"step {commit.step} committed at {commit.path}",
                 evidence={"checkpoint": checkpoint.pk, "step": commit.step, "blocking_s": commit.blocking_s,
                           "total_s": commit.total_s, "size_bytes": commit.size_bytes})
    transaction.on_commit(lambda: tasks.verify_checkpoint.delay(checkpoint.pk))
    return checkpoint, True


# --- lineage queries --------------------------------------------------------------------------------

def lineage(checkpoint: Checkpoint) -> list[Checkpoint]:
    """The path from ``checkpoint`` up to the root of its tree, newest first."""
    path, seen = [], set()
    node: Checkpoint | None = checkpoint
    while node is not None and node.pk not in seen:
        seen.add(node.pk)
        path.append(node)
        node = node.parent
    return path


def active_branch(job):
    """Checkpoints of the job's active lineage branch (all of them until a rollback starts one)."""
    checkpoints = Checkpoint.objects.filter(job=job)
    if job.branch_root_id is None:
        return checkpoints
    return checkpoints.filter(Q(pk=job.branch_root_id) | Q(generation__number__gte=job.branch_since_generation))


def latest_verified_checkpoint(job) -> Checkpoint | None:
    """The newest restorable checkpoint of the active branch, as the registry knows it now.

    No re-hashing here (``restore_point`` does that before a restore); this is what retention
    protects and what the dashboard shows as "recovery would start here".
    """
    return active_branch(job).restorable().order_by("-step", "-pk").first()


@dataclass
class TreeNode:
    checkpoint: Checkpoint
    on_active_branch: bool
    children: list[TreeNode] = field(default_factory=list)


@dataclass(frozen=True)
class Branch:
    """A root-to-leaf path of the tree; ``checkpoints`` are ids, root first."""

    leaf: int
    checkpoints: list[int]
    steps: list[int]
    generations: list[int]
    active: bool


@dataclass(frozen=True)
class Lineage:
    roots: list[TreeNode]
    branches: list[Branch]
    active_leaf: int | None
    latest_verified: int | None


def lineage_tree(job) -> Lineage:
    """The job's whole checkpoint tree (one query), its branches, and which path is active.

    The active path runs from the root to the latest verified checkpoint of the active branch
    (or, before anything is verified, to the newest checkpoint of it): the path recovery follows.
    """
    rows = list(Checkpoint.objects.filter(job=job).select_related("generation").order_by("step", "pk"))
    latest = latest_verified_checkpoint(job)
    leaf = latest or active_branch(job).order_by("-step", "-pk").first()
    by_id = {row.pk: row for row in rows}
    active_path: set[int] = set()
    node_id = leaf.pk if leaf else None
    while node_id is not None and node_id not in active_path:
        active_path.add(node_id)
        node_id = by_id[node_id].parent_id if node_id in by_id else None
    nodes = {row.pk: TreeNode(row, row.pk in active_path) for row in rows}
    roots: list[TreeNode] = []
    for row in rows:
        parent = nodes.get(row.parent_id)
        (parent.children if parent else roots).append(nodes[row.pk])
    branches = []
    for row in rows:
        if nodes[row.pk].children:
            continue
        path: list[Checkpoint] = []
        seen: set[int] = set()
        node: Checkpoint | None = row
        while node is not None and node.pk not in seen:
            seen.add(node.pk)
            path.append(node)
            node = by_id.get(node.parent_id)
        path.reverse()
        branches.append(Branch(
            leaf=row.pk, checkpoints=[p.pk for p in path], steps=[p.step for p in path],
            generations=sorted({p.generation.number for p in path if p.generation is not None}),
            active=leaf is not None and leaf.pk in seen,
        ))
    return Lineage(roots, branches, leaf.pk if leaf else None, latest.pk if latest else None)


# --- protection, pin, unpin, delete ----------------------------------------------------------------

_QUERY = object()


def protection_reasons(checkpoint: Checkpoint, *, latest=_QUERY, resumed_by: dict[int, list[int]] | None = None
                       ) -> list[str]:
    """Why ``checkpoint`` must not be deleted (empty: it may be). Shared by retention and the API.

    ``latest`` (a checkpoint or None) and ``resumed_by`` (checkpoint id -> live generation
    numbers) may be passed in when classifying many checkpoints at once; otherwise they are queried.
    """
    reasons = []
    if checkpoint.permanent:
        reasons.append("it is permanent (unpin it first)")
    if latest is _QUERY:
        latest = latest_verified_checkpoint(checkpoint.job)
    if latest is not None and latest.pk == checkpoint.pk:
        reasons.append("it is the latest verified checkpoint of the active branch (the next restore point)")
    if resumed_by is None:
        resumed_by = active_resumptions(checkpoint.job)
    for number in resumed_by.get(checkpoint.pk, []):
        reasons.append(f"active generation {number} resumed from it")
    return reasons


def active_resumptions(job) -> dict[int, list[int]]:
    """checkpoint id -> numbers of the job's live generations that resumed from it.

    A generation is live until it ends; a job in a terminal state has none. Its processes may
    reload the checkpoint at any moment (a torchrun restart inside the generation does).
    """
    if job.is_terminal:
        return {}
    found: dict[int, list[int]] = {}
    # Through the generations' ``resumed_from`` (reverse relation): one filter(), so both
    # conditions hold for the same generation.
    for checkpoint_id, number in Checkpoint.objects.filter(
        resumed_generations__job=job.pk, resumed_generations__ended_at__isnull=True
    ).order_by("resumed_generations__number").values_list("pk", "resumed_generations__number"):
        found.setdefault(checkpoint_id, []).append(number)
    return found


def pin(checkpoint: Checkpoint, *, actor: str, reason: str) -> Checkpoint:
    """Make a checkpoint permanent: retention will never delete it."""
    if not checkpoint.restorable and checkpoint.state != CheckpointState.COMMITTED:
        raise CheckpointError(f"checkpoint {checkpoint.pk} is {checkpoint.state} with no verified copy; "
                              "only a committed or verified checkpoint can be made permanent")
    if Checkpoint.objects.filter(pk=checkpoint.pk, permanent=False, state__in=CheckpointState.LIVE).update(
        permanent=True
    ):
        checkpoint_event(EventKind.CHECKPOINT_PIN, checkpoint, actor=actor, reason=reason or "made permanent")
    checkpoint.refresh_from_db()
    return checkpoint


def unpin(checkpoint: Checkpoint, *, actor: str, reason: str) -> Checkpoint:
    """Make a permanent checkpoint ordinary again; retention decides its fate from then on."""
    if Checkpoint.objects.filter(pk=checkpoint.pk, permanent=True).update(permanent=False):
        checkpoint_event(EventKind.CHECKPOINT_UNPIN, checkpoint, actor=actor, reason=reason or "no longer permanent")
    checkpoint.refresh_from_db()
    return checkpoint


def delete_checkpoint(checkpoint: Checkpoint, *, actor: str, reason: str, protections: list[str] | None = None
                      ) -> Checkpoint:
    """Delete a checkpoint: the row becomes ``deleted`` (kept for the lineage), the files go.

    1. Refuse a protected checkpoint, with every reason (``ProtectedCheckpoint``).
    2. Compare-and-set the row to ``deleted`` and record the event, in one transaction: if it
       was pinned or changed meanwhile, nothing happens.
    3. Then remove the primary and the replica directories. A failure there is recorded and
       retried by the retention sweep (``purge_deleted_files``); the registry is already right.
    """
    reasons = protection_reasons(checkpoint) if protections is None else protections
    if reasons:
        raise ProtectedCheckpoint(checkpoint, reasons)
    if checkpoint.state == CheckpointState.DELETED:
        return checkpoint
    with transaction.atomic():
        # The replica columns are decided by the row, not this instance: a copy may have
        # finished since the caller loaded it.
        won = Checkpoint.objects.filter(pk=checkpoint.pk, state=checkpoint.state, permanent=False).update(
            state=CheckpointState.DELETED, state_reason=reason,
            replica_state=Case(When(replica_location="", then=Value(ReplicaState.NONE)),
                               default=Value(ReplicaState.DELETED)),
        )
        if not won:
            raise CheckpointError(f"checkpoint {checkpoint.pk} changed while being deleted; look again")
        checkpoint_event(EventKind.CHECKPOINT_DELETE, checkpoint, actor=actor, reason=reason,
                         old_state=checkpoint.state, new_state=CheckpointState.DELETED, location=checkpoint.location,
                         replica_location=checkpoint.replica_location, size_bytes=checkpoint.size_bytes)
    checkpoint.refresh_from_db()
    remove_files(checkpoint, actor=actor)
    return checkpoint


def remove_files(checkpoint: Checkpoint, *, actor: str) -> bool:
    """Remove a deleted checkpoint's directories; True when nothing of it is left on disk.

    Each is removed only inside its root (the job's checkpoint directory, the replica roots),
    checked right before the removal; one outside is refused, logged and recorded, never touched.
    """
    clean = True
    for location, replica in ((checkpoint.location, False), (checkpoint.replica_location, True)):
        if not location:
            continue
        try:
            roots = paths.replica_roots() if replica else [paths.job_checkpoint_root(checkpoint.job)]
            disk.remove_checkpoint_dir(location, roots)
        except (OSError, disk.UnsafePath) as error:
            clean = False
            log.warning("could not remove %s of checkpoint %s: %s", location, checkpoint.pk, error)
            checkpoint_event(EventKind.CHECKPOINT_DELETE_FAILED, checkpoint, actor=actor, location=location,
                             reason=f"could not remove {location}: {error}")
    return clean
