"""In-memory snapshots replicated to a partner rank: the fast path to resume, beside disk checkpoints.

Every ``snapshot_every`` steps each rank keeps its whole training state (what a checkpoint holds:
model, optimizer, schedulers, grad scaler, progress, RNG, the loop and data pipeline state) as a
snapshot in node memory (``snapshot_store.py``), and a copy of it in the memory of its *partner*
rank, on another node where there is one (``Topology.snapshot_partner``). Disk checkpoints stay,
on their own interval, as the durable lineage; a snapshot is only ever restored when it is newer
than the disk checkpoint chosen and belongs to the same lineage (``choose_snapshot``).

Taking one (``Snapshotter.take``), as the checkpoints' overlapped staging does (``staging.py``):

1. on the training thread, tensors the next forward pass may change are copied to reused host
   buffers at once; parameters and optimizer state (which only the optimizer step changes) are
   copied by a background thread while the next batch is computed, and ``before_update`` waits
   for that copy right before the next optimizer step;
2. the background thread serialises the copy (``torch.save``, plain tensors and blobs), hashes
   it, writes the owner's copy (shard and manifest, no marker yet), sends it to the partner over a
   gloo group of its own, and receives its *source*'s snapshot in return, which it writes and
   commits as the copy it holds;
3. the ranks then tell each other (an ack) that the copy they hold is committed; only on its
   partner's ack does a rank write the marker of its own copy. So a snapshot counts only once
   both copies are complete, and a rank killed in the middle of the copy leaves a snapshot that
   is never restored.

A lost node's ranks restart on a spare, and the ranks are numbered anew (the survivors first): a
node therefore looks for a rank's snapshot under both copies it may hold (``node_holds``), and
keeps only the places its ranks now write once they chose (``node_places``).

Every rank takes a snapshot at the same steps and the exchange is lockstep, so a snapshot starts
only when the previous one is finished (waiting, if it is not, counts as blocking time).

Memory per rank: ``KEEP`` (2) snapshots x 2 copies (its own, its source's) in the tmpfs, plus one
staging copy in the process and, during an exchange, the serialised snapshot sent and the one
received: about 7 x the state size at the peak, 4 x at rest (``memory_budget``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agents.hooks.snapshot_store import COPY, OWN, Refused, SnapshotKey, SnapshotStore, Verified, read_verified
from agents.hooks.staging import Pairs, copy_pairs, mirror
from agents.hooks.topology import Topology

log = logging.getLogger("nightwatch.hooks")

#: gloo tags of the snapshot group's messages, one per kind, so no message is taken for another.
_HEADER, _SHARD, _MANIFEST, _ACK, _FETCH_HEADER, _FETCH = range(1, 7)
#: How long ``close`` waits for the snapshot in flight (its partner may be gone) before leaving it.
_CLOSE_WAIT_S = 60.0


@dataclass(frozen=True)
class SnapshotCommit:
    """A snapshot committed on both copies: what the hooks log and report."""

    path: str
    step: int
    size_bytes: int
    blocking_s: float  # the training thread's stall in ``take`` (the wait in ``before_update`` apart)
    total_s: float  # from ``take`` to the commit


@dataclass
class _Pending:
    key: SnapshotKey
    staged: Any
    later: Pairs
    versions: list[int]
    fields: dict[str, Any]
    started: float
    blocking_s: float = 0.0


class Snapshotter:
    """Takes this rank's snapshots and holds its source rank's copies (see the module docstring).

    ``identity``: the manifest fields every snapshot of this run carries (job, config hash,
    world size); ``on_commit`` is called from the background thread.
    """

    def __init__(self, store: SnapshotStore, topology: Topology, group: Any, *, generation: int, run_id: str,
                 on_commit: Callable[[SnapshotCommit], None] | None = None):
        self.store, self.topology, self.group = store, topology, group
        self.generation, self.run_id = generation, run_id
        self.partner, self.source = topology.snapshot_partner, topology.snapshot_source
        self.overlap = True
        self.broken: str | None = None  # why snapshots stopped (the exchange with the partner failed)
        self.blocking: list[float] = []  # per snapshot, for the benchmark
        self._on_commit = on_commit
        self._buffers: Any = None
        self._copied = threading.Event()
        self._idle = threading.Event()
        self._copied.set()
        self._idle.set()
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="nightwatch-snapshot", daemon=True)
        self._worker.start()

    # -- the training thread -------------------------------------------------------------------

    def take(self, step: int, state: dict[str, Any], fields: dict[str, Any],
             stable: frozenset[int] = frozenset()) -> float:
        """Start the snapshot of ``step``; returns the seconds the training thread was blocked.

        ``state`` is ``state.collect_state``'s dict; ``stable``: data_ptrs copied in the background.
        """
        started = time.perf_counter()
        self._idle.wait()  # buffers are reused, and the exchange with the partner is one at a time
        if self.broken:
            return time.perf_counter() - started
        now: Pairs = []
        later: Pairs = []
        self._buffers, staged = mirror(state, self._buffers, stable if self.overlap else frozenset(), now, later)
        copy_pairs(now)
        pending = _Pending(SnapshotKey(step, self.generation, self.run_id), staged, later,
                           [src._version for src, _ in later], fields, started)
        self._copied.clear()
        self._idle.clear()
        pending.blocking_s = time.perf_counter() - started
        self.blocking.append(pending.blocking_s)
        self._queue.put(pending)
        return pending.blocking_s

    def before_update(self) -> None:
        """Right before the optimizer step: the background copy of the tensors must be done."""
        self._copied.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the snapshot in flight is committed (or failed); False on timeout."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        if not self.wait(_CLOSE_WAIT_S):
            log.warning("a snapshot was still being copied to rank %d after %.0f s; leaving it uncommitted",
                        self.partner, _CLOSE_WAIT_S)
            return
        self._queue.put(None)
        self._worker.join(timeout=5.0)
        self._buffers = None

    def discard(self) -> None:
        """Remove this rank's snapshots and the copies it holds for its source (after ``close``)."""
        self.store.keep_only(self.topology.rank, OWN, None)
        self.store.keep_only(self.source, COPY, None)
        self.store.remove_empty()

    # -- the background thread -----------------------------------------------------------------

    def _work(self) -> None:
        while (pending := self._queue.get()) is not None:
            try:
                self._finish(pending)
            except Exception as error:  # noqa: BLE001 - a snapshot never ends training
                # The exchange is lockstep: after a failed one the partner's stream is unknown.
                self.broken = f"{type(error).__name__}: {error}"
                log.error("snapshots stopped at step %d: %s (disk checkpoints go on)", pending.key.step, self.broken)
            finally:
                self._copied.set()
                self._idle.set()

    def _finish(self, pending: _Pending) -> None:
        copy_pairs(pending.later)
        self._copied.set()
        torn = any(src._version != version for (src, _), version in zip(pending.later, pending.versions, strict=True))
        if torn:
            log.error("a parameter or optimizer tensor was modified in place while it was being snapshotted "
                      "(outside nw.step?): snapshot %d is dropped, later ones are copied up front", pending.key.step)
            self.overlap = False
        buffer = io.BytesIO()
        if not torn:
            torch.save(pending.staged, buffer)
        shard = buffer.getbuffer()
        manifest = {**pending.fields, "step": pending.key.step, "generation": self.generation,
                    "run_id": self.run_id, "owner": self.topology.rank, "size": len(shard),
                    "sha256": hashlib.sha256(shard).hexdigest()}
        own = None if torn else self.store.start(self.topology.rank, OWN, pending.key, shard, manifest)
        both = self._replicate(pending.key, shard, manifest, torn) if self.partner != self.topology.rank else True
        del shard
        if own is None or not both:
            return
        self.store.commit(own)
        if self._on_commit:
            self._on_commit(SnapshotCommit(str(own), pending.key.step, manifest["size"], pending.blocking_s,
                                           time.perf_counter() - pending.started))

    def _replicate(self, key: SnapshotKey, shard: memoryview, manifest: dict[str, Any], torn: bool) -> bool:
        """Send this snapshot to the partner, receive and commit the source's; True once the
        partner says our copy is committed on its side."""
        sent_manifest = json.dumps(manifest).encode()
        header = torch.tensor([key.step, 0 if torn else len(shard), len(sent_manifest)], dtype=torch.int64)
        theirs = torch.empty(3, dtype=torch.int64)
        self._both(header, theirs, _HEADER)
        size, manifest_size = int(theirs[1]), int(theirs[2])
        received = torch.empty(size, dtype=torch.uint8)
        received_manifest = torch.empty(manifest_size, dtype=torch.uint8)
        outgoing = [] if torn else [(torch.frombuffer(shard, dtype=torch.uint8), _SHARD)]
        outgoing.append((torch.frombuffer(bytearray(sent_manifest), dtype=torch.uint8), _MANIFEST))
        incoming = ([(received, _SHARD)] if size else []) + [(received_manifest, _MANIFEST)]
        self._exchange(outgoing, incoming)
        committed = size > 0 and self._hold(int(theirs[0]), received, bytes(received_manifest.numpy()))
        ack = torch.tensor([key.step, int(committed)], dtype=torch.int64)
        partner_ack = torch.empty(2, dtype=torch.int64)
        self._both(ack, partner_ack, _ACK, to=self.source, source=self.partner)
        return not torn and int(partner_ack[0]) == key.step and bool(partner_ack[1])

    def _hold(self, step: int, payload: torch.Tensor, manifest_json: bytes) -> bool:
        """Write and commit the source's snapshot as received, if it is whole; True when committed."""
        try:
            manifest = json.loads(manifest_json)
            data = payload.numpy().data
            whole = (manifest["step"] == step and manifest["owner"] == self.source and manifest["size"] == len(data)
                     and hashlib.sha256(data).hexdigest() == manifest["sha256"])
            key = SnapshotKey(step, int(manifest["generation"]), str(manifest["run_id"]))
        except (ValueError, KeyError, TypeError) as error:
            log.error("the snapshot received from rank %d is unreadable: %s", self.source, error)
            return False
        if not whole:
            log.error("the snapshot of step %d received from rank %d does not match its manifest: not kept",
                      step, self.source)
            return False
        manifest.pop("format", None)
        path = self.store.start(self.source, COPY, key, data, manifest)
        self.store.commit(path)
        return True

    def _both(self, mine: torch.Tensor, theirs: torch.Tensor, tag: int, *, to: int | None = None,
              source: int | None = None) -> None:
        self._exchange([(mine, tag)], [(theirs, tag)], to=to, source=source)

    def _exchange(self, outgoing: list[tuple[torch.Tensor, int]], incoming: list[tuple[torch.Tensor, int]], *,
                  to: int | None = None, source: int | None = None) -> None:
        """Send to the partner and receive from the source at once (a ring: both are in flight)."""
        to = self.partner if to is None else to
        source = self.source if source is None else source
        works = [dist.isend(t, to, group=self.group, tag=tag) for t, tag in outgoing]
        works += [dist.irecv(t, source, group=self.group, tag=tag) for t, tag in incoming]
        _wait(works)


# -- resume ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lineage:
    """Which snapshots this run may restore.

    A snapshot must be of this job, config and world size (it is per rank: no resharding), newer
    than the disk checkpoint chosen (``after_step``), and written by a generation in
    ``[min_generation, generation]``: the control plane's rollback starts a new lineage branch, and
    a snapshot of a generation before the branch belongs to the history the rollback left, however
    new it is. Unless told where the branch starts (``NIGHTWATCH_BRANCH_GENERATION``), the hooks
    take only snapshots of their own generation (torchrun restarts within it).
    """

    job: str
    config_hash: str
    world_size: int
    generation: int
    min_generation: int
    after_step: int

    def problem(self, manifest: dict[str, Any], owner: int) -> str | None:
        if manifest["owner"] != owner:
            return f"it belongs to rank {manifest['owner']}"
        if manifest["job"] != self.job or manifest["config_hash"] != self.config_hash:
            return (f"it is of job {manifest['job']} with config {manifest['config_hash']}, this run is "
                    f"{self.job} with {self.config_hash}")
        if manifest["world_size"] != self.world_size:
            return f"it was taken by {manifest['world_size']} ranks, this run has {self.world_size}"
        if not self.min_generation <= manifest["generation"] <= self.generation:
            return (f"generation {manifest['generation']} is outside this lineage branch "
                    f"({self.min_generation}-{self.generation}): fenced off")
        if manifest["step"] <= self.after_step:
            return f"step {manifest['step']} is not newer than the disk checkpoint's {self.after_step}"
        return None


@dataclass(frozen=True)
class Choice:
    """The snapshot this rank restores (its bytes verified), and every snapshot passed over."""

    snapshot: Verified | None
    key: SnapshotKey | None
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    from_partner: bool = False


def choose_snapshot(store: SnapshotStore, topology: Topology, group: Any, lineage: Lineage) -> Choice:
    """Agree with every rank on the newest snapshot all of them can restore, and read this rank's.

    1. Each rank lists the committed snapshots of its own rank and of its source rank that this
       node's memory holds and that fit the lineage, as either copy (``node_holds``: when a node
       was lost, the ranks are numbered anew, and the node that held rank 1's own copy and rank 0's
       partner copy may now run rank 0), and the snapshots whose owner's copy on this node is
       uncommitted (torn); the lists are gathered on every rank.
    2. Candidates, newest first: a snapshot (step, generation, run) that every rank's node holds
       committed, or whose copy its partner's node holds, unless the owner's own copy is torn
       somewhere: the owner was stopped in the middle of that snapshot, and it is never restored,
       whatever the partner holds. An owner's marker proves that both copies were complete; a
       partner's copy marker, that the owner had written its own (``snapshot_store``). For the
       newest, each rank reads and hashes what it has; the verdicts are gathered. If every rank
       has a verified copy (on its node, or its partner's), that snapshot is taken: a rank without
       one receives the partner's over the snapshot group. Otherwise the next candidate, and at
       last none (the disk checkpoint stands).

    A collective on every rank; every rank decides from the same gathered data.
    """
    rank, world = topology.rank, topology.world_size
    rejected: list[tuple[str, str]] = []
    own = node_holds(store, rank, lineage, rejected)
    held = node_holds(store, topology.snapshot_source, lineage, rejected) if world > 1 else {}
    torn = sorted({(owner, key) for owner in store.owners() for key in store.uncommitted(owner, OWN)},
                  key=lambda pair: (pair[0], _order(pair[1])))
    for owner, key in torn:
        if owner == rank:
            log.info("not restoring snapshot %s: this rank stopped before it was committed on both copies",
                     key.dirname)
    rows = _gather((sorted(own, key=_order), sorted(held, key=_order), torn), topology)
    torn_anywhere = {pair for row in rows for pair in row[2]}
    partner_of = [(r + topology.snapshot_shift) % world for r in range(world)]

    def whole(key: SnapshotKey, r: int) -> bool:
        return (r, key) not in torn_anywhere and (key in rows[r][0] or key in rows[partner_of[r]][1])

    common = [key for key in {k for row in rows for k in row[0]} | {k for row in rows for k in row[1]}
              if all(whole(key, r) for r in range(world))]
    for key in sorted(common, key=_order, reverse=True):
        mine = _read(own.get(key), rejected)
        copy = _read(held.get(key), rejected)
        verdicts = _gather((mine is not None, copy is not None), topology)
        if not all(verdicts[r][0] or verdicts[partner_of[r]][1] for r in range(world)):
            log.info("snapshot %s is not whole on every rank (own or partner copy): trying an older one",
                     key.dirname)
            continue
        send = world > 1 and not verdicts[topology.snapshot_source][0]
        receive = not verdicts[rank][0]
        mine = _transfer(copy if send else None, mine, receive, topology, group)
        return Choice(mine, key, rejected, from_partner=receive)
    return Choice(None, None, rejected)


def node_holds(store: SnapshotStore, owner: int, lineage: Lineage,
               rejected: list[tuple[str, str]]) -> dict[SnapshotKey, Path]:
    """The committed snapshots of rank ``owner`` in this node's memory that fit the lineage: its
    own copies, and the partner copies the node holds (those where the own copy is missing)."""
    return {**_eligible(store, owner, COPY, lineage, rejected), **_eligible(store, owner, OWN, lineage, rejected)}


def node_places(topology: Topology) -> set[tuple[int, str]]:
    """Where this node's ranks keep snapshots now: each rank's own copies and the copies it holds
    for its source. The ranks of a node are consecutive (torchrun numbers them node by node)."""
    first = topology.rank - topology.local_rank
    places = set()
    for rank in range(first, first + topology.local_world_size):
        places.add((rank, OWN))
        if topology.world_size > 1:
            places.add(((rank - topology.snapshot_shift) % topology.world_size, COPY))
    return places


def _order(key: SnapshotKey) -> tuple[int, int, str]:
    return key.step, key.generation, key.run_id


def _eligible(store: SnapshotStore, owner: int, kind: str, lineage: Lineage,
              rejected: list[tuple[str, str]]) -> dict[SnapshotKey, Path]:
    found = {}
    for snapshot in store.committed(store.place(owner, kind)):
        problem = lineage.problem(snapshot.manifest, owner)
        if problem is None:
            found[snapshot.key] = snapshot.path
        elif snapshot.manifest["step"] > lineage.after_step:  # an older one is no news: not worth a line
            log.info("not restoring snapshot %s: %s", snapshot.path, problem)
            rejected.append((str(snapshot.path), problem))
    return found


def _read(path: Path | None, rejected: list[tuple[str, str]]) -> Verified | None:
    if path is None:
        return None
    try:
        return read_verified(path)
    except (Refused, OSError) as error:
        log.warning("not restoring snapshot %s: %s", path, error)
        rejected.append((str(path), str(error)))
        return None


def _transfer(send: Verified | None, mine: Verified | None, receive: bool, topology: Topology,
              group: Any) -> Verified | None:
    """The partner's copy to the rank whose own copy failed (sent and received at once)."""
    works = []
    if send is not None:
        payload = json.dumps(send.manifest).encode() + b"\n" + send.data
        works.append(dist.isend(torch.tensor([len(payload)], dtype=torch.int64), topology.snapshot_source,
                                group=group, tag=_FETCH_HEADER))
        works.append(dist.isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8), topology.snapshot_source,
                                group=group, tag=_FETCH))
    if receive:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, topology.snapshot_partner, group=group, tag=_FETCH_HEADER)
        received = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(received, topology.snapshot_partner, group=group, tag=_FETCH)
        head, _, data = bytes(received.numpy()).partition(b"\n")
        manifest = json.loads(head)
        if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
            # Every rank agreed on this snapshot already: there is no going back quietly. The
            # process fails, and the restart chooses again (this copy is not on disk, so the same
            # fault cannot repeat without a fault on the partner's side, which it re-verifies).
            raise RuntimeError(f"the snapshot copy received from rank {topology.snapshot_partner} does not "
                               f"match its sha256 (damaged in transit)")
        mine = Verified(Path(f"rank{topology.snapshot_partner}:{manifest['step']}"), manifest, data)
    _wait(works)
    return mine


def _wait(works: list[Any]) -> None:
    for work in works:
        if work is not None:  # None: this rank is not in the group (never the case here)
            work.wait()


def _gather(value: Any, topology: Topology) -> list[Any]:
    if not topology.distributed:
        return [value]
    rows: list[Any] = [None] * topology.world_size
    dist.all_gather_object(rows, value, group=topology.sync_group)
    return rows


def load(snapshot: Verified) -> dict[str, Any]:
    """The snapshot's state dict; only plain tensors, numbers, strings and blobs are unpickled, and
    only from bytes that matched their committed sha256 (the blobs inside are read like a disk
    checkpoint's, by ``state.apply_state``)."""
    loaded = torch.load(io.BytesIO(snapshot.data), weights_only=True)
    if not isinstance(loaded, dict) or "progress" not in loaded:
        raise Refused("the snapshot holds no training state")
    return loaded


def memory_budget(state_bytes: int) -> dict[str, int]:
    """Host memory a rank's snapshots take, for ``state_bytes`` of training state."""
    return {"tmpfs_at_rest": 2 * 2 * state_bytes, "staging": state_bytes, "exchange_peak": 2 * state_bytes,
            "total_peak": 7 * state_bytes}
