"""Counters that every process adds to and any process reads: what admission control refused, how
late heartbeats were answered, how many nodes each heartbeat sweep expired.

Each web process sees only its own 503s, but the question the heartbeat sweeper asks ("did the
control plane keep up while this node was silent?") is about all of them together, and
``/metrics`` must answer the same numbers whichever process Prometheus scrapes. So the counts live
in Redis: one hash of running totals, and one hash per second of wall time (kept an hour) so that
a reader can sum any recent window.

Counting must never cost a request anything or make one fail: writers batch their counts in memory
and hand them over off the request path (``core.admission``), every Redis call has a short timeout,
and a Redis that is down loses those counts instead of raising: logged and counted through
``core.degraded``, which also skips Redis for a moment after a failure, so that readers answer
"unknown" at once instead of each waiting out a timeout. Without ``REDIS_URL`` (the
embedded demo: one web process, SQLite) there is nothing to share: adds are dropped and reads answer
``None``, "unknown".
"""

from __future__ import annotations

import functools
import logging
import math

from django.conf import settings

from core import degraded

log = logging.getLogger(__name__)

PREFIX = "nightwatch:counts:"
TOTALS = PREFIX + "total"
#: Window sums read this many one-second hashes; an hour covers any heartbeat timeout.
BUCKET_S = 1
KEEP_S = 3600
#: Who was refused: the SHA-256 of each bearer token admission control turned away, scored by the
#: last time it did (``refused_callers``). A sorted set, trimmed to ``KEEP_S`` by its writers.
REFUSED_CALLERS = PREFIX + "refused-callers"
#: Whose next heartbeat carries commands: the SHA-256 of each agent token whose node has open commands,
#: scored by when the newest was queued (``expect_heartbeats``). Admission control reads it to let those
#: heartbeats in as urgent; an entry leaves when the node has acknowledged its last open command, or
#: ages out with the commands' time to live.
AWAITED = PREFIX + "awaited-heartbeats"
#: A Redis that does not answer within this long counts as down (the caller goes on without it).
TIMEOUT_S = 0.5
#: Failures are logged and counted (``nightwatch_redis_fallbacks_total{component="shared_counts"}``).
COMPONENT = "shared_counts"


@functools.cache
def _client_for(url: str):
    # Only a Redis deployment reaches here: the embedded demo's processes never load the client.
    import redis

    return redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)


def client():
    """The Redis client, or None without ``REDIS_URL`` or while Redis is skipped after a failure
    (``core.degraded``: every caller then answers "unknown" at once instead of waiting out a timeout)."""
    if not settings.REDIS_URL or degraded.down(COMPONENT):
        return None
    return _client_for(settings.REDIS_URL)


def _bucket_key(second: int) -> str:
    return f"{PREFIX}{second - second % BUCKET_S}"


def add(counts: dict[str, int], *, at: float, refused: dict[str, float] | None = None) -> bool:
    """Add ``counts`` to the running totals and to the second ``at`` (a Unix time) falls in, and
    ``refused`` (token digest -> when) to the refused callers (``refused_callers``); returns
    whether Redis took them. One round trip, which also trims refused callers older than ``KEEP_S``."""
    redis = client()
    if redis is None or not (counts or refused):
        return False
    key = _bucket_key(math.floor(at))
    pipe = redis.pipeline(transaction=False)
    for name, n in counts.items():
        pipe.hincrby(TOTALS, name, n)
        pipe.hincrby(key, name, n)
    pipe.expire(key, KEEP_S)
    if refused:
        pipe.zadd(REFUSED_CALLERS, refused)
        pipe.zremrangebyscore(REFUSED_CALLERS, "-inf", at - KEEP_S)
    try:
        pipe.execute()
    except Exception as error:  # any Redis failure: these counts are lost, the caller is not
        log.info("shared counts: Redis did not take %s (and %d refused callers)", counts, len(refused or ()))
        degraded.note(COMPONENT, error)
        return False
    degraded.recovered(COMPONENT)
    return True


def totals() -> dict[str, int] | None:
    """The running totals (None: unknown)."""
    redis = client()
    if redis is None:
        return None
    try:
        return _decoded(redis.hgetall(TOTALS))
    except Exception as error:
        degraded.note(COMPONENT, error)
        return None


def within(seconds: float, *, now: float) -> dict[str, int] | None:
    """The counts added during the ``seconds`` before ``now`` (whole seconds, the partial ones at
    both ends included: a reader who must not miss a refusal would rather count one too many).
    None: unknown. One round trip."""
    redis = client()
    if redis is None:
        return None
    first, last = math.floor(now - seconds), math.floor(now)
    pipe = redis.pipeline(transaction=False)
    for second in range(first - first % BUCKET_S, last + 1, BUCKET_S):
        pipe.hgetall(_bucket_key(second))
    try:
        buckets = pipe.execute()
    except Exception as error:
        degraded.note(COMPONENT, error)
        return None
    summed: dict[str, int] = {}
    for bucket in buckets:
        for name, n in _decoded(bucket).items():
            summed[name] = summed.get(name, 0) + n
    return summed


def _decoded(raw: dict) -> dict[str, int]:
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}




def refused_callers(seconds: float, *, now: float) -> dict[str, float] | None:
    """The token digests refused during the ``seconds`` before ``now``, each with the last time it
    was (None: unknown). One round trip."""
    redis = client()
    if redis is None:
        return None
    try:
        members = redis.zrangebyscore(REFUSED_CALLERS, now - seconds, "+inf", withscores=True)
    except Exception as error:
        degraded.note(COMPONENT, error)
        return None
    return {(m.decode() if isinstance(m, bytes) else m): float(score) for m, score in members}


def expect_heartbeats(digests: dict[str, float], *, keep_s: float) -> bool:
    """Mark the agents of these token digests (-> when their command was queued, Unix time) as
    carrying commands on their next heartbeat; returns whether Redis took it. One round trip, which
    also drops entries older than ``keep_s`` (the commands' time to live)."""
    redis = client()
    if redis is None or not digests:
        return False
    pipe = redis.pipeline(transaction=False)
    pipe.zadd(AWAITED, digests)
    pipe.zremrangebyscore(AWAITED, "-inf", max(digests.values()) - keep_s)
    try:
        pipe.execute()
    except Exception as error:
        log.info("shared counts: Redis did not take %d awaited heartbeats", len(digests))
        degraded.note(COMPONENT, error)
        return False
    degraded.recovered(COMPONENT)
    return True


def heartbeats_received(digests: list[str]) -> bool:
    """These agents have no open command left: their heartbeats are ordinary again."""
    redis = client()
    if redis is None or not digests:
        return False
    try:
        redis.zrem(AWAITED, *digests)
    except Exception as error:
        degraded.note(COMPONENT, error)
        return False
    degraded.recovered(COMPONENT)
    return True


def awaited_heartbeats(seconds: float, *, now: float) -> frozenset[str] | None:
    """The token digests whose commands were queued during the ``seconds`` before ``now`` and not
    all acknowledged yet (None: unknown). One round trip."""
    redis = client()
    if redis is None:
        return None
    try:
        members = redis.zrangebyscore(AWAITED, now - seconds, "+inf")
    except Exception as error:
        degraded.note(COMPONENT, error)
        return None
    return frozenset(m.decode() if isinstance(m, bytes) else m for m in members)
