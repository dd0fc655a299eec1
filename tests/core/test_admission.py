"""Admission control (core/admission.py) in front of an ASGI app whose requests we hold open.

The downstream app is a stand-in that answers only when the test releases it, so "in flight" is
exactly what the test says; the middleware, URL resolution and the 503 it writes are the real ones.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from controlplane import asgi as controlplane_asgi
from controlplane.asgi import (
    CARRIER_URLS,
    EXEMPT_URLS,
    OPERATOR_URLS,
    PRIORITY_URLS,
    PRIORITY_WRITE_URLS,
    PROGRESS_URLS,
    URGENT_URLS,
    WITNESS_URLS,
    application,
)
from core.admission import Admission, Pressure

HEARTBEAT = "/api/v1/nodes/7/heartbeat"
REPORTS = "/api/v1/jobs/3/reports"
CONTROL = "/api/v1/jobs/3/control"
CHECKPOINTS = "/api/v1/jobs/3/checkpoints"
EVENTS = "/api/v1/nodes/7/events"
PROBE = "/healthz"
SUBMIT = "/api/v1/jobs"
DRAIN = "/nodes/7/drain"  # the dashboard's form


class Held:
    """An ASGI app that answers 200 once ``release`` is set."""

    def __init__(self):
        self.release = asyncio.Event()
        self.started = 0

    async def __call__(self, scope, receive, send):
        self.started += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(app, path: str, headers: list[tuple[bytes, bytes]] | None = None, method: str = "POST") -> dict:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app({"type": "http", "method": method, "path": path, "headers": headers or []}, receive, send)
    start = sent[0]
    return {"status": start["status"], "headers": dict(start["headers"]), "body": sent[1]["body"]}


def admission(limit=3, reserve=1, urgent_reserve=0, retry_after_max_s=None):
    held = Held()
    return held, Admission(held, limit=limit, reserve=reserve, urgent_reserve=urgent_reserve, retry_after_s=2,
                           retry_after_max_s=retry_after_max_s,
                           urgent=URGENT_URLS, priority=PRIORITY_URLS, priority_writes=PRIORITY_WRITE_URLS,
                           operator=OPERATOR_URLS, exempt=EXEMPT_URLS,
                           witnesses=WITNESS_URLS, carriers=CARRIER_URLS, progress=PROGRESS_URLS)


async def until(predicate):
    async with asyncio.timeout(5):
        while not predicate():
            await asyncio.sleep(0)


def test_bulk_is_refused_at_the_bound_less_the_reserve_and_heartbeats_use_the_reserve():
    async def scenario():
        held, app = admission(limit=3, reserve=1)
        bulk = [asyncio.create_task(call(app, REPORTS)) for _ in range(2)]
        await until(lambda: held.started == 2)

        refused = await call(app, REPORTS)  # 2 in flight = limit - reserve: bulk waits outside
        assert refused["status"] == 503
        assert refused["headers"][b"retry-after"] == b"2"
        assert refused["headers"][b"content-type"] == b"application/problem+json"
        problem = json.loads(refused["body"])
        assert problem["type"].endswith("/overloaded") and problem["status"] == 503
        assert problem["instance"] == REPORTS

        beat = asyncio.create_task(call(app, HEARTBEAT))  # the reserved slot
        await until(lambda: held.started == 3)
        assert (await call(app, HEARTBEAT))["status"] == 503  # the bound is the bound, for heartbeats too
        probe = asyncio.create_task(call(app, PROBE))  # never refused
        await until(lambda: held.started == 4)

        held.release.set()
        answers = await asyncio.gather(*bulk, beat, probe)
        assert [a["status"] for a in answers] == [200, 200, 200, 200]
        assert app.counters.in_flight == 0 and app.counters.peak == 4
        assert app.counters.refused == {"urgent": 0, "priority": 1, "operator": 0, "other": 1}
        assert (await call(app, REPORTS))["status"] == 200  # capacity is back

    asyncio.run(scenario())


def test_rank_zero_s_progress_reports_go_ahead_of_bulk_once_per_token_per_gap():
    """Only rank 0's step reports move a job's progress, and all its ranks share a token: rank 0's
    (``X-Nightwatch-Progress: 1``) use the heartbeats' slots, one per token every PROGRESS_GAP_S;
    more from the same token within it, another rank's (``0``) and older hooks' (none) are bulk."""
    def progress(claim: bytes, token: bytes = b"nw_job-one") -> list[tuple[bytes, bytes]]:
        return [(b"authorization", b"Bearer " + token), (b"x-nightwatch-progress", claim)]

    async def scenario():
        held, app = admission(limit=4, reserve=2)
        bulk = [asyncio.create_task(call(app, REPORTS)) for _ in range(2)]
        await until(lambda: held.started == 2)
        for refused in (progress(b"0"), []):
            assert (await call(app, REPORTS, refused))["status"] == 503
        rank_zero = asyncio.create_task(call(app, REPORTS, progress(b"1")))
        await until(lambda: held.started == 3)
        assert (await call(app, REPORTS, progress(b"1")))["status"] == 503  # the same token within the gap
        other_job = asyncio.create_task(call(app, REPORTS, progress(b"1", b"nw_job-two")))
        await until(lambda: held.started == 4)
        held.release.set()
        assert [a["status"] for a in await asyncio.gather(*bulk, rank_zero, other_job)] == [200] * 4
        assert app.counters.admitted == {"urgent": 0, "priority": 2, "operator": 0, "other": 2, "exempt": 0}
        assert app.counters.refused == {"urgent": 0, "priority": 0, "operator": 0, "other": 3}

    asyncio.run(scenario())


def test_a_checkpoint_commit_goes_ahead_of_bulk_and_reading_the_checkpoints_does_not():
    """The hooks' reporter sends nothing behind a commit until it is taken: refused as bulk, it held a
    job's step reports for minutes at 1,024 nodes. Its POST uses the heartbeats' slots; a GET is bulk."""
    async def scenario():
        held, app = admission(limit=3, reserve=1)
        bulk = [asyncio.create_task(call(app, REPORTS)) for _ in range(2)]
        await until(lambda: held.started == 2)
        assert (await call(app, CHECKPOINTS, method="GET"))["status"] == 503
        commit = asyncio.create_task(call(app, CHECKPOINTS))
        await until(lambda: held.started == 3)
        held.release.set()
        assert [a["status"] for a in await asyncio.gather(*bulk, commit)] == [200] * 3
        assert app.counters.admitted["priority"] == 1 and app.counters.refused["other"] == 1

    asyncio.run(scenario())


def test_heartbeats_leave_the_urgent_slots_to_the_agents_events():
    """A fleet of heartbeats keeps a shedding server's bound full; an exit report still gets in."""
    async def scenario():
        held, app = admission(limit=4, reserve=2, urgent_reserve=1)
        beats = [asyncio.create_task(call(app, HEARTBEAT)) for _ in range(3)]
        await until(lambda: held.started == 3)
        assert (await call(app, HEARTBEAT))["status"] == 503  # limit - urgent_reserve heartbeats in flight
        assert (await call(app, REPORTS))["status"] == 503
        exit_report = asyncio.create_task(call(app, EVENTS))  # the urgent slot
        await until(lambda: held.started == 4)
        assert (await call(app, EVENTS))["status"] == 503  # and then the bound holds for urgent ones too
        held.release.set()
        assert [a["status"] for a in await asyncio.gather(*beats, exit_report)] == [200] * 4
        assert app.counters.refused == {"urgent": 1, "priority": 1, "operator": 0, "other": 1}

    asyncio.run(scenario())


def test_a_refused_bulk_request_waits_longer_the_more_bulk_is_refused_and_heartbeats_do_not():
    """Retry-After for bulk = 2 s x offered / admitted over the last windows, at most 9 s."""
    async def scenario():
        held, app = admission(limit=3, reserve=1, retry_after_max_s=9)
        clock = [0.0]
        app.pressure = Pressure(window_s=5.0, clock=lambda: clock[0])
        bulk = [asyncio.create_task(call(app, REPORTS)) for _ in range(2)]
        await until(lambda: held.started == 2)  # 2 offered, 2 admitted: the bound for bulk is full

        waits = [int((await call(app, REPORTS))["headers"][b"retry-after"]) for _ in range(4)]
        assert waits == [3, 4, 5, 6]  # ceil(2 x 3/2), ceil(2 x 4/2), ...
        assert app.retry_after("other") == 6
        for _ in range(10):
            await call(app, REPORTS)
        assert app.retry_after("other") == 9  # 16 offered for 2 taken: capped
        assert app.retry_after("priority") == app.retry_after("urgent") == 2
        beat = asyncio.create_task(call(app, HEARTBEAT))
        await until(lambda: held.started == 3)
        assert (await call(app, HEARTBEAT))["headers"][b"retry-after"] == b"2"  # a verdict's wait, not bulk's

        clock[0] = 6.0  # one window on: the last two windows still hold the refusals
        assert app.retry_after("other") == 9
        clock[0] = 10.5  # two windows on: the pressure is forgotten
        assert app.retry_after("other") == 2
        held.release.set()
        await asyncio.gather(*bulk, beat)

    asyncio.run(scenario())


def test_pressure_counts_over_the_current_window_and_the_one_before():
    clock = [0.0]
    pressure = Pressure(window_s=5.0, clock=lambda: clock[0])
    assert pressure.ratio() == 1.0  # nothing offered
    for admitted in (True, False, False, False):
        pressure.count(admitted)
    assert pressure.ratio() == 4.0
    clock[0] = 5.0
    pressure.count(True)
    assert pressure.ratio() == 5 / 2  # both windows
    clock[0] = 10.0
    assert pressure.ratio() == 1.0  # the first window is gone: 1 offered, 1 admitted
    clock[0] = 100.0
    assert pressure.ratio() == 1.0 and pressure.current == pressure.previous == [0, 0]
    for _ in range(3):
        pressure.count(False)
    assert pressure.ratio() == 3.0  # nothing admitted: offered over one


def test_an_operators_actions_are_admitted_before_bulk_and_their_reads_are_not():
    """Submitting a job or draining a node in an overload: admitted like a heartbeat, while the
    same URLs' reads (the job list, a page) are bulk like everything else."""
    async def scenario():
        held, app = admission(limit=4, reserve=2, urgent_reserve=1)
        bulk = [asyncio.create_task(call(app, REPORTS)) for _ in range(2)]
        await until(lambda: held.started == 2)
        assert (await call(app, SUBMIT, method="GET"))["status"] == 503  # a read of the list: bulk
        actions = [asyncio.create_task(call(app, path)) for path in (SUBMIT,)]
        await until(lambda: held.started == 3)
        assert (await call(app, DRAIN))["status"] == 503  # limit - urgent_reserve in flight
        exit_report = asyncio.create_task(call(app, EVENTS))  # the urgent slot is still free
        await until(lambda: held.started == 4)
        held.release.set()
        assert [a["status"] for a in await asyncio.gather(*bulk, *actions, exit_report)] == [200] * 4
        assert app.counters.refused == {"urgent": 0, "priority": 0, "operator": 1, "other": 1}
        assert app.counters.admitted["operator"] == 1

    asyncio.run(scenario())


def test_an_unknown_path_counts_as_bulk_and_a_zero_limit_admits_everything():
    async def scenario():
        held, app = admission(limit=2, reserve=1)
        first = asyncio.create_task(call(app, "/no/such/page"))
        await until(lambda: held.started == 1)
        assert (await call(app, "/no/such/page"))["status"] == 503
        held.release.set()
        await first

        held, off = admission(limit=0, reserve=0)
        held.release.set()
        answers = await asyncio.gather(*[call(off, REPORTS) for _ in range(50)])
        assert {a["status"] for a in answers} == {200}

    asyncio.run(scenario())


@pytest.mark.parametrize("limit, reserve, urgent, retry, longest", [
    (4, 4, 0, 1, None), (4, 5, 0, 1, None), (-1, 0, 0, 1, None), (4, 1, 0, 0, None), (4, 1, 2, 1, None),
    (4, 1, -1, 1, None), (4, 1, 0, 2, 1)])
def test_a_bound_that_cannot_work_is_refused_at_start(limit, reserve, urgent, retry, longest):
    with pytest.raises(ValueError):
        Admission(Held(), limit=limit, reserve=reserve, urgent_reserve=urgent, retry_after_s=retry,
                  retry_after_max_s=longest)


def test_the_project_routes_http_through_admission_with_the_settings_bound(settings):
    http = application.application_mapping["http"]
    assert isinstance(http, Admission)
    assert http.limit == settings.NIGHTWATCH["MAX_IN_FLIGHT"] > http.reserve == settings.NIGHTWATCH[
        "PRIORITY_RESERVE"]
    assert http.classify(HEARTBEAT) == "priority" and http.classify("/api/v1/agents/register") == "priority"
    assert http.urgent_reserve == settings.NIGHTWATCH["URGENT_RESERVE"] <= http.reserve
    assert (http.retry_after_s, http.retry_after_max_s) == (settings.NIGHTWATCH["RETRY_AFTER_S"],
                                                            settings.NIGHTWATCH["RETRY_AFTER_MAX_S"])
    assert http.classify(EVENTS) == "urgent"  # exits and Xids: the verdicts that start recovery
    assert http.classify("/api/v1/nodes/7/commands/9/ack") == "urgent"  # the launches and stops that carry it out
    assert http.progress == {"job-reports"}
    assert http.witnesses == {"agent-heartbeat", "agent-telemetry", "agent-events", "agent-ack", "job-reports",
                              "job-checkpoints"}
    assert http.classify(REPORTS) == "other" and http.classify(PROBE) == "exempt"
    # A checkpoint commit goes ahead of bulk (the reporter sends nothing behind it); reading the list does not.
    assert http.classify("/api/v1/jobs/3/checkpoints", "POST") == "priority"
    assert http.classify("/api/v1/jobs/3/checkpoints", "GET") == "other"
    assert http.classify(SUBMIT, "POST") == http.classify(DRAIN, "POST") == "operator"
    assert http.classify(SUBMIT) == http.classify("/api/v1/jobs/3/cancel", "GET") == "other"
    assert not set(OPERATOR_URLS) & set(WITNESS_URLS)  # an operator's request proves no node alive
    # The gate is off by default (not yet measured by bench.fleet); with a width it is the settings'.
    assert http.gate is None and settings.NIGHTWATCH["ADMISSION_WIDTH"] == 0
    assert controlplane_asgi.admission(Held()).gate is None
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "ADMISSION_WIDTH": 2, "ADMISSION_SHARE": 5}
    gate = controlplane_asgi.admission(Held()).gate
    assert gate is not None and (gate.width, gate.share) == (2, 5)


# --- the gate: the order admitted requests are served in ---------------------------------------------

class OneAtATime:
    """Django's thread as the gate sees it: serves the requests that reach it one at a time, each
    once the test says so (``step``), and records their paths in the order served."""

    def __init__(self):
        self.served: list[str] = []
        self.inside = 0
        self.most_inside = 0
        self.turns: asyncio.Queue[None] = asyncio.Queue()
        self.lock = asyncio.Lock()

    async def __call__(self, scope, receive, send):
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        try:
            async with self.lock:
                await self.turns.get()
                self.served.append(scope["path"])
        finally:
            self.inside -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.turns.put_nowait(None)


def gated(width=1, share=3, limit=32, reserve=4, urgent_reserve=2):
    django = OneAtATime()
    return django, Admission(django, limit=limit, reserve=reserve, urgent_reserve=urgent_reserve, retry_after_s=1,
                             urgent=URGENT_URLS, priority=PRIORITY_URLS, operator=OPERATOR_URLS, exempt=EXEMPT_URLS,
                             witnesses=WITNESS_URLS, carriers=CARRIER_URLS, width=width, share=share)


def test_the_gate_serves_urgent_first_then_heartbeats_three_to_one_with_bulk():
    """Bulk arrived first and in numbers, as at 1,024 nodes (telemetry held 12 of 16 slots and
    heartbeats were served 0.7 a second): behind the gate the exit report goes first, then three
    heartbeats for each bulk request while both wait, first come first served within each; bulk
    is not starved."""
    async def scenario():
        django, app = gated(width=1, share=3)
        first = asyncio.create_task(call(app, REPORTS))  # inside already, when the rest arrive
        await until(lambda: django.inside == 1)
        bulk = [asyncio.create_task(call(app, f"/api/v1/jobs/{n}/reports")) for n in range(10, 14)]
        beats = [asyncio.create_task(call(app, f"/api/v1/nodes/{n}/heartbeat")) for n in range(20, 27)]
        await until(lambda: app.gate.waiting() == 11)
        exit_report = asyncio.create_task(call(app, EVENTS))
        await until(lambda: app.gate.waiting() == 12)
        django.step(13)
        await asyncio.gather(first, *bulk, *beats, exit_report)
        assert django.served == [
            REPORTS, EVENTS,
            "/api/v1/nodes/20/heartbeat", "/api/v1/nodes/21/heartbeat", "/api/v1/nodes/22/heartbeat",
            "/api/v1/jobs/10/reports",
            "/api/v1/nodes/23/heartbeat", "/api/v1/nodes/24/heartbeat", "/api/v1/nodes/25/heartbeat",
            "/api/v1/jobs/11/reports",
            "/api/v1/nodes/26/heartbeat", "/api/v1/jobs/12/reports", "/api/v1/jobs/13/reports",
        ]
        assert django.most_inside == 1 and app.gate.inside == 0 and app.counters.in_flight == 0

    asyncio.run(scenario())


def test_the_gate_lets_width_requests_in_and_an_operators_action_waits_with_the_heartbeats():
    async def scenario():
        django, app = gated(width=2, share=1)
        inside = [asyncio.create_task(call(app, REPORTS)) for _ in range(2)]
        await until(lambda: django.inside == 2)
        waiting = [asyncio.create_task(call(app, path)) for path in (CHECKPOINTS, SUBMIT, HEARTBEAT)]
        await until(lambda: app.gate.waiting() == 3)
        django.step(5)
        await asyncio.gather(*inside, *waiting)
        # One of the heartbeats' lane (the operator's submit, the heartbeat) for each bulk one.
        assert django.served[2:] == [SUBMIT, CHECKPOINTS, HEARTBEAT]
        assert django.most_inside == 2

    asyncio.run(scenario())


def test_a_caller_that_goes_away_while_waiting_gives_its_turn_back():
    """A request cancelled at the gate (its client gone) leaves no place taken: the next one goes
    in, and the bound's count comes back to zero."""
    async def scenario():
        django, app = gated(width=1)
        first = asyncio.create_task(call(app, REPORTS))
        await until(lambda: django.inside == 1)
        gone = asyncio.create_task(call(app, HEARTBEAT))
        later = asyncio.create_task(call(app, CHECKPOINTS))
        await until(lambda: app.gate.waiting() == 2)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        django.step(2)
        await asyncio.gather(first, later)
        assert django.served == [REPORTS, CHECKPOINTS]
        assert app.gate.inside == 0 and app.gate.waiting() == 0 and app.counters.in_flight == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("width, share", [(0, 3), (2, 0)])
def test_a_gate_that_cannot_work_is_refused_at_start(width, share):
    from core.admission import Gate

    with pytest.raises(ValueError):
        Gate(width, share)


def test_a_long_poll_gives_its_slot_back_once_it_waits_and_only_a_long_poll_can():
    """An agent's command wait is admitted as bulk and holds its place while it is authorised; once
    it waits (``RELEASE``) it is neither in flight nor in the gate, so a fleet of waiting agents never
    fills the bound. A request of another URL finds no ``RELEASE`` in its scope."""
    from core.admission import RELEASE

    class Polls:
        def __init__(self):
            self.waiting, self.answer, self.scopes = 0, asyncio.Event(), []

        async def __call__(self, scope, receive, send):
            self.scopes.append(scope)
            if RELEASE in scope:
                scope[RELEASE]()
                scope[RELEASE]()  # twice is once
                self.waiting += 1
                await self.answer.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

    async def scenario():
        polls = Polls()
        app = Admission(polls, limit=3, reserve=1, retry_after_s=1, priority=PRIORITY_URLS, width=1,
                        long_polls=controlplane_asgi.LONG_POLL_URLS)
        waits = [asyncio.create_task(call(app, f"/api/v1/nodes/{n}/commands/wait", method="GET")) for n in range(8)]
        await until(lambda: polls.waiting == 8)
        assert app.counters.in_flight == 0 and app.gate.inside == 0
        assert (await call(app, REPORTS))["status"] == 200  # bulk still finds its slots and the gate open
        assert RELEASE not in polls.scopes[-1]
        polls.answer.set()
        assert [a["status"] for a in await asyncio.gather(*waits)] == [200] * 8
        assert app.counters.in_flight == 0 and app.counters.admitted["other"] == 9

    asyncio.run(scenario())
