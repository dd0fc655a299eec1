"""What the control plane did without Redis: each fallback counted (per process) and logged.

Redis carries optimisations and hints: rate-limit counters (``core.cache``), Celery messages
(``core.outbox``), the dashboard's channel layer and relay lease, shared admission counts. None of
them may turn a request into a 500 when Redis is down. Each caller that falls back (to the
database, to a per-process cache, to skipping the optimisation) calls ``note(component, error)``:
the first fallback after a healthy spell logs a warning, later ones at most once a minute, and every
one is counted for ``/metrics`` (``nightwatch_redis_fallbacks_total{component}``). The counts are
this process's own: the one place every process could add them up is the Redis that is down.

``note`` also opens a short circuit: for ``SKIP_S`` after a failure, ``down(component)`` says so,
and callers go straight to their fallback instead of paying a connect timeout on every request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

log = logging.getLogger(__name__)

#: After a failure, Redis is not tried again by that component for this long.
SKIP_S = 2.0
#: While the failures go on, a component logs at most once per this many seconds.
LOG_EVERY_S = 60.0

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_down_until: dict[str, float] = {}
_logged_at: dict[str, float] = {}


def note(component: str, error: BaseException | str) -> None:
    """``component`` went without Redis once (because of ``error``)."""
    now = time.monotonic()
    with _lock:
        _counts[component] += 1
        healthy_before = _down_until.get(component, 0.0) + SKIP_S < now
        _down_until[component] = now + SKIP_S
        due = healthy_before or now - _logged_at.get(component, -1e9) >= LOG_EVERY_S
        if due:
            _logged_at[component] = now
        total = _counts[component]
    if due:
        log.warning("Redis unavailable for %s: falling back (%d fallbacks so far in this process): %s",
                    component, total, error)


def down(component: str) -> bool:
    """Whether ``component`` failed to reach Redis within the last ``SKIP_S`` seconds."""
    return time.monotonic() < _down_until.get(component, 0.0)


def recovered(component: str) -> None:
    """``component`` reached Redis again: log it once, close the circuit."""
    with _lock:
        was_down = component in _down_until
        _down_until.pop(component, None)
    if was_down:
        log.warning("Redis reachable again for %s", component)


def counts() -> dict[str, int]:
    """Fallbacks so far in this process, by component."""
    with _lock:
        return dict(_counts)


def reset() -> None:
    """Forget everything (tests)."""
    with _lock:
        _counts.clear()
        _down_until.clear()
        _logged_at.clear()
