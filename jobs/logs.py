"""Training output: each generation's torchrun output, shipped by the node agents, stored bounded.

The agent tails the generation's log on its node (``agents.supervisor``) and posts the lines, in
order and numbered, to ``POST /nodes/{id}/logs`` with its node token (``agents.protocol.agent.LogBatch``);
only a generation placed on its node is accepted (``ForeignGeneration``, a 403). What a node wrote is
text and stays text: each line is sanitised like every other node text (``core.text.clip``: no NUL,
no lone surrogate, at most ``MAX_LINE`` characters) and never parsed beyond the rank prefix torch
puts in front of a rank's lines (``[rank3]:``).

Bounds:

- per generation and node, at most ``LOG_MAX_BYTES`` characters (``NIGHTWATCH_LOG_MAX_BYTES``,
  1 MiB): past it the oldest lines go, so the tail, which is what one reads, stays;
- lines older than ``LOG_RETENTION_DAYS`` (``NIGHTWATCH_LOG_RETENTION_DAYS``, 7) are deleted by
  ``prune`` (beat, hourly);
- a batch's line numbers make a retry idempotent (lines already stored are skipped) and a gap
  visible (counted as ``dropped``: the agent's buffer is bounded too).

Readers page with ``after`` (the last line id they saw): ``read`` answers the lines after it in
arrival order, so ``nightwatch logs --follow`` and the job page's panel ask for what is new.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.db.models.functions import Length
from django.utils import timezone

from agents.protocol.agent import LogBatch
from core.text import clip
from jobs.models import Generation, Job, LogLine, LogStream

#: torch puts "[rank<N>]:" before the lines of a rank's uncaught exception (and torchrun's
#: ``--tee`` "[default<N>]:" before each line of local rank N).
_RANK_PREFIX = re.compile(r"^\[rank(\d{1,7})\]:")
MAX_LINE = 2000
#: The columns that hold generations and ranks are 32-bit: a larger number names nothing.
INT32 = 2**31 - 1


class ForeignGeneration(Exception):
    """The batch names a generation that is not placed on the calling node (or no such generation)."""


@dataclass(frozen=True)
class Stored:
    accepted: int
    duplicates: int
    dropped: int


def _limits() -> tuple[int, int]:
    config = settings.NIGHTWATCH
    return int(config.get("LOG_MAX_BYTES", 2**20)), int(config.get("LOG_RETENTION_DAYS", 7))


def rank_of(text: str) -> int | None:
    match = _RANK_PREFIX.match(text)
    return int(match.group(1)) if match else None


def store(node, batch: LogBatch, *, now=None) -> Stored:
    """Store ``batch`` from ``node``'s agent; ``ForeignGeneration`` unless the generation runs (or ran) there."""
    now = now or timezone.now()
    if not (batch.job.isdigit() and len(batch.job) < 19 and batch.generation <= INT32 and batch.first_line < 2**62):
        raise ForeignGeneration(f"job {batch.job} generation {batch.generation} is not placed on node {node.pk}")
    job = Job.objects.filter(pk=int(batch.job)).only("pk").first()
    generation = (Generation.objects.filter(job=job, number=batch.generation, nodes=node).only("pk").first()
                  if job is not None else None)
    if generation is None:
        raise ForeignGeneration(f"job {batch.job} generation {batch.generation} is not placed on node {node.pk}")
    cap, _ = _limits()
    with transaction.atomic():
        stream, _ = LogStream.objects.get_or_create(job=job, generation=batch.generation, hostname=node.hostname)
        stream = LogStream.objects.select_for_update().get(pk=stream.pk)
        skip = max(0, stream.next_line - batch.first_line)  # sent before: already stored (or dropped)
        fresh = batch.lines[skip:]
        gap = max(0, batch.first_line - stream.next_line)  # the agent dropped these
        rows = []
        for offset, raw in enumerate(fresh):
            text = clip(raw, MAX_LINE)
            rows.append(LogLine(job=job, generation=batch.generation, stream=stream, text=text, rank=rank_of(text),
                                line=batch.first_line + skip + offset, received_at=now))
        LogLine.objects.bulk_create(rows)
        size = sum(len(r.text) for r in rows)
        LogStream.objects.filter(pk=stream.pk).update(
            next_line=max(stream.next_line, batch.first_line + len(batch.lines)),
            bytes=F("bytes") + size, dropped=F("dropped") + gap, updated_at=now)
        stream.refresh_from_db()
        dropped = _enforce_cap(stream, cap) if stream.bytes > cap else 0
    return Stored(accepted=len(rows), duplicates=min(skip, len(batch.lines)), dropped=gap + dropped)


def _enforce_cap(stream: LogStream, cap: int) -> int:
    """Delete the stream's oldest lines until it holds at most 90 % of ``cap``; returns how many went."""
    excess = stream.bytes - int(cap * 0.9)
    cut_id, freed, count = None, 0, 0
    for pk, size in (LogLine.objects.filter(stream=stream).order_by("id").annotate(size=Length("text"))
                     .values_list("id", "size").iterator(chunk_size=2000)):
        cut_id, freed, count = pk, freed + size, count + 1
        if freed >= excess:
            break
    if cut_id is None:
        return 0
    LogLine.objects.filter(stream=stream, id__lte=cut_id).delete()
    LogStream.objects.filter(pk=stream.pk).update(bytes=F("bytes") - freed, dropped=F("dropped") + count)
    return count


def read(job: Job, *, generation: int | None = None, rank: int | None = None, after: int | None = None,
         tail: int | None = None, limit: int = 1000) -> list[LogLine]:
    """Lines of ``job`` in arrival order: after the id ``after`` (follow), or the last ``tail`` ones."""
    lines = LogLine.objects.filter(job=job).select_related("stream")
    if generation is not None:
        lines = lines.filter(generation=generation)
    if rank is not None:
        lines = lines.filter(rank=rank)
    if after is not None:
        return list(lines.filter(id__gt=after).order_by("id")[:limit])
    newest = list(lines.order_by("-id")[:min(limit, tail if tail is not None else limit)])
    return newest[::-1]


def streams(job: Job, generation: int | None = None) -> list[LogStream]:
    found = LogStream.objects.filter(job=job)
    if generation is not None:
        found = found.filter(generation=generation)
    return list(found.order_by("generation", "hostname"))


def prune(*, now=None) -> int:
    """Retention: delete lines older than ``LOG_RETENTION_DAYS``; returns how many."""
    _, days = _limits()
    cutoff = (now or timezone.now()) - timedelta(days=days)
    deleted = 0
    while True:  # in slices: a long-unpruned table must not hold one huge transaction
        ids = list(LogLine.objects.filter(received_at__lt=cutoff).order_by("id").values_list("id", flat=True)[:5000])
        if not ids:
            break
        deleted += LogLine.objects.filter(id__in=ids).delete()[0]
    for stream in LogStream.objects.filter(updated_at__lt=cutoff, bytes__gt=0):
        LogStream.objects.filter(pk=stream.pk).update(bytes=0)
    return deleted
