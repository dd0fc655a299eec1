"""Windowed counts, so that one old error does not mark a node bad forever.

Pure: time is always passed in. ``EventWindow`` counts discrete events (Xids) in the last
``window_s`` seconds; ``CounterWindow`` turns a hardware counter that only grows (ECC, NVLink)
into "how much did it grow in the last ``window_s`` seconds".
"""

from __future__ import annotations

from collections import deque


class EventWindow:
    """Events with their times; ``recent(now)`` counts those within the window."""

    def __init__(self, window_s: float):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self.total = 0
        self._events: deque[tuple[float, int]] = deque()

    def add(self, at: float, code: int = 0) -> None:
        self.total += 1
        self._events.append((at, code))

    def recent(self, now: float) -> int:
        self._forget_before(now - self.window_s)
        return len(self._events)

    def recent_codes(self, now: float) -> list[int]:
        """Distinct codes within the window, ordered by their latest occurrence."""
        self._forget_before(now - self.window_s)
        latest: dict[int, float] = {}
        for at, code in self._events:
            latest[code] = at
        return sorted(latest, key=latest.__getitem__)

    def _forget_before(self, cutoff: float) -> None:
        while self._events and self._events[0][0] < cutoff:
            self._events.popleft()


class CounterWindow:
    """Increase of a monotonic counter over the last ``window_s`` seconds.

    1. Every observation adds its growth since the previous one to a running sum; a value lower
       than the previous one means the counter was reset (volatile ECC counters reset with the
       driver), and then the new value itself is the growth.
    2. The first observation contributes nothing: its value is history from before we looked.
    3. ``increase(now)`` is the running sum now minus the running sum at the last observation
       at or before ``now - window_s`` (or at the first observation, if none is that old).
    """

    def __init__(self, window_s: float):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._points: deque[tuple[float, int]] = deque()  # (time, running sum of growth)
        self._last_value: int | None = None

    def observe(self, at: float, value: int | None) -> None:
        if value is None:  # unsupported or unreadable this time: no information
            return
        if self._last_value is None:
            growth = 0
        elif value >= self._last_value:
            growth = value - self._last_value
        else:
            growth = value
        running = (self._points[-1][1] if self._points else 0) + growth
        self._points.append((at, running))
        self._last_value = value

    def increase(self, now: float) -> int | None:
        """``None`` until the counter has been observed at least once."""
        if not self._points:
            return None
        cutoff = now - self.window_s
        # Keep exactly one point at or before the cutoff: it is the baseline of the window.
        while len(self._points) > 1 and self._points[1][0] <= cutoff:
            self._points.popleft()
        return self._points[-1][1] - self._points[0][1]
