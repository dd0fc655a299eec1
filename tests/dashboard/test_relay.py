"""The relay and the consumers: committed rows become pushes to the right groups, coalesced, and
each browser gets a snapshot on connect and sections rendered for its own role."""

from __future__ import annotations

import time

import pytest
from asgiref.sync import async_to_sync

from agents.protocol import hooks as wire
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db


def report_batch(job, steps, *, ranks=(0, 1), spike_at=(), skipped_at=()):
    return wire.ReportBatch(job=str(job.pk), generation=job.generation, reports=[
        wire.StepReport(job=str(job.pk), generation=job.generation, rank=rank, step=step, loss=3.0 - step * 0.01 + rank,
                        grad_norm=1.5, world_size=job.nnodes * job.nproc_per_node, data_cursor=step * 8, samples=4,
                        phases={"input": 0.01, "compute": 0.05 * (2 if rank == 1 and step % 2 else 1),
                                "optimizer": 0.02},
                        spike=step in spike_at, skipped=step in skipped_at, time=time.time())
        for step in steps for rank in ranks])


@pytest.fixture
def running_job(cast):
    from jobs import services

    services.start_job(cast.job, actor="test")
    cast.job.refresh_from_db()
    return cast.job


class Sent(list):
    async def __call__(self, group, message):
        self.append((group, message))


def test_reports_and_events_reach_the_job_and_cluster_groups(running_job, cast):
    from dashboard.relay import Relay
    from jobs import ingest
    from nodes.services import drain_node

    relay, sent = Relay(min_gap_s=0, lease=False), Sent()
    relay.mark_now()
    ingest.record_reports(running_job, report_batch(running_job, [1, 2, 3], spike_at={2}), actor="node:gpu-01")
    drain_node(cast.node2, actor="user:otto", reason="fan")
    relay.collect()
    async_to_sync(relay.flush)(sent)
    by_group = {group: message for group, message in sent}
    job_message = by_group[f"job.{running_job.pk}"]
    assert [(p["step"], p["rank"], p["spike"]) for p in job_message["points"]] == [(1, 0, False), (2, 0, True),
                                                                                   (3, 0, False)]
    # The first step moved the job to running: a state event, so the banner, timeline and chart markers refresh.
    assert {"banner", "timeline", "summary", "skew", "chart"} <= set(job_message["sections"])
    assert {"jobs", "grid", "health"} <= set(by_group["cluster"]["sections"])
    # The heat map is not re-rendered for a node's change: the node's own block is sent.
    assert "heatmap" not in by_group["cluster"]["sections"] and by_group["cluster"]["nodes"] == [cast.node2.pk]
    relay.collect()
    sent.clear()
    async_to_sync(relay.flush)(sent)
    assert sent == []  # nothing new, nothing sent


def test_a_fast_reporter_is_coalesced_to_a_few_messages_a_second(running_job):
    from dashboard.relay import Relay
    from jobs import ingest

    relay, sent = Relay(min_gap_s=0.25, lease=False), Sent()
    relay.mark_now()
    for step in range(1, 11):  # ten report batches within a tenth of a second
        ingest.record_reports(running_job, report_batch(running_job, [step], ranks=(0,)), actor="node:gpu-01")
        relay.collect()
        async_to_sync(relay.flush)(sent, now=1000 + step / 100)
    job_messages = [m for g, m in sent if g == f"job.{running_job.pk}"]
    assert len(job_messages) == 1  # the first went at once; the rest wait for the group's next turn
    async_to_sync(relay.flush)(sent, now=1000.2)
    assert len([m for g, m in sent if g == f"job.{running_job.pk}"]) == 1
    async_to_sync(relay.flush)(sent, now=1000.3)
    job_messages = [m for g, m in sent if g == f"job.{running_job.pk}"]
    assert len(job_messages) == 2
    assert [p["step"] for m in job_messages for p in m["points"]] == list(range(1, 11))


def test_step_sections_ride_along_with_points_and_never_hold_a_point_back(running_job):
    """The step count and skew grid change with every report, at most once a second. Sent alone as soon
    as they were due, they took the group's turn just before the next point, which then waited out
    the gap: at a step a second, the p95 of a point's time in the relay was 200-250 ms."""
    from dashboard.relay import SLOW_ALONE_S, Relay
    from jobs import ingest

    relay, sent = Relay(min_gap_s=0.25, lease=False), Sent()
    relay.mark_now()
    group = f"job.{running_job.pk}"

    def step(number, now):
        ingest.record_reports(running_job, report_batch(running_job, [number], ranks=(0,)), actor="node:gpu-01")
        relay.collect()
        async_to_sync(relay.flush)(sent, now=now)

    def messages():
        return [m for g, m in sent if g == group]

    step(1, 1000.0)  # the first: points and the step sections together
    assert [p["step"] for p in messages()[-1]["points"]] == [1] and "skew" in messages()[-1]["sections"]
    step(2, 1000.8)  # within a second of the last render: the point alone, the sections wait
    assert [p["step"] for p in messages()[-1]["points"]] == [2] and "skew" not in messages()[-1]["sections"]
    for now in (1001.0, 1001.05):  # due now, but they wait for the next point instead of taking its turn
        async_to_sync(relay.flush)(sent, now=now)
    assert len(messages()) == 2
    step(3, 1001.1)
    assert [p["step"] for p in messages()[-1]["points"]] == [3] and "skew" in messages()[-1]["sections"]
    step(4, 1001.5)  # the sections wait again, and this time no point comes for a while
    async_to_sync(relay.flush)(sent, now=1001.1 + SLOW_ALONE_S)
    assert messages()[-1]["points"] == [] and "skew" in messages()[-1]["sections"]  # alone, at last
    step(5, 1001.15 + SLOW_ALONE_S)  # 50 ms after them: not held back by the gap
    assert [p["step"] for p in messages()[-1]["points"]] == [5]


def test_one_web_process_relays_at_a_time(settings):
    """With Redis, the relays of several web processes share one lease: duplicates never reach browsers."""
    from dashboard.relay import Relay

    assert settings.REDIS_URL, "this test needs REDIS_URL"
    first, second = Relay(), Relay()
    try:
        assert first._lead() and not second._lead()
        first._release()
        assert second._lead()
    finally:
        first._release()
        second._release()


def test_the_lease_is_renewed_every_second_not_at_every_read(settings):
    """Renewed this recently, the lease holds for two more seconds: no other process can have it, so
    the reads in between ask Redis nothing (three round trips each, 20 reads a second, before every
    push). Past the interval the relay asks again, and finds out what happened meanwhile."""
    import redis

    from dashboard.relay import LEASE_KEY, Relay

    assert settings.REDIS_URL, "this test needs REDIS_URL"
    client = redis.Redis.from_url(settings.REDIS_URL)
    relay = Relay(lease=True, renew_every_s=1.0)  # long enough for the next line on a loaded machine
    try:
        assert relay._lead()
        client.set(LEASE_KEY, "another-process", px=3000)  # as if it had expired and been taken
        assert relay._lead(), "within the interval: not asked"
        wait_for(lambda: not relay._lead(), timeout=5, what="the relay to ask Redis again")
        assert relay.leading is False
    finally:
        client.delete(LEASE_KEY)
        relay._release()


def _communicator(path, user):
    from channels.routing import URLRouter
    from channels.testing import WebsocketCommunicator

    from controlplane.routing import websocket_urlpatterns

    communicator = WebsocketCommunicator(URLRouter(websocket_urlpatterns), path)
    communicator.scope["user"] = user
    return communicator


@pytest.mark.django_db(transaction=True)
def test_consumers_refuse_strangers_and_snapshot_on_connect(running_job, cast):
    from django.contrib.auth.models import AnonymousUser, User

    from dashboard.relay import RELAY

    nobody = User.objects.create_user("nobody")

    async def scenario():
        for user, code in [(AnonymousUser(), 4401), (nobody, 4403)]:
            communicator = _communicator("/ws/dashboard/overview/", user)
            connected, close_code = await communicator.connect()
            assert not connected and close_code == code
        communicator = _communicator("/ws/dashboard/jobs/999999/", cast.viewer)
        assert (await communicator.connect()) == (False, 4404)

        communicator = _communicator(f"/ws/dashboard/jobs/{running_job.pk}/", cast.viewer)
        connected, _ = await communicator.connect()
        assert connected
        snapshot = await communicator.receive_json_from(timeout=10)
        assert snapshot["type"] == "snapshot" and snapshot["page"] == "job"
        assert set(snapshot["html"]) == {"summary", "banner", "skew", "timeline", "incidents", "lineage", "logs"}
        assert snapshot["chart"]["job"] == running_job.pk
        # A push to the job's group comes back as an update with the sections rendered for a viewer.
        from channels.layers import get_channel_layer

        await get_channel_layer().group_send(f"job.{running_job.pk}", {
            "type": "dashboard.push", "id": "test-1", "job": running_job.pk, "sections": ["summary", "grid"],
            "points": [{"step": 9, "generation": 1, "rank": 0, "loss": 1.0, "grad_norm": None, "spike": False,
                        "skipped": False, "nan": False}], "relayed_at": time.time()})
        points = await communicator.receive_json_from(timeout=10)  # first, not waiting for the render
        assert points["type"] == "update" and points["points"][0]["step"] == 9 and points["html"] == {}
        update = await communicator.receive_json_from(timeout=10)
        assert update["type"] == "update" and list(update["html"]) == ["summary"] and update["points"] == []
        assert 'class="act' not in update["html"]["summary"]
        await communicator.disconnect()
        await RELAY.stop()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_points_never_wait_behind_a_render_and_changes_meanwhile_are_rendered_once(running_job, cast, monkeypatch):
    """A consumer gets its pushes one at a time: a slow render of a big job's page must not hold the
    next push's chart points back (at 1,024 nodes the live push's p95 was the page's render time)."""
    import threading

    from channels.layers import get_channel_layer

    from dashboard.consumers import DashboardConsumer
    from dashboard.relay import RELAY

    release, rendered = threading.Event(), []
    real_render = DashboardConsumer._render

    def slow_render(self, message):
        rendered.append(sorted(message["sections"]))
        assert release.wait(10), "the test never released the render"
        return real_render(self, message)

    monkeypatch.setattr(DashboardConsumer, "_render", slow_render)

    def push(number, sections, steps):
        return get_channel_layer().group_send(f"job.{running_job.pk}", {
            "type": "dashboard.push", "id": f"test-{number}", "job": running_job.pk, "sections": sections,
            "points": [{"step": step, "generation": 1, "rank": 0, "loss": 1.0, "grad_norm": None, "spike": False,
                        "skipped": False, "nan": False} for step in steps], "relayed_at": time.time()})

    async def scenario():
        communicator = _communicator(f"/ws/dashboard/jobs/{running_job.pk}/", cast.viewer)
        assert (await communicator.connect())[0]
        await communicator.receive_json_from(timeout=10)  # the snapshot
        await push(1, ["summary"], [9])
        assert [p["step"] for p in (await communicator.receive_json_from(timeout=10))["points"]] == [9]
        await push(2, ["banner"], [10])  # the first render still holds its thread
        await push(3, ["timeline"], [11])
        for step in (10, 11):  # each push's points at once, while the render is still held
            frame = await communicator.receive_json_from(timeout=10)
            assert [p["step"] for p in frame["points"]] == [step] and frame["html"] == {}
        release.set()
        first = await communicator.receive_json_from(timeout=10)
        second = await communicator.receive_json_from(timeout=10)
        assert list(first["html"]) == ["summary"] and sorted(second["html"]) == ["banner", "timeline"]
        assert rendered == [["summary"], ["banner", "timeline"]]  # the two later pushes: one render
        await communicator.disconnect()
        await RELAY.stop()

    async_to_sync(scenario)()


def test_a_shared_render_whose_consumer_goes_away_is_rendered_by_the_next(monkeypatch):
    """Consumers of the same page and role share one render per push; when the one rendering it
    disconnects (its task cancelled), the others must not wait for it forever: one renders itself."""
    import asyncio
    import threading

    from dashboard import consumers

    release, calls = threading.Event(), []

    def render(self, message):
        calls.append(self.name)
        assert release.wait(10), "the test never released the render"
        return {"summary": f"by {self.name}"}, None, {}

    monkeypatch.setattr(consumers.DashboardConsumer, "_render", render)

    def consumer(name):
        made = consumers.JobConsumer()
        made.name, made.job_id, made.node_id, made.caps, made.filter = name, 1, None, frozenset({"view"}), None
        return made

    async def scenario():
        first, second = consumer("first"), consumer("second")
        message = {"id": "shared-1", "sections": ["summary"], "nodes": []}
        owner = asyncio.create_task(first._rendered(message))
        await until(lambda: calls == ["first"])
        waiter = asyncio.create_task(second._rendered(message))
        await asyncio.sleep(0)  # one turn of the loop: the waiter reaches its await of the shared render
        owner.cancel()  # the first browser went away mid-render
        await until(lambda: calls == ["first", "second"])
        release.set()
        assert await asyncio.wait_for(waiter, 10) == ({"summary": "by second"}, None, {})

    async def until(predicate):
        async with asyncio.timeout(10):
            while not predicate():
                await asyncio.sleep(0.01)

    asyncio.run(scenario())
