"""What admission control refused and answered late reaches the counts every web process shares
(core.shared_counts, in this run's Redis database), and a Redis that is down costs a 503 nothing."""

from __future__ import annotations

import asyncio
import time

import pytest

from core import admission as admission_module
from core import shared_counts
from core.models import hash_token
from tests.core.test_admission import CHECKPOINTS, CONTROL, HEARTBEAT, REPORTS, admission, call, until


@pytest.fixture
def counts(monkeypatch):
    """Shared counts starting empty, handed over at every chance (no one-second batching)."""
    monkeypatch.setattr(admission_module, "FLUSH_S", 0.0)
    redis = shared_counts.client()
    assert redis is not None, "these tests need REDIS_URL"

    def clear():
        for key in redis.scan_iter(f"{shared_counts.PREFIX}*"):
            redis.delete(key)

    clear()
    yield
    clear()


async def handed_over(app) -> None:
    """Until the middleware's last hand-over to Redis is done and nothing waits for the next."""
    async with asyncio.timeout(5):
        while app.shared.pending or (app.shared.flushing and not app.shared.flushing.done()):
            app.shared.flush_if_due()
            await asyncio.sleep(0.01)


def test_refusals_by_class_and_late_heartbeats_reach_the_shared_counts(counts):
    async def scenario():
        held, app = admission(limit=2, reserve=1)
        app.late_s = 0.05
        bulk = asyncio.create_task(call(app, REPORTS))
        await until(lambda: held.started == 1)
        refused = [await call(app, REPORTS) for _ in range(3)]
        beat = asyncio.create_task(call(app, HEARTBEAT))  # the reserved slot
        await until(lambda: held.started == 2)
        refused.append(await call(app, HEARTBEAT))
        await asyncio.sleep(0.06)  # both admitted requests are now late
        held.release.set()
        await asyncio.gather(bulk, beat)
        assert [r["status"] for r in refused] == [503] * 4
        await handed_over(app)

    asyncio.run(scenario())
    assert shared_counts.totals() == {"refused:other": 3, "refused:priority": 1, "late:priority": 1}
    window = shared_counts.within(5, now=time.time())
    assert window == {"refused:other": 3, "refused:priority": 1, "late:priority": 1}
    assert shared_counts.within(5, now=time.time() + 60) == {}  # a minute later the window is clean


def test_whom_it_refused_is_recorded_as_token_digests_and_nothing_else(counts):
    """The sweepers spare a node or job whose requests were refused (core.refusals): they learn whom
    from the SHA-256 of the bearer token, never the token; requests without one name nobody, and
    neither does a control poll (a hung rank's reporter still polls: only a step report or a checkpoint
    commit is progress; a refused commit holds back the reports spooled after it)."""
    async def scenario():
        held, app = admission(limit=1, reserve=0)
        first = asyncio.create_task(call(app, REPORTS))
        await until(lambda: held.started == 1)
        for headers in ([(b"authorization", b"Bearer nw_agent-one")], [(b"authorization", b"bearer nw_hooks")],
                        [(b"authorization", b"Basic dXNlcjpwYXNz")], [(b"authorization", b"Bearer \xff")], []):
            assert (await call(app, HEARTBEAT, headers))["status"] == 503
        assert (await call(app, REPORTS, [(b"authorization", b"Bearer nw_reporting")]))["status"] == 503
        assert (await call(app, CHECKPOINTS, [(b"authorization", b"Bearer nw_committing")]))["status"] == 503
        assert (await call(app, CONTROL, [(b"authorization", b"Bearer nw_polling")]))["status"] == 503
        for token, claim in ((b"nw_rank-zero", b"1"), (b"nw_rank-three", b"0")):  # another rank's proves nothing
            headers = [(b"authorization", b"Bearer " + token), (b"x-nightwatch-progress", claim)]
            assert (await call(app, REPORTS, headers))["status"] == 503
        await handed_over(app)
        held.release.set()
        await first

    asyncio.run(scenario())
    refused = shared_counts.refused_callers(5, now=time.time())
    assert set(refused) == {hash_token("nw_agent-one"), hash_token("nw_hooks"), hash_token("nw_reporting"),
                            hash_token("nw_committing"), hash_token("nw_rank-zero")}
    assert all(time.time() - 5 < at <= time.time() for at in refused.values())
    assert shared_counts.refused_callers(5, now=time.time() + 60) == {}
    # Priority: the five heartbeats, rank 0's report and the commit; bulk: the others.
    assert shared_counts.totals() == {"refused:priority": 7, "refused:other": 3}


class GoneBeforeServed:
    """What Django's ASGI handler does when the client disconnects before the view answered: it
    cancels the view and returns without a response (``django.core.handlers.asgi``)."""

    async def __call__(self, scope, receive, send):
        assert (await receive())["type"] == "http.disconnect"


async def given_up(app, path: str, headers: list[tuple[bytes, bytes]]) -> list[dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await app({"type": "http", "method": "POST", "path": path, "headers": headers}, receive, send)
    return sent


def test_a_witness_whose_caller_gave_up_before_its_answer_is_recorded_like_a_refusal(counts):
    """Admitted, then dropped when its caller's timeout ran out in the queue: neither refused nor
    served, so without this the hang sweep would see a rank 0 that kept trying as silent (the likely
    cause of run M's false hang, bench.fleet). Another rank's report and a control poll still prove
    nothing; an answered request records nobody."""
    async def scenario():
        held, app = admission(limit=4, reserve=0)
        app.app = GoneBeforeServed()
        for token, path, claim in ((b"nw_rank-zero", REPORTS, b"1"), (b"nw_rank-three", REPORTS, b"0"),
                                   (b"nw_agent", HEARTBEAT, None), (b"nw_polling", CONTROL, None)):
            headers = [(b"authorization", b"Bearer " + token)]
            if claim is not None:
                headers.append((b"x-nightwatch-progress", claim))
            assert await given_up(app, path, headers) == []
        assert app.counters.in_flight == 0
        held.release.set()
        _, served = admission(limit=4, reserve=0)
        served.app = held
        assert (await call(served, REPORTS, [(b"authorization", b"Bearer nw_served")]))["status"] == 200
        await handed_over(app)
        await handed_over(served)

    asyncio.run(scenario())
    assert set(shared_counts.refused_callers(5, now=time.time())) == {hash_token("nw_rank-zero"),
                                                                      hash_token("nw_agent")}
    assert shared_counts.totals() == {"abandoned:priority": 2}


def test_a_redis_that_is_down_costs_a_refusal_nothing(counts, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there

    async def scenario():
        held, app = admission(limit=1, reserve=0)
        first = asyncio.create_task(call(app, REPORTS))
        await until(lambda: held.started == 1)
        started = time.monotonic()
        answer = await call(app, REPORTS)
        assert answer["status"] == 503 and time.monotonic() - started < 0.1  # not waiting on Redis
        await handed_over(app)
        assert app.shared.flushing.result() is False  # the count is lost, logged, and nothing raised
        held.release.set()
        await first

    asyncio.run(scenario())
    assert shared_counts.totals() is None



def test_a_heartbeat_that_carries_commands_gets_the_urgent_slots_until_they_are_acknowledged(counts):
    """A node with open commands (nodes.services.commands names it) fetches them with its next
    heartbeat: that heartbeat is urgent, the fleet's others are not; once the node has none left,
    its heartbeats wait their turn again."""
    carrying = [(b"authorization", b"Bearer nw_node-with-a-launch")]
    idle = [(b"authorization", b"Bearer nw_idle-node")]
    assert shared_counts.expect_heartbeats({hash_token("nw_node-with-a-launch"): time.time()}, keep_s=600)

    async def scenario():
        held, app = admission(limit=3, reserve=2, urgent_reserve=1)
        beats = [asyncio.create_task(call(app, HEARTBEAT, idle)) for _ in range(2)]
        await until(lambda: held.started == 2)
        assert (await call(app, HEARTBEAT, idle))["status"] == 503  # the urgent slot is not for it
        await until(lambda: app.awaited.digests)  # read from Redis in a thread
        launch = asyncio.create_task(call(app, HEARTBEAT, carrying))
        await until(lambda: held.started == 3)
        assert app.counters.admitted["urgent"] == 1 and app.counters.refused["priority"] == 1

        assert shared_counts.heartbeats_received([hash_token("nw_node-with-a-launch")])
        # A read started before the acknowledgement may still bring the digest back: read again
        # until one started after it answers (FLUSH_S is 0 here; a read in flight is never doubled).
        def read_again():
            app.awaited.refresh_if_due()
            return not app.awaited.digests

        await until(read_again)
        held.release.set()
        await asyncio.gather(*beats, launch)
        held.release.clear()
        beats = [asyncio.create_task(call(app, HEARTBEAT, idle)) for _ in range(2)]
        await until(lambda: held.started == 5)
        assert (await call(app, HEARTBEAT, carrying))["status"] == 503  # acknowledged: ordinary again
        held.release.set()
        await asyncio.gather(*beats)

    asyncio.run(scenario())


def test_awaited_heartbeats_age_out_with_the_commands_time_to_live(counts):
    now = time.time()
    assert shared_counts.expect_heartbeats({"old": now - 700, "new": now}, keep_s=600)
    assert shared_counts.awaited_heartbeats(600, now=now) == frozenset({"new"})
    assert shared_counts.client().zcard(shared_counts.AWAITED) == 1  # the writer trimmed the old one
