"""Torn saves: save directories in a job's checkpoint directory that were never committed.

A save killed before its commit marker (a SIGKILL mid-write, a node lost, a disk that filled)
leaves a ``step-…`` directory that no commit ever registered, so retention, which works on the
registry, never saw it: they piled up and kept a full disk full. ``find_torn_saves`` lists them
from the directory itself; ``remove_torn_saves`` removes each (``checkpoints.disk.remove_torn_dir``,
confined, never a directory holding the marker) and records a ``storage.torn_removed`` event.

A directory is torn when it is named as the hooks name a save, holds no commit marker, is not a
registered checkpoint's location, and its generation can no longer finish it: an older generation
than the job's current one (every node confirmed its ranks gone before the next one started), or
nothing written in it for ``TORN_IDLE_S`` (a save of the running generation takes seconds to
minutes). An interrupted removal (``….deleting``) is finished too. A directory with the marker is
never touched, registered or not: its commit report may still be on its way from a hooks spool.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from agents.hooks.manifest import MARKER, UnsafePath
from checkpoints import disk, paths
from checkpoints.models import Checkpoint
from core.events import EventKind, record_event

log = logging.getLogger(__name__)

#: A save of the running generation untouched this long is dead (the longest save seen is minutes).
TORN_IDLE_S = 3600


@dataclass(frozen=True)
class TornSave:
    location: str
    generation: int | None
    size_bytes: int
    idle_s: float
    why: str


def find_torn_saves(job, *, now: float | None = None) -> list[TornSave]:
    """The job's torn save directories (see the module doc), oldest first."""
    now = time.time() if now is None else now
    try:
        directory = paths.job_checkpoint_root(job)
        entries = list(os.scandir(directory))
    except (OSError, UnsafePath):
        return []
    locations = Checkpoint.objects.filter(job=job).values_list("location", flat=True)
    registered = {os.path.normpath(location) for location in locations}
    torn = []
    for entry in entries:
        save, trash = disk.SAVE_DIRNAME.fullmatch(entry.name), disk.TRASH_DIRNAME.fullmatch(entry.name)
        if not (save or trash) or not entry.is_dir(follow_symlinks=False):
            continue
        location = os.path.join(directory, entry.name)
        if os.path.normpath(location) in registered:
            continue
        try:
            files = [f for f in os.scandir(location) if f.is_file(follow_symlinks=False)]
            if not trash and os.path.lexists(os.path.join(location, MARKER)):
                continue
            newest = max([entry.stat(follow_symlinks=False).st_mtime, *(f.stat().st_mtime for f in files)])
            size = sum(f.stat().st_size for f in files)
        except OSError:
            continue
        generation = int(save.group(2)) if save else None
        idle = max(0.0, now - newest)
        if trash:
            why = "an interrupted removal"
        elif generation is not None and generation < job.generation:
            why = f"written by generation {generation}, which ended before generation {job.generation} started"
        elif idle >= TORN_IDLE_S:
            why = f"nothing written in it for {idle / 60:.0f} minutes"
        else:
            continue  # may be a save in flight
        torn.append(TornSave(location, generation, size, idle, why))
    return sorted(torn, key=lambda t: -t.idle_s)


def remove_torn_saves(job, *, actor: str, now: float | None = None) -> list[TornSave]:
    """Remove the job's torn save directories; returns those removed (each with an event)."""
    removed = []
    for save in find_torn_saves(job, now=now):
        try:
            freed = disk.remove_torn_dir(save.location, [paths.job_checkpoint_root(job)])
        except (OSError, UnsafePath) as error:
            log.warning("could not remove the torn save %s of job %s: %s", save.location, job.pk, error)
            continue
        record_event(EventKind.STORAGE_TORN_REMOVED, actor=actor, job=job,
                     reason=f"removed {os.path.basename(save.location)}, a save never committed ({save.why}): "
                            f"{freed} bytes freed",
                     evidence={"location": save.location, "generation": save.generation, "size_bytes": freed,
                               "idle_s": round(save.idle_s, 1)})
        removed.append(save)
    return removed
