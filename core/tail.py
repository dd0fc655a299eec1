"""Following an append-only table by primary key without missing rows committed out of order.

Two transactions can take ids 7 and 8 and commit 8 first: a reader that only asks for ``id >
highest seen`` would skip 7 for ever. ``Tail`` remembers the holes below its high-water mark and
asks for them again until they show up or are old enough to have been rolled back (a
``bulk_create(ignore_conflicts=True)`` or a failed insert burns ids that never appear).

Pure bookkeeping: the caller runs the queries (``Tail.fetch`` takes a function from a filter to
rows), so it is tested with plain lists.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

#: A hole still empty after this long belonged to a transaction that rolled back.
HOLE_TTL_S = 10.0
#: Never chase more holes than this (a burst of rolled-back ids); the oldest are given up.
MAX_HOLES = 5000


@dataclass
class Tail:
    high: int = 0
    holes: dict[int, float] = field(default_factory=dict)  # id -> when first missed

    def fetch(self, query: Callable[[int, list[int]], Iterable], *, now: float | None = None) -> list:
        """New rows since the last call: ``query(after_id, hole_ids)`` must return the rows with
        ``pk > after_id`` or ``pk in hole_ids``, each with a ``pk`` attribute, in any order."""
        now = time.monotonic() if now is None else now
        self.holes = {pk: seen for pk, seen in self.holes.items() if now - seen < HOLE_TTL_S}
        rows = sorted(query(self.high, sorted(self.holes)), key=lambda row: row.pk)
        for row in rows:
            if row.pk > self.high:
                for missing in range(max(self.high + 1, row.pk - MAX_HOLES), row.pk):
                    self.holes[missing] = now
                self.high = row.pk
            self.holes.pop(row.pk, None)
        if len(self.holes) > MAX_HOLES:
            for pk in sorted(self.holes)[: len(self.holes) - MAX_HOLES]:
                del self.holes[pk]
        return rows

    def start_at(self, high: int) -> None:
        """Begin after ``high``: what came before is in the snapshot clients get on connect."""
        self.high, self.holes = high, {}
