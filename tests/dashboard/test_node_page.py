"""A node's page: its GPUs now, their telemetry over an hour, a day or a week, the agent's evidence
and the audit log on one timeline, its generations, incidents and bandwidth probes, live."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from tests.nodes.conftest import sample

pytestmark = pytest.mark.django_db


def series_of(body: str) -> dict:
    start = body.index('<script id="node-series" type="application/json">') + len(
        '<script id="node-series" type="application/json">')
    return json.loads(body[start:body.index("</script>", start)])


@pytest.fixture
def busy_node(cast, api):
    """node1 with two GPUs: ten minutes of telemetry through the agent's endpoint ending in an Xid 79
    (the node turns unhealthy and the policy drains it), the agent's Xid event, a generation of
    cast.job, an incident that names it and a bandwidth probe."""
    from jobs.models import Generation, Incident
    from nodes.models import NodePairBandwidth

    node = cast.node1
    now = time.time()
    agent = api(cast.tokens["agent"])
    samples = [sample(node, gpu, now - 600 + 10 * i, temperature_c=50.0 + gpu * 10 + i % 3)
               for i in range(60) for gpu in (0, 1)]
    samples[-1] |= {"xid_recent": 1, "xid_total": 1, "recent_xid_codes": [79]}
    for index, total in ((-5, 0), (-3, 2), (-1, 2)):  # GPU 1's lifetime count rises by 2 one sample before
        samples[index] |= {"ecc_uncorrected_aggregate": total}
    assert agent.post(f"/api/v1/nodes/{node.pk}/telemetry", {"samples": samples}, format="json").status_code == 202
    agent.post(f"/api/v1/nodes/{node.pk}/events", {"events": [
        {"key": "xid-1", "kind": "xid", "time": now - 5, "detail": {"gpu": 1, "code": 79}}]}, format="json")
    Generation.objects.create(job=cast.job, number=1, world_size=16).nodes.add(node)
    Incident.objects.create(job=cast.job, kind="exit", classification="hardware: Xid 79").nodes.add(node)
    NodePairBandwidth.objects.create(source=node, peer=cast.node2, address="10.0.0.2", expected_mbps=1000, mbps=420,
                                     ok=False, measured_at=timezone.now())
    node.refresh_from_db()
    return node


def test_the_page_shows_the_gpus_the_timeline_the_history_and_an_hour_of_telemetry(
        signed_in, cast, busy_node, django_assert_max_num_queries):
    client = signed_in(cast.operator)
    client.get(f"/nodes/{busy_node.pk}/")
    with django_assert_max_num_queries(20):
        body = client.get(f"/nodes/{busy_node.pk}/").content.decode()
    assert 'id="node-gpus"' in body and body.count('<tr data-gpu="') == 2
    assert busy_node.schedulability != "active" and busy_node.drain_reason in body and ">Undrain</button>" in body
    activity = body[body.index('id="node-activity"'):body.index("</table>", body.index('id="node-activity"'))]
    assert "agent: xid" in activity and "GPU 1: Xid 79" in activity and "node.drain" in activity
    assert "telemetry: GPU errors" in activity and "uncorrectable ECC" in activity
    assert f"{cast.job.name}</a>" in body and "hardware: Xid 79" in body and "420 Mb/s" in body
    series = series_of(body)
    assert series["range"] == "hour" and series["gpus"] == 2 and len(series["t"]) == 60
    temperature = next(m for m in series["metrics"] if m["name"] == "temperature")
    assert [min(v) for v in temperature["values"]] == [50, 60]
    assert ">Undrain</button>" not in signed_in(cast.viewer).get(f"/nodes/{busy_node.pk}/").content.decode()


def test_a_day_and_a_week_come_from_the_minute_rollups(signed_in, cast, busy_node, time_machine):
    from nodes.models import NodeGpuMinute

    # The clock stands still: a minute that turned between writing the rollups and reading the
    # page moved the day's window by one (1,438 points in a run on a slow machine).
    start = datetime.now(UTC).replace(second=0, microsecond=0)
    time_machine.move_to(start + timedelta(seconds=30), tick=False)
    NodeGpuMinute.objects.filter(node=busy_node).delete()  # the telemetry's own minutes, rolled up on arrival
    NodeGpuMinute.objects.bulk_create([
        NodeGpuMinute(node=busy_node, minute=start - timedelta(minutes=m), gpus=0b11, samples=[6, 6],
                      temperature_mean=[40.0 + m % 20, 70.0], utilization_mean=[90.0, 95.0])
        for m in range(1, 3 * 24 * 60, 1)])
    client = signed_in(cast.viewer)
    day = series_of(client.get(f"/nodes/{busy_node.pk}/?range=day").content.decode())
    assert day["range"] == "day" and len(day["t"]) == 24 * 60 - 1
    week = series_of(client.get(f"/nodes/{busy_node.pk}/?range=week").content.decode())
    # Three days of minutes in 10-minute means: ~432 points, each the mean of its minutes.
    assert 430 <= len(week["t"]) <= 434 and all(t % 600 == 0 for t in week["t"])
    utilization = next(m for m in week["metrics"] if m["name"] == "utilization")
    assert {round(v) for v in utilization["values"][1] if v is not None} == {95}
    assert series_of(client.get(f"/nodes/{busy_node.pk}/?range=year").content.decode())["range"] == "hour"


def test_the_heat_map_and_the_table_link_to_the_node_page(signed_in, cast):
    body = signed_in(cast.viewer).get("/nodes/").content.decode()
    assert f'href="/nodes/{cast.node1.pk}/"' in body
    assert signed_in(cast.viewer).get("/nodes/999999/").status_code == 404


@pytest.mark.django_db(transaction=True)
def test_the_node_socket_snapshots_its_sections_and_refuses_an_unknown_node(cast):
    from asgiref.sync import async_to_sync
    from channels.routing import URLRouter
    from channels.testing import WebsocketCommunicator

    from controlplane.routing import websocket_urlpatterns
    from dashboard.relay import RELAY

    async def scenario():
        unknown = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/dashboard/nodes/999999/")
        unknown.scope["user"] = cast.viewer
        assert (await unknown.connect()) == (False, 4404)
        communicator = WebsocketCommunicator(URLRouter(websocket_urlpatterns), f"/ws/dashboard/nodes/{cast.node1.pk}/")
        communicator.scope["user"] = cast.viewer
        assert (await communicator.connect())[0]
        frame = await communicator.receive_json_from(timeout=10)
        await communicator.disconnect()
        await RELAY.stop()
        return frame

    frame = async_to_sync(scenario)()
    assert frame["page"] == "node" and set(frame["html"]) == {"node", "activity", "history"}
    assert cast.node1.hostname in frame["html"]["node"]
