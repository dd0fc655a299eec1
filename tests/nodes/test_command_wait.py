"""The command wait (``nodes.services.wake``, ``GET nodes/<id>/commands/wait``): an agent's long
poll answered as soon as a command for its node is committed, by whichever process, and only then.

Transactional: the watch reads the command table from a thread of its own, with its own database
connection, as it does in the web process, so it sees only what was committed.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from nodes.services import wake
from nodes.services.commands import enqueue_command, pending_commands_for
from nodes.services.wake import CommandWatch
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def watch():
    watch = CommandWatch(interval_s=0.02, idle_stop_s=0.5)
    yield watch
    watch.stop()


def drain(node):
    return enqueue_command(node, "drain", payload={"reason": "test"}, actor="test")


async def until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def test_a_wait_is_answered_when_a_command_for_its_node_is_committed_and_not_for_another(cast, watch):
    async def scenario() -> float:
        waiting = asyncio.create_task(watch.wait(cast.node1.pk, 10))
        await until(lambda: cast.node1.pk in watch.waiters)
        await sync_to_async(drain)(cast.node2)
        turns = 10
        await asyncio.sleep(turns * watch.interval_s)  # the watch read the other node's command by now
        assert not waiting.done()
        queued = time.monotonic()
        await sync_to_async(drain)(cast.node1)
        assert await asyncio.wait_for(waiting, 5) is True
        return time.monotonic() - queued

    assert async_to_sync(scenario)() < 0.5
    assert watch.waiters == {}


def test_a_command_already_pending_answers_at_once_and_a_delivered_one_does_not(cast, watch):
    drain(cast.node1)

    async def scenario() -> tuple[bool, float, bool]:
        started = time.monotonic()
        first = await watch.wait(cast.node1.pk, 5)
        took = time.monotonic() - started
        await sync_to_async(pending_commands_for)(cast.node1)  # a heartbeat took it: delivered
        return first, took, await watch.wait(cast.node1.pk, 0.3)

    first, took, after_delivery = async_to_sync(scenario)()
    assert first is True and took < 0.5
    assert after_delivery is False  # the timeout passed with nothing new


def test_every_waiting_request_of_the_node_is_answered(cast, watch):
    async def scenario() -> list[bool]:
        waits = [asyncio.create_task(watch.wait(cast.node1.pk, 10)) for _ in range(3)]
        await until(lambda: len(watch.waiters.get(cast.node1.pk, ())) == 3)
        await sync_to_async(drain)(cast.node1)
        return await asyncio.wait_for(asyncio.gather(*waits), 5)

    assert async_to_sync(scenario)() == [True, True, True]


def test_the_endpoint_answers_the_node_s_own_agent(cast, api):
    drain(cast.node1)
    response = api(cast.tokens["agent"]).get(f"/api/v1/nodes/{cast.node1.pk}/commands/wait?timeout=5")
    assert response.status_code == 200 and response.json() == {"commands": True}


@pytest.mark.parametrize(("who", "query", "status", "field"), [
    ("agent", "?timeout=0", 400, "timeout"),
    ("agent", "?timeout=56", 400, "timeout"),
    ("agent", "?timeout=nan", 400, "timeout"),
    ("agent", "?timeout=soon", 400, "timeout"),
    ("agent2", "", 403, None),  # another node's agent
    ("operator", "", 403, None),  # a person's token holds no agent capability
    (None, "", 401, None),
])
def test_the_endpoint_refuses_with_problem_details(cast, api, who, query, status, field):
    response = api(cast.tokens[who] if who else None).get(f"/api/v1/nodes/{cast.node1.pk}/commands/wait{query}")
    assert response.status_code == status
    assert response["Content-Type"] == "application/problem+json"
    if field:
        assert [error["field"] for error in response.json()["errors"]] == [field]


def test_only_get_waits(cast, api):
    response = api(cast.tokens["agent"]).post(f"/api/v1/nodes/{cast.node1.pk}/commands/wait", {}, format="json")
    assert response.status_code == 405 and response["Content-Type"] == "application/problem+json"


def test_a_waiting_request_holds_no_database_connection(cast, live_server):
    """A thousand waiting agents must not hold a thousand connections (a pool of DB_POOL_MAX_SIZE
    would run dry): the request's connection is given back before it waits."""
    import threading
    import urllib.request

    from django.db import connection

    def sessions() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
            return cursor.fetchone()[0]

    def wait() -> None:
        request = urllib.request.Request(  # noqa: S310 - the test's own server
            f"{live_server.url}/api/v1/nodes/{cast.node1.pk}/commands/wait?timeout=8",
            headers={"Authorization": f"Bearer {cast.tokens['agent']}"})
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - the test's own server
            answers.append(response.read())

    before, answers = sessions(), []
    waiting = [threading.Thread(target=wait) for _ in range(6)]
    for thread in waiting:
        thread.start()

    async def registered() -> None:
        await until(lambda: len(wake.WATCH.waiters.get(cast.node1.pk, ())) == 6)

    async_to_sync(registered)()
    # Each request authorised itself and read the queue first: its connection is given back once
    # it starts waiting (plus the watch's own connection, and slack for one request finishing).
    wait_for(lambda: sessions() <= before + 2, timeout=4, what="the waiting requests' connections to go back")
    assert not answers  # still waiting
    for thread in waiting:
        thread.join(timeout=15)
    assert answers == [b'{"commands": false}'] * 6
