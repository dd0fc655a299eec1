"""Goodput accounting from the sample logs the example job writes (``--log-samples``).

Every rank appends one line per trained step: ``{"step", "rank", "attempt", "round", "ids"}``; the
benchmark notes the wall time it first saw each line. From those lines alone:

- **segments**: a run of consecutive steps of one process group. A new segment starts when the
  step does not follow the previous one (a resume from a checkpoint rewinds it), when torchrun's
  attempt or the round of in-process restarts (``agents.hooks.inprocess``) changes, or after a gap
  far longer than a step (a restart that resumed exactly where the last one stopped).
- **lineage**: the steps that survive into the final model. Read in time order, a step ``s``
  discards every step ``>= s`` trained before it: the resume went back to a checkpoint, and what
  came after that checkpoint is lost.
- **ETTR** (effective training time ratio): the time of the surviving steps over the wall time.
  A step's time is the gap to the step before it in its segment; the first step of a segment
  (which also carries the start-up) is counted at the median step time.
- **samples trained twice or skipped**: the data set is larger than the run, so every sample id
  has one position in the data stream; the lineage's ids are compared with the stream's prefix
  up to the furthest position trained. A range a rollback skipped on purpose is excluded.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: A gap this many times the median step ends a segment even when the step numbers follow on.
GAP_FACTOR = 20.0
MIN_GAP_S = 2.0


@dataclass(frozen=True)
class Record:
    seen: float  # wall time the line was first seen
    step: int
    rank: int
    attempt: int
    ids: tuple[int, ...]
    round: int = 0  # of in-process restarts within the attempt
    restored: str | None = None  # on a run's (or round's) first line: the checkpoint or snapshot it resumed from

    @classmethod
    def parse(cls, seen: float, line: Mapping) -> Record:
        return cls(seen, int(line["step"]), int(line["rank"]), int(line.get("attempt", 0)), tuple(line["ids"]),
                   int(line.get("round", 0)), line.get("restored"))


@dataclass(frozen=True)
class SegmentStart:
    seen: float
    step: int  # its first step: it resumed from the checkpoint of step - 1
    restored: str | None = None  # the checkpoint or snapshot directory, where the script names it


@dataclass
class Ledger:
    wall_s: float
    productive_s: float
    steps_trained: int  # rank 0's step lines, the lost ones included
    steps_surviving: int
    median_step_s: float | None
    trained_twice: int
    skipped: int
    segment_starts: list[SegmentStart] = field(default_factory=list)

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def lost_steps(self) -> int:
        return self.steps_trained - self.steps_surviving

    def as_dict(self) -> dict:
        return {"ettr": round(self.ettr, 4), "wall_s": round(self.wall_s, 2),
                "productive_s": round(self.productive_s, 2),
                "steps_trained": self.steps_trained, "steps_surviving": self.steps_surviving,
                "lost_steps": self.lost_steps, "median_step_s": self.median_step_s and round(self.median_step_s, 4),
                "trained_twice": self.trained_twice, "skipped": self.skipped,
                "segments": len(self.segment_starts)}


def by_rank(records: Iterable[Record]) -> dict[int, list[Record]]:
    ranks: dict[int, list[Record]] = {}
    for record in sorted(records, key=lambda r: (r.seen, r.step)):
        ranks.setdefault(record.rank, []).append(record)
    return ranks


def step_gaps(records: Sequence[Record]) -> list[float | None]:
    """Per record of one rank (in time order): its step time, or None where a segment starts."""
    follows = [i > 0 and records[i].step == records[i - 1].step + 1
               and (records[i].attempt, records[i].round) == (records[i - 1].attempt, records[i - 1].round)
               for i in range(len(records))]
    plain = [records[i].seen - records[i - 1].seen for i in range(len(records)) if follows[i]]
    limit = max(MIN_GAP_S, GAP_FACTOR * statistics.median(plain)) if plain else MIN_GAP_S
    gaps: list[float | None] = []
    for i, record in enumerate(records):
        gap = record.seen - records[i - 1].seen if follows[i] else None
        gaps.append(gap if gap is not None and gap <= limit else None)
    return gaps


def lineage(records: Sequence[Record]) -> list[int]:
    """Indexes into ``records`` (one rank, time order) of the steps that survive."""
    kept: list[int] = []
    for i, record in enumerate(records):
        while kept and records[kept[-1]].step >= record.step:
            kept.pop()
        kept.append(i)
    return kept


def sample_errors(ranks: Mapping[int, Sequence[Record]], kept: Mapping[int, list[int]], position: Mapping[int, int],
                  skip: Sequence[tuple[int, int]] = ()) -> tuple[int, int]:
    """(trained twice, skipped) over the steps every rank's lineage reached."""
    if not ranks:
        return 0, 0
    last = min(ranks[r][kept[r][-1]].step for r in ranks if kept[r])
    trained = Counter(i for r in ranks for k in kept[r] if ranks[r][k].step <= last for i in ranks[r][k].ids)
    twice = sum(count - 1 for count in trained.values() if count > 1)
    try:
        covered = {position[i] for i in trained}
    except KeyError as missing:
        raise ValueError(f"sample id {missing} is not in the data stream's order") from None
    if not covered:
        return twice, 0
    deliberate = lambda p: any(start <= p < end for start, end in skip)  # noqa: E731
    skipped = sum(1 for p in range(max(covered) + 1) if p not in covered and not deliberate(p))
    return twice, skipped


def account(records: Iterable[Record], *, wall_s: float, position: Mapping[int, int],
            skip: Sequence[tuple[int, int]] = ()) -> Ledger:
    """The ledger of one run: ``position`` maps a sample id to its place in the data stream."""
    ranks = by_rank(records)
    kept = {rank: lineage(rows) for rank, rows in ranks.items()}
    twice, skipped = sample_errors(ranks, kept, position, skip)
    zero = ranks.get(0, [])
    gaps = step_gaps(zero)
    steady = [g for g in gaps if g is not None]
    median_step = statistics.median(steady) if steady else None
    productive = sum(gaps[i] if gaps[i] is not None else (median_step or 0.0) for i in kept.get(0, []))
    starts = [SegmentStart(r.seen, r.step, r.restored) for r, g in zip(zero, gaps, strict=True) if g is None]
    return Ledger(wall_s=wall_s, productive_s=productive, steps_trained=len(zero), steps_surviving=len(kept.get(0, [])),
                  median_step_s=median_step, trained_twice=twice, skipped=skipped, segment_starts=starts)


def stream_positions(order: Sequence[int]) -> dict[int, int]:
    """Sample id -> position, for a data stream that visits each id once (``order[p]`` is the id)."""
    positions = {sample: p for p, sample in enumerate(order)}
    if len(positions) != len(order):
        raise ValueError("the data stream visits a sample twice: make the data set larger than the run")
    return positions


def percentiles(values: Sequence[float]) -> dict | None:
    """p50 and max, the figures the report shows per fault kind."""
    if not values:
        return None
    return {"p50": round(statistics.median(values), 3), "max": round(max(values), 3), "n": len(values)}
