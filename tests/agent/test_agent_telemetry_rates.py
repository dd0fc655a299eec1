"""Windowed counts: recent errors count, old ones fade out, counter resets are not negative."""

from __future__ import annotations

import pytest

from agents.telemetry.rates import CounterWindow, EventWindow


def test_event_window_counts_only_recent_events() -> None:
    window = EventWindow(window_s=60)
    window.add(100.0, code=79)
    window.add(130.0, code=13)
    window.add(140.0, code=79)
    assert window.recent(now=150.0) == 3
    assert window.recent_codes(now=150.0) == [13, 79]  # ordered by latest occurrence
    assert window.recent(now=165.0) == 2  # the one at 100 s is older than 60 s
    assert window.recent(now=500.0) == 0
    assert window.total == 3


def test_counter_window_reports_growth_within_the_window() -> None:
    counter = CounterWindow(window_s=60)
    assert counter.increase(0.0) is None  # never observed: unknown, not zero
    counter.observe(0.0, 40)  # history from before we looked: not counted
    assert counter.increase(0.0) == 0
    counter.observe(10.0, 42)
    counter.observe(20.0, 45)
    assert counter.increase(20.0) == 5
    counter.observe(80.0, 45)
    assert counter.increase(80.0) == 0  # growth happened at 10 and 20 s, both before 80 - 60
    counter.observe(90.0, 46)
    assert counter.increase(90.0) == 1


def test_counter_reset_counts_the_new_value_as_growth() -> None:
    counter = CounterWindow(window_s=600)
    counter.observe(0.0, 10)
    counter.observe(5.0, 12)  # +2
    counter.observe(10.0, 3)  # the driver reloaded: volatile counters restart from 0, so +3
    assert counter.increase(10.0) == 5


def test_unsupported_observations_change_nothing() -> None:
    counter = CounterWindow(window_s=60)
    counter.observe(0.0, None)
    assert counter.increase(0.0) is None
    counter.observe(1.0, 7)
    counter.observe(2.0, None)
    assert counter.increase(2.0) == 0


@pytest.mark.parametrize("cls", [EventWindow, CounterWindow])
def test_windows_must_be_positive(cls: type) -> None:
    with pytest.raises(ValueError, match="positive"):
        cls(0)
