"""Redis down: the cache falls back to process memory, Celery messages wait in the outbox, the
relay keeps what it could not push; each fallback is counted (``core.degraded``)."""

from __future__ import annotations

import time

import pytest

from tests.ports import free_port


@pytest.fixture(autouse=True)
def fresh_counts():
    from core import degraded

    degraded.reset()
    yield
    degraded.reset()


def _cache(url: str):
    from core.cache import ResilientRedisCache

    return ResilientRedisCache(url, {"KEY_PREFIX": "nw-test", "OPTIONS": {"socket_connect_timeout": 0.5,
                                                                          "socket_timeout": 0.5}})


def test_a_cache_whose_redis_is_down_counts_in_memory_and_answers_at_once():
    from core import degraded

    cache = _cache(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    started = time.monotonic()
    assert cache.get("k") is None
    assert cache.add("k", 1, timeout=60) is True
    assert cache.incr("k") == 2
    assert cache.get("k") == 2
    with pytest.raises(ValueError):  # the same contract as Redis: incr of a missing key
        cache.incr("missing")
    assert time.monotonic() - started < 2, "one short connect timeout at most, then the circuit skips Redis"
    assert degraded.counts() == {"cache": 1} and degraded.down("cache")


def test_a_cache_whose_redis_answers_uses_it(settings):
    from core import degraded

    cache = _cache(settings.REDIS_URL or "redis://127.0.0.1:6379/5")
    cache.set("shared", 7, timeout=30)
    assert cache.fallback.get("shared") is None and cache.get("shared") == 7
    cache.delete("shared")
    assert degraded.counts() == {}


@pytest.mark.django_db
def test_a_message_the_broker_refuses_is_held_and_sent_later_in_order(monkeypatch):
    from celery import Task
    from kombu.exceptions import OperationalError

    from controlplane.celery import app
    from core import degraded, outbox
    from core.models import OutboxMessage
    from jobs.tasks import confirm_stopped, handle_exit

    def broker_down(self, *args, **kwargs):
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(Task, "apply_async", broker_down)
    handle_exit.delay(7, 2, "gpu-01", {"exit_code": 1})
    confirm_stopped.apply_async((7, 2, "gpu-01"), countdown=3)
    assert list(OutboxMessage.objects.values_list("task", "args", "options")) == [
        ("jobs.tasks.handle_exit", [7, 2, "gpu-01", {"exit_code": 1}], {}),
        ("jobs.tasks.confirm_stopped", [7, 2, "gpu-01"], {"countdown": 3})]
    assert degraded.counts() == {"broker": 2}

    sent = []
    monkeypatch.setattr(app, "send_task", lambda name, args, kwargs, **options: sent.append((name, args, options)))
    monkeypatch.setattr(outbox, "current_app", app)
    assert outbox.resend() == 2
    assert [name for name, _, _ in sent] == ["jobs.tasks.handle_exit", "jobs.tasks.confirm_stopped"]
    assert sent[1][2] == {"countdown": 3} and not OutboxMessage.objects.exists()


@pytest.mark.django_db
def test_resend_stops_at_the_first_failure_and_keeps_the_rest(monkeypatch):
    from controlplane.celery import app
    from core import outbox
    from core.models import OutboxMessage

    for n in range(3):
        OutboxMessage.objects.create(task="jobs.tasks.advance_job", args=[n])
    calls = []

    def flaky(name, args, kwargs, **options):
        calls.append(args[0])
        if len(calls) == 2:
            raise ConnectionError("gone again")

    monkeypatch.setattr(app, "send_task", flaky)
    monkeypatch.setattr(outbox, "current_app", app)
    assert outbox.resend() == 1
    assert list(OutboxMessage.objects.values_list("args", flat=True)) == [[1], [2]]


def test_periodic_messages_are_not_held(monkeypatch):
    """A message with an expiry (beat's) is replaced by the next run: it fails as before, unheld."""
    from celery import Task
    from kombu.exceptions import OperationalError

    from jobs.tasks import sweep

    def broker_down(self, *args, **kwargs):
        raise OperationalError("down")

    monkeypatch.setattr(Task, "apply_async", broker_down)
    with pytest.raises(OperationalError):
        sweep.apply_async(expires=30)


@pytest.mark.django_db
def test_the_relay_keeps_what_the_channel_layer_did_not_take(cast):
    from asgiref.sync import async_to_sync

    from core import degraded
    from dashboard.relay import Relay
    from nodes.services import drain_node

    relay = Relay(min_gap_s=0, lease=False)
    relay.mark_now()
    drain_node(cast.node2, actor="user:otto", reason="fan")
    relay.collect()

    async def layer_down(group, message):
        raise ConnectionError("Redis is down")

    assert async_to_sync(relay.flush)(layer_down) == 0
    assert degraded.counts() == {"channel_layer": 1}
    sent = []

    async def layer_up(group, message):
        sent.append((group, message))

    assert async_to_sync(relay.flush)(layer_up, now=time.monotonic() + 5) >= 1
    cluster = dict(sent)["cluster"]
    assert cluster["nodes"] == [cast.node2.pk] and "health" in cluster["sections"]


@pytest.mark.django_db(transaction=True)
def test_a_page_opened_while_the_channel_layer_is_down_is_told_to_try_again(cast, settings):
    """Not a crash in the consumer: a close code the browser's reconnect (with its snapshot) handles."""
    from asgiref.sync import async_to_sync
    from channels.layers import channel_layers
    from channels.routing import URLRouter
    from channels.testing import WebsocketCommunicator

    from controlplane.routing import websocket_urlpatterns
    from core import degraded

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {
        "hosts": [{"address": f"redis://127.0.0.1:{free_port()}/0", "socket_connect_timeout": 0.5}]}}}
    channel_layers.backends.pop("default", None)
    try:
        async def scenario():
            communicator = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/dashboard/overview/")
            communicator.scope["user"] = cast.viewer
            return await communicator.connect(timeout=10)

        assert async_to_sync(scenario)() == (False, 1013)
        assert set(degraded.counts()) == {"channel_layer"}
    finally:
        channel_layers.backends.pop("default", None)


@pytest.mark.django_db
def test_the_relay_keeps_its_place_while_its_lease_cannot_be_renewed(settings):
    """What commits while Redis is down is pushed once it is back: losing the lease to an outage is not
    a takeover by another process, which would restart from the tables' ends."""
    from core import degraded
    from dashboard.relay import LEASE_KEY, Relay

    live_url = settings.REDIS_URL or "redis://127.0.0.1:6379/5"
    relay = Relay(lease=True, renew_every_s=0)  # asks Redis at every read
    relay.events.start_at(5)
    relay.metrics.start_at(7)
    settings.REDIS_URL = live_url
    assert relay._lead() is True
    relay._redis, settings.REDIS_URL = None, f"redis://127.0.0.1:{free_port()}/0"  # Redis goes away
    assert relay._lead() is False and relay.leading is True
    assert degraded.counts() == {"relay_lease": 1}
    relay._redis, settings.REDIS_URL = None, live_url  # and comes back (the lease expired meanwhile)
    relay._redis = None
    import redis

    redis.Redis.from_url(live_url).delete(LEASE_KEY)
    assert relay._lead() is True
    assert (relay.events.high, relay.metrics.high) == (5, 7), "kept its place"
    relay._release()


@pytest.mark.django_db
def test_fallbacks_and_held_messages_are_exported():
    from core import degraded
    from core.models import OutboxMessage
    from dashboard.metrics import NightwatchCollector

    degraded.note("cache", "Connection refused")
    degraded.note("broker", "Connection refused")
    OutboxMessage.objects.create(task="jobs.tasks.advance_job", args=[1])
    families = {f.name: f for f in NightwatchCollector._degraded()}
    fallbacks = {s.labels["component"]: s.value for s in families["nightwatch_redis_fallbacks"].samples
                 if s.name.endswith("_total")}
    assert fallbacks == {"broker": 1, "cache": 1}
    assert [s.value for s in families["nightwatch_outbox_messages"].samples] == [1]
