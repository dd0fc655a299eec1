"""The cache backend for a Redis deployment that keeps answering while Redis is down.

The cache holds rate-limit counters (DRF throttles, failed-token counts: ``core.auth``) that every
web process shares through Redis. They are an optimisation, not a source of truth: with Redis down,
the same counters are kept in this process's memory instead (``LocMemCache``), so a limit still holds
per process, and the request is answered instead of failing with a 500. Each fallback is counted and
logged through ``core.degraded``; after a failure Redis is skipped for ``degraded.SKIP_S`` so that a
request never waits for more than one short connect timeout (``OPTIONS`` in the settings).
"""

from __future__ import annotations

from django.core.cache.backends.base import DEFAULT_TIMEOUT
from django.core.cache.backends.locmem import LocMemCache
from django.core.cache.backends.redis import RedisCache
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core import degraded

COMPONENT = "cache"
_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError)


class ResilientRedisCache(RedisCache):
    """``RedisCache`` with a per-process ``LocMemCache`` to fall back on."""

    def __init__(self, server, params):
        super().__init__(server, params)
        local = {k: v for k, v in params.items() if k in ("TIMEOUT", "KEY_PREFIX", "VERSION", "KEY_FUNCTION")}
        self.fallback = LocMemCache(f"nightwatch-fallback-{id(self)}", local)

    def _either(self, name: str, *args, **kwargs):
        if not degraded.down(COMPONENT):
            try:
                result = getattr(super(), name)(*args, **kwargs)
            except _UNAVAILABLE as error:
                degraded.note(COMPONENT, error)
            else:
                degraded.recovered(COMPONENT)
                return result
        return getattr(self.fallback, name)(*args, **kwargs)

    def add(self, key, value, timeout=DEFAULT_TIMEOUT, version=None):
        return self._either("add", key, value, timeout, version)

    def get(self, key, default=None, version=None):
        return self._either("get", key, default, version)

    def set(self, key, value, timeout=DEFAULT_TIMEOUT, version=None):
        return self._either("set", key, value, timeout, version)

    def touch(self, key, timeout=DEFAULT_TIMEOUT, version=None):
        return self._either("touch", key, timeout, version)

    def delete(self, key, version=None):
        return self._either("delete", key, version)

    def get_many(self, keys, version=None):
        return self._either("get_many", keys, version)

    def has_key(self, key, version=None):
        return self._either("has_key", key, version)

    def incr(self, key, delta=1, version=None):
        return self._either("incr", key, delta, version)

    def set_many(self, data, timeout=DEFAULT_TIMEOUT, version=None):
        return self._either("set_many", data, timeout, version)

    def delete_many(self, keys, version=None):
        return self._either("delete_many", keys, version)

    def clear(self):
        return self._either("clear")
