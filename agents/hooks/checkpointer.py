"""Saving with torch.distributed.checkpoint, then committing: the first half of the commit protocol.

``save`` blocks training only while the state is copied to CPU staging buffers (async mode) or
written (sync mode). The rest happens in the background:

1. DCP's thread writes every rank's shards; its last step is a collective on the checkpoint
   group after which rank 0 writes DCP's ``.metadata``. So when rank 0's future resolves, every
   rank's shards are finished.
2. Only then does rank 0's commit thread hash the files and write the manifest and the commit
   marker (see ``manifest.py``), and report the commit.

At most one save is in flight: the next ``save`` first waits for the previous one to be committed,
and that wait counts as checkpoint time, because it is.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from agents.hooks.manifest import checkpoint_dirname, write_manifest
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


class ReusedBufferStager(AsyncStager):
    """Stages into CPU buffers kept from the previous save instead of fresh ones.

    Allocating (and page-faulting) a fresh copy of the whole state on every save was most of
    the time an async save blocked for; copying into warm buffers is a plain memcpy. Safe because
    at most one save is in flight, so the buffers are free again when the next save starts.
    Costs one resident copy of the state in host memory.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
        if self._buffers is not None:
            try:
                return _copy_state_dict(state_dict, self._buffers)
            except (ValueError, AssertionError, RuntimeError):
                log.debug("checkpoint state changed shape; allocating new staging buffers")
        self._buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self._buffers)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` copies synchronously."""

    def close(self) -> None:
        self._buffers = None


class Checkpointer:
    def __init__(self, directory: str | Path, topology: Topology, *, generation: int, token: str,
                 use_async: bool = True,
                 on_commit: Callable[[Commit], None] | None = None,
                 on_failure: Callable[[str, int, BaseException], None] | None = None):
        self.directory = Path(directory)
        self.topology = topology
        self.generation = generation
        self.token = token
        self.use_async = use_async
        self._on_commit = on_commit
        self._on_failure = on_failure
        self._stager = ReusedBufferStager() if use_async else None
        self._commits = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nightwatch-commit")
        self._in_flight: _InFlight | None = None
        self.last_commit: Commit | None = None

    def save(self, step: int, state: dict[str, Any], manifest_fields: dict[str, Any]) -> float:
        """Start saving ``state`` as the checkpoint of ``step``; returns the seconds training was blocked."""
        started = time.perf_counter()
        self.wait()
        path = self.directory / checkpoint_dirname(step, self.generation, self.token)
        path.mkdir(parents=True, exist_ok=True)
        written: Future[Any]
        if self.use_async:
            written = dcp.async_save(state, checkpoint_id=str(path), process_group=self.topology.checkpoint_group,
                                     async_checkpointer_type=AsyncCheckpointerType.THREAD,
                                     async_stager=self._stager)  # type: ignore[assignment]
        else:
            dcp.save(state, checkpoint_id=str(path), process_group=self.topology.checkpoint_group)
            written = Future()
            written.set_result(None)
        blocking = time.perf_counter() - started
        flight = _InFlight(path, step, started, blocking, written)
        if self.topology.rank == 0:
            flight.committed = self._commits.submit(self._commit, flight, manifest_fields)
        self._in_flight = flight
        return blocking

    def wait(self) -> Commit | None:
        """Block until the save in flight is written (and, on rank 0, committed)."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return None
        try:
            flight.written.result()
            return flight.committed.result() if flight.committed else None
        except Exception as error:  # a failed save must not end training: the previous checkpoint stands
            if self._on_failure:
                self._on_failure(str(flight.path), flight.step, error)
            else:
                log.error("checkpoint %s failed: %s", flight.path, error)
            return None

    def close(self) -> None:
        self.wait()
        self._commits.shutdown(wait=True)
        if self._stager:
            self._stager.close()

    def _commit(self, flight: _InFlight, manifest_fields: dict[str, Any]) -> Commit:
        flight.written.result()  # every rank's shards and DCP's .metadata are on disk
        manifest = write_manifest(flight.path, {**manifest_fields, "step": flight.step})
        commit = Commit(str(flight.path), flight.step, manifest, flight.blocking_s,
                        time.perf_counter() - flight.started)
        self.last_commit = commit
        if self._on_commit:
            self._on_commit(commit)
        return commit


def load_checkpoint(path: str | Path, target: dict[str, Any], topology: Topology) -> None:
    """Fill ``target`` in place from the checkpoint at ``path`` (a collective on every rank)."""
    dcp.load(target, checkpoint_id=str(path), process_group=topology.checkpoint_group)
