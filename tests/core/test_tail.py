"""``core.tail.Tail``: following a table by id when transactions commit out of order."""

from __future__ import annotations

from types import SimpleNamespace

from core.tail import HOLE_TTL_S, Tail


class Table:
    """Committed rows, and the query the relay would run."""

    def __init__(self):
        self.rows: dict[int, SimpleNamespace] = {}

    def commit(self, *ids: int) -> None:
        for pk in ids:
            self.rows[pk] = SimpleNamespace(pk=pk)

    def query(self, after: int, holes: list[int]):
        return [row for pk, row in self.rows.items() if pk > after or pk in holes]


def ids(rows) -> list[int]:
    return [row.pk for row in rows]


def test_rows_committed_out_of_order_are_not_missed():
    table, tail = Table(), Tail()
    table.commit(1, 2)
    assert ids(tail.fetch(table.query, now=0)) == [1, 2]
    table.commit(4)  # 3 is still in flight
    assert ids(tail.fetch(table.query, now=1)) == [4]
    assert tail.holes == {3: 1}
    table.commit(3)
    assert ids(tail.fetch(table.query, now=2)) == [3]
    assert tail.holes == {} and tail.high == 4
    assert tail.fetch(table.query, now=3) == []


def test_a_hole_that_never_fills_is_given_up():
    table, tail = Table(), Tail()
    table.commit(1, 3)  # 2 rolled back (or an ignored conflict burned it)
    tail.fetch(table.query, now=0)
    assert 2 in tail.holes
    tail.fetch(table.query, now=HOLE_TTL_S + 1)
    assert tail.holes == {}


def test_start_at_skips_what_the_snapshot_shows():
    table, tail = Table(), Tail()
    table.commit(1, 2, 3)
    tail.start_at(3)
    table.commit(4)
    assert ids(tail.fetch(table.query, now=0)) == [4]
