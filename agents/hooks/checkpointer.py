"""Saving with torch.distributed.checkpoint, then committing: the first half of the commit protocol.

``save`` blocks training only while the state that the next forward pass could change is copied
to CPU staging buffers (async mode; the rest is copied until ``before_update``, see
``staging.py``), or while everything is written (sync mode). The rest happens in the background:

1. DCP's thread writes every rank's shards; its last step is a collective on the checkpoint
   group after which rank 0 writes DCP's ``.metadata``. So when rank 0's future resolves, every
   rank's shards are finished.
2. Only then does rank 0's commit thread hash the files and write the manifest and the commit
   marker (see ``manifest.py``), and report the commit.

At most one save is in flight: the next ``save`` first waits for the previous one to be committed,
and that wait counts as checkpoint time, because it is.

A failed save never ends training, whatever it raised: torch's ``CheckpointException`` (what DCP
raises on every rank when any rank's write failed: a full disk, a permission) is a
``BaseException``, so "catch Exception" is not enough. The failure is reported with its cause in
words (``describe_failure``: "no space left on device"), rank 0 removes the uncommitted directory
so that the partial shards do not keep the disk full, and the previous checkpoint stands.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from agents.hooks.manifest import MARKER, checkpoint_dirname, write_manifest
from agents.hooks.staging import TORN_PREFIX, OverlappedStager
from agents.hooks.topology import Topology

log = logging.getLogger("nightwatch.hooks")

# A plain ``python train.py`` (no process group) is a supported way to run; DCP would otherwise
# warn on every save and load, from its own thread where a local catch_warnings cannot reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


@dataclass(frozen=True)
class Commit:
    """A committed checkpoint, as reported to the control plane."""

    path: str
    step: int
    manifest: dict[str, Any]
    blocking_s: float
    total_s: float

    @property
    def size_bytes(self) -> int:
        return sum(entry["size"] for entry in self.manifest["files"])


@dataclass
class _InFlight:
    path: Path
    step: int
    started: float
    blocking_s: float
    written: Future[Any]
    committed: Future[Commit | None] | None = field(default=None)


class Checkpointer:
    """Saves training state with DCP into ``directory`` and commits each save (rank 0).

    ``on_commit`` and ``on_failure`` are called from the commit thread on rank 0 (and a failure
    from ``wait`` on the other ranks).
    """

    def __init__(self, directory: str | Path, topology: Topology, *, generation: int, run_id: str,
                 use_async: bool = True,
                 on_commit: Callable[[Commit], None] | None = None,
                 on_failure: Callable[[str, int, BaseException], None] | None = None):
        self.directory = Path(directory)
        self.topology = topology
        self.generation = generation
        self.run_id = run_id
        self._on_commit = on_commit
        self._on_failure = on_failure
        self._stager = OverlappedStager(topology.rank) if use_async else None
        self._commits = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nightwatch-commit")
        self._in_flight: _InFlight | None = None

    def save(self, step: int, state: dict[str, Any], manifest_fields: dict[str, Any],
             stable: frozenset[int] = frozenset()) -> float:
        """Start saving ``state`` as the checkpoint of ``step``; returns the seconds training was blocked.

        ``stable``: data_ptrs of tensors that change only in the optimizer step, which an async
        save copies in the background until ``before_update`` (see ``staging.py``).
        """
        started = time.perf_counter()
        self.wait()
        path = self.directory / checkpoint_dirname(step, self.generation, self.run_id)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            # Not ours to report alone: DCP creates the directory again inside its collective
            # planning, where a failure on any rank reaches every rank (one rank skipping the
            # save would leave the others waiting in DCP's collectives).
            pass
        try:
            written = self._start(path, state, stable)
        except BaseException as error:  # CheckpointException is a BaseException
            if not _survivable(error):
                raise
            self._failed(_InFlight(path, step, started, time.perf_counter() - started, _done()), error)
            return time.perf_counter() - started
        blocking = time.perf_counter() - started
        flight = _InFlight(path, step, started, blocking, written)
        if self.topology.rank == 0:
            flight.committed = self._commits.submit(self._commit, flight, manifest_fields)
        self._in_flight = flight
        return blocking

    def _start(self, path: Path, state: dict[str, Any], stable: frozenset[int]) -> Future[Any]:
        """Start DCP's save of ``state`` into ``path``; the future resolves once the files are written."""
        written: Future[Any]
        if self._stager:
            self._stager.prepare(path, stable)
            response = dcp.async_save(state, checkpoint_id=str(path), process_group=self.topology.checkpoint_group,
                                      async_checkpointer_type=AsyncCheckpointerType.THREAD,
                                      async_stager=self._stager)
            # A stager that copies in the background gets both futures back; the upload is the one
            # that says the files are written.
            written = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        else:
            dcp.save(state, checkpoint_id=str(path), process_group=self.topology.checkpoint_group)
            written = _done()
        return written

    def before_update(self) -> None:
        """Call right before the optimizer step: the background copy of a save must finish first."""
        if self._stager:
            self._stager.ready()

    def wait(self) -> Commit | None:
        """Block until the save in flight is written (and, on rank 0, committed); None if it failed."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return None
        if flight.committed is not None:  # rank 0: the commit thread reports its own failure
            return flight.committed.result()
        try:
            flight.written.result()
        except BaseException as error:  # CheckpointException is a BaseException
            if not _survivable(error):
                raise
            self._failed(flight, error)
        return None

    def close(self) -> None:
        self.wait()
        self._commits.shutdown(wait=True)
        if self._stager:
            self._stager.close()

    def _commit(self, flight: _InFlight, manifest_fields: dict[str, Any]) -> Commit | None:
        try:
            flight.written.result()  # every rank's shards and DCP's .metadata are on disk
            torn = sorted(p.name for p in flight.path.glob(f"{TORN_PREFIX}*"))
            if torn:
                raise RuntimeError(f"not committed: state changed while it was being staged ({', '.join(torn)})")
            manifest = write_manifest(flight.path, {**manifest_fields, "step": flight.step})
        except BaseException as error:  # CheckpointException is a BaseException
            if not _survivable(error):
                raise
            self._failed(flight, error)
            return None
        commit = Commit(str(flight.path), flight.step, manifest, flight.blocking_s,
                        time.perf_counter() - flight.started)
        if self._on_commit:
            try:
                self._on_commit(commit)
            except Exception:  # the checkpoint is committed whatever a listener does with the news
                log.exception("checkpoint commit listener failed")
        return commit

    def _failed(self, flight: _InFlight, error: BaseException) -> None:
        # A failed save must not end training: the previous checkpoint stands.
        if self.topology.rank == 0:
            # Every rank is done with the directory: DCP's failure is collective (its last step
            # gathers every rank's outcome), and a commit fails only after the files were written.
            _remove_uncommitted(flight.path)
        try:
            if self._on_failure:
                self._on_failure(str(flight.path), flight.step, error)
            else:
                log.error("checkpoint %s failed: %s", flight.path, describe_failure(error)[0])
        except Exception:
            log.exception("checkpoint failure listener failed")


def _survivable(error: BaseException) -> bool:
    """Whether a save's failure is the save's alone (training goes on) rather than a request to
    stop the process (Ctrl-C, ``sys.exit``), which must go on up."""
    return not isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit))


def _done() -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(None)
    return future


def _remove_uncommitted(path: Path) -> None:
    """Remove a failed save's directory (never one that holds the commit marker): its partial
    shards are what keeps a full disk full. Best effort; the control plane's retention removes
    what is left (a torn save directory)."""
    try:
        if path.is_dir() and not path.is_symlink() and not (path / MARKER).exists():
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


#: The causes an operator acts on, in words; anything else is named by its exception.
_ERRNO_WORDS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                errno.EROFS: "read-only file system", errno.EIO: "input/output error"}


def _causes(error: BaseException) -> list[tuple[BaseException, bool]]:
    """``error`` and what it wraps, outermost first, each with whether DCP wrapped it: its
    ``CheckpointException`` holds each rank's exception (``failures``: rank -> (exception,
    traceback)); any exception chains its cause and context."""
    seen: set[int] = set()
    pending: list[tuple[BaseException, bool]] = [(error, False)]
    found: list[tuple[BaseException, bool]] = []
    while pending:
        current, from_dcp = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        found.append((current, from_dcp))
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for _, wrapped in sorted(failures.items(), key=lambda item: str(item[0])):
                inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
                if isinstance(inner, BaseException):
                    pending.append((inner, True))
        pending.extend((linked, False) for linked in (current.__cause__, current.__context__) if linked is not None)
    return found


def describe_failure(error: BaseException) -> tuple[str, int | None]:
    """(the cause in words, its errno) of a failed save, e.g. ("no space left on device", 28).

    The first ``OSError`` with an errno among what ``error`` wraps (``_causes``) names the cause.
    Otherwise the innermost exception DCP wrapped (or ``error`` itself) does, by type and message.
    """
    causes = _causes(error)
    for current, _ in causes:
        if isinstance(current, OSError) and current.errno:
            return _ERRNO_WORDS.get(current.errno) or os.strerror(current.errno).lower(), current.errno
    innermost = next((c for c, from_dcp in reversed(causes) if from_dcp), error)
    text = str(innermost).strip().splitlines()
    return f"{type(innermost).__name__}: {text[0][:300] if text else ''}".rstrip(": "), None


#: What a collective says when the rank at its other end is gone: gloo's TCP transport (a peer's
#: socket closed or reset, "typically caused by a remote worker crashing") and NCCL's ("remote
#: process exited or there was a network error"). NCCL's and the store's own errors are typed.
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|remote (worker|process)", re.IGNORECASE)


def lost_peer(error: BaseException) -> bool:
    """Whether a save failed because another rank went away in the middle of its collectives
    (torch's ``DistError`` family, or gloo's transport saying so). That is not the storage's fault:
    the rank's exit, or the hang that follows, is the incident; the save's failure is its echo."""
    return any(isinstance(c, torch.distributed.DistError) or
               (isinstance(c, RuntimeError) and _PEER_LOST.search(str(c))) for c, _ in _causes(error))


def load_checkpoint(path: str | Path, target: dict[str, Any], topology: Topology) -> None:
    """Fill ``target`` in place from the checkpoint at ``path`` (a collective on every rank)."""
    dcp.load(target, checkpoint_id=str(path), process_group=topology.checkpoint_group)
