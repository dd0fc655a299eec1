"""The nodes page at fleet size: the GPU heat map of every node, the filtered and paged table,
and the live socket rendering the same filter."""

from __future__ import annotations

import time

import pytest
from django.utils import timezone

from dashboard import fleet

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet_of(cast):
    """``fleet_of(n)``: n more nodes gpu-0000.. with 8 healthy GPUs each; returns them."""
    from nodes.models import GPU, Node

    def make(n: int, **fields):
        now = timezone.now()
        nodes = Node.objects.bulk_create([Node(hostname=f"gpu-{i:04d}", address=f"10.0.{i // 250}.{i % 250}",
                                               health="healthy", last_heartbeat_at=now, **fields) for i in range(n)])
        GPU.objects.bulk_create([GPU(node=node, index=g, health="healthy", last_sample_at=now,
                                     last_sample={"temperature_c": 50.0}) for node in nodes for g in range(8)])
        return nodes

    return make


def test_a_thousand_nodes_render_every_gpu_in_the_heat_map_and_one_page_of_the_table(
        signed_in, cast, fleet_of, django_assert_max_num_queries):
    from nodes.models import Node

    nodes = fleet_of(1024)
    Node.objects.filter(pk=nodes[700].pk).update(health="unhealthy")
    client = signed_in(cast.viewer)
    client.get("/nodes/")  # the session and the user's permissions are loaded once
    with django_assert_max_num_queries(16):
        body = client.get("/nodes/").content.decode()
    assert body.count('class="hm-node') == Node.objects.count()
    assert body.count("<i class=") == 8 * 1024 + 2  # cast's two nodes have no GPU: a grey cell each
    assert body.count('<tr data-node="') == fleet.PAGE_NODES
    # The node that wants attention comes first, on page 1 of 21.
    assert body.index('<tr data-node="gpu-0700"') < body.index('<tr data-node="gpu-0000"')
    assert "page 1 of 21" in body and 'href="?page=2"' in body
    assert len(body) < 600_000


def test_search_health_lemon_label_and_paging_narrow_the_table(signed_in, cast, fleet_of):
    from nodes.models import Node

    nodes = fleet_of(120)
    Node.objects.filter(pk=nodes[3].pk).update(lemon_count=2, labels={"rack": "r7", "in": "x"})
    Node.objects.filter(pk__in=[nodes[5].pk, nodes[6].pk]).update(health="unreachable")
    client = signed_in(cast.viewer)

    def rows(query: str) -> list[str]:
        body = client.get(f"/nodes/?{query}").content.decode()
        return [part.split('"')[0] for part in body.split('<tr data-node="')[1:]]

    assert rows("q=gpu-011") == [f"gpu-{i:04d}" for i in range(110, 120)]
    assert rows("health=unreachable") == ["gpu-0005", "gpu-0006"]
    assert rows("lemon=1") == ["gpu-0003"] == rows("label=rack%3Dr7")
    assert rows("label=rack%3Dr8") == [] and "No node matches." in client.get("/nodes/?q=nothing").content.decode()
    assert len(rows("page=3")) == 120 + 2 - 2 * fleet.PAGE_NODES  # cast's two nodes too
    assert rows("page=99") == rows("page=3")  # past the end: the last page
    # Nonsense is ignored, not an error; a label key is a key, even one named like a lookup.
    assert client.get("/nodes/?health=purple&page=-4&label=x&job=abc&colour=mauve&group=a__b").status_code == 200
    for key in ("in", "contains", "isnull", "a__b"):
        assert rows(f"label={key}%3Dr7") == []
    assert rows("label=in%3Dx") == ["gpu-0003"]


def test_the_heat_map_colours_by_a_reading_groups_by_a_label_and_follows_a_job(signed_in, cast, fleet_of):
    from jobs.models import Generation
    from nodes.models import GPU, Node

    nodes = fleet_of(24)
    for i, node in enumerate(nodes):
        Node.objects.filter(pk=node.pk).update(labels={"rack": f"r{i % 3}"})
    GPU.objects.filter(node=nodes[0], index=0).update(last_sample={"temperature_c": 91.0})
    GPU.objects.filter(node=nodes[0], index=1).update(last_sample={})
    job = cast.job
    job.generation = 2
    job.save(update_fields=["generation"])
    Generation.objects.create(job=job, number=1, world_size=8, ended_at=timezone.now()).nodes.set(nodes[:4])
    Generation.objects.create(job=job, number=2, world_size=8).nodes.set(nodes[4:6])
    client = signed_in(cast.viewer)

    hot = client.get("/nodes/?colour=temperature&q=gpu-0000").content.decode()
    heat = hot[hot.index('id="gpu-heatmap"'):]
    assert 'class="heatmap by-temperature' in hot and heat.count('<i class="c4">') == 1
    assert heat.count('<i class="cx">') == 1 and heat.count('<i class="c1">') == 6  # 50 °C: the second step

    grouped = client.get("/nodes/?group=rack").content.decode()
    assert [part.split('"')[0] for part in grouped.split('data-group="')[1:]] == ["r0", "r1", "r2", "—"]
    assert "rack=r1 <span class=\"muted\">8</span>" in grouped

    live = client.get(f"/nodes/?job={job.pk}").content.decode()
    assert [part.split('"')[0] for part in live.split('<tr data-node="')[1:]] == ["gpu-0004", "gpu-0005"]


@pytest.mark.django_db(transaction=True)
def test_a_node_change_sends_its_heat_map_block_not_the_map(cast, fleet_of):
    """1,024 nodes: a drained node reaches a nodes page as one block (~300 bytes), not the ~300 KB map;
    a page whose filter no longer keeps the node is told to drop it."""
    from asgiref.sync import async_to_sync
    from channels.db import database_sync_to_async
    from channels.layers import get_channel_layer
    from channels.routing import URLRouter
    from channels.testing import WebsocketCommunicator

    from controlplane.routing import websocket_urlpatterns
    from dashboard import events
    from dashboard.relay import RELAY
    from nodes.models import Node

    nodes = fleet_of(1022)
    changed = nodes[500]
    turn_unhealthy = database_sync_to_async(lambda: Node.objects.filter(pk=changed.pk).update(health="unhealthy"))

    async def scenario():
        pages = {}
        for name, query in (("all", ""), ("healthy", "?health=healthy")):
            pages[name] = WebsocketCommunicator(URLRouter(websocket_urlpatterns), f"/ws/dashboard/nodes/{query}")
            pages[name].scope["user"] = cast.viewer
            assert (await pages[name].connect())[0]
            await pages[name].receive_json_from(timeout=10)  # the snapshot
        await turn_unhealthy()
        await get_channel_layer().group_send(events.CLUSTER_GROUP, events.push_message(
            message_id="t-1", job_id=None, points=[], sections=["health", "grid"], nodes=[changed.pk],
            relayed_at=time.time()))
        frames = {name: await page.receive_json_from(timeout=10) for name, page in pages.items()}
        for page in pages.values():
            await page.disconnect()
        await RELAY.stop()
        return frames

    frames = async_to_sync(scenario)()
    block = frames["all"]["cells"][str(changed.pk)]
    assert "heatmap" not in frames["all"]["html"] and 'class="hm-node n-unhealthy' in block and len(block) < 600
    assert frames["healthy"]["cells"] == {str(changed.pk): None}


@pytest.mark.django_db(transaction=True)
def test_the_socket_renders_the_filter_of_its_page(cast, fleet_of):
    from asgiref.sync import async_to_sync
    from channels.routing import URLRouter
    from channels.testing import WebsocketCommunicator

    from controlplane.routing import websocket_urlpatterns
    from dashboard.relay import RELAY

    fleet_of(60)

    async def snapshot(path: str) -> dict:
        communicator = WebsocketCommunicator(URLRouter(websocket_urlpatterns), path)
        communicator.scope["user"] = cast.viewer
        assert (await communicator.connect())[0]
        frame = await communicator.receive_json_from(timeout=10)
        await communicator.disconnect()
        await RELAY.stop()  # the connect started it: it must not outlive the test
        return frame

    frame = async_to_sync(snapshot)("/ws/dashboard/nodes/?q=gpu-004&health=healthy")
    assert set(frame["html"]) == {"health", "heatmap", "grid"}
    assert frame["html"]["grid"].count('<tr data-node="') == 10
    assert frame["html"]["heatmap"].count('class="hm-node') == 10  # the heat map shows what the filter keeps
