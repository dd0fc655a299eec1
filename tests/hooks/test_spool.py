"""agents.spool.Spool: bounded, ordered, idempotent, thread-safe, and it survives a reopen."""

from __future__ import annotations

import threading

import pytest

from agents.spool import Spool


@pytest.fixture
def path(tmp_path):
    return tmp_path / "spool" / "records.sqlite3"


def kinds_and_records(spool, limit=1000):
    return [(kind, record) for _, kind, record in spool.peek(limit)]


def test_records_come_back_oldest_first_until_acknowledged(path):
    spool = Spool(path, max_records=100)
    for i in range(5):
        spool.append("report", {"step": i})
    records = spool.peek(3)
    assert [r["step"] for _, _, r in records] == [0, 1, 2]
    spool.ack(records[1][0])
    assert [r["step"] for _, _, r in spool.peek(10)] == [2, 3, 4]
    assert len(spool) == 3


def test_a_key_already_held_is_ignored_until_its_record_is_acknowledged(path):
    spool = Spool(path, max_records=100)
    assert spool.append("report", {"step": 1, "try": 1}, key="r:1")
    assert not spool.append("report", {"step": 1, "try": 2}, key="r:1")
    assert kinds_and_records(spool) == [("report", {"step": 1, "try": 1})]
    spool.ack(spool.peek(1)[0][0])
    assert spool.append("report", {"step": 1, "try": 3}, key="r:1")  # delivered: the server dedupes now


def test_over_the_bound_only_the_oldest_droppable_records_go_and_are_counted(path):
    spool = Spool(path, max_records=4, droppable_kinds=frozenset({"report", "telemetry"}))
    spool.append("event", {"n": 0})
    spool.append("report", {"n": 1})
    spool.append("telemetry", {"n": 2})
    spool.append("report", {"n": 3})
    spool.append("event", {"n": 4})  # fifth record: the oldest droppable (report 1) goes
    spool.append("report", {"n": 5})  # then telemetry 2
    assert [r["n"] for _, _, r in spool.peek(10)] == [0, 3, 4, 5]
    assert spool.dropped == {"report": 1, "telemetry": 1}


def test_records_of_kinds_that_may_not_be_dropped_exceed_the_bound_rather_than_vanish(path):
    spool = Spool(path, max_records=2, droppable_kinds=frozenset({"report"}))
    for n in range(5):
        spool.append("checkpoint", {"n": n})
    assert len(spool) == 5
    assert spool.dropped == {}
    spool.append("report", {"n": 5})  # the only droppable record is also the oldest droppable one
    assert [r["n"] for _, _, r in spool.peek(10)] == [0, 1, 2, 3, 4]
    assert spool.dropped == {"report": 1}


def test_everything_survives_a_reopen_and_new_ids_keep_increasing(path):
    spool = Spool(path, max_records=3, droppable_kinds=frozenset({"report"}))
    for n in range(5):
        spool.append("report", {"n": n}, key=f"k{n}")
    last_id = spool.peek(10)[-1][0]
    spool.close()

    reopened = Spool(path, max_records=3, droppable_kinds=frozenset({"report"}))
    assert [r["n"] for _, _, r in reopened.peek(10)] == [2, 3, 4]
    assert reopened.dropped == {"report": 2}
    assert len(reopened) == 3
    assert not reopened.append("report", {"n": 4}, key="k4")  # keys survive too
    reopened.ack(last_id)
    reopened.append("report", {"n": 6})
    assert reopened.peek(1)[0][0] > last_id  # acknowledged ids are never reused
    reopened.close()


def test_concurrent_appends_from_many_threads_are_all_kept_in_a_total_order(path):
    spool = Spool(path, max_records=10_000)

    def writer(thread: int) -> None:
        for i in range(50):
            spool.append("report", {"thread": thread, "i": i}, key=f"{thread}:{i}")

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = spool.peek(1000)
    assert len(records) == len(spool) == 200
    ids = [row_id for row_id, _, _ in records]
    assert ids == sorted(set(ids))
    for thread in range(4):  # each writer's records stay in its own order
        assert [r["i"] for _, _, r in records if r["thread"] == thread] == list(range(50))


def test_non_finite_numbers_are_refused_because_they_are_not_json(path):
    spool = Spool(path, max_records=10)
    with pytest.raises(ValueError):
        spool.append("report", {"loss": float("nan")})
    assert len(spool) == 0


def test_a_closed_spool_says_so(path):
    spool = Spool(path, max_records=10)
    spool.close()
    with pytest.raises(RuntimeError, match="closed"):
        spool.append("report", {})


def test_a_lane_is_read_and_acknowledged_without_touching_the_other_kinds(tmp_path):
    spool = Spool(tmp_path / "s.db", max_records=100)
    for i in range(3):
        spool.append("telemetry", {"i": i})
        spool.append("event", {"i": i})
    events = spool.peek(10, kinds={"event"})
    assert [(kind, body["i"]) for _, kind, body in events] == [("event", 0), ("event", 1), ("event", 2)]
    spool.ack(events[1][0], kinds={"event"})  # the first two events delivered
    assert [(kind, body["i"]) for _, kind, body in spool.peek(10)] == [
        ("telemetry", 0), ("telemetry", 1), ("telemetry", 2), ("event", 2)]
    assert len(spool) == 4
    with pytest.raises(ValueError):
        spool.peek(1, kinds=set())
    spool.close()
