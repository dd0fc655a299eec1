"""Template filters of the dashboard: short durations, percentages and evidence as JSON."""

from __future__ import annotations

import json
from datetime import timedelta

from django import template

register = template.Library()


@register.filter
def short_duration(value) -> str:
    """``timedelta`` or seconds -> ``850 ms``, ``42 s``, ``3 m 12 s``, ``5 h 02 m``, ``3 d 4 h``."""
    if value is None or value == "":
        return "—"
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} m {sec:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} m"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


@register.filter
def percent(value, digits: int = 1) -> str:
    if value is None:
        return "—"
    return f"{float(value) * 100:.{int(digits)}f}%"


@register.filter
def pretty_json(value) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


@register.filter
def ratio(value) -> str:
    return "—" if value is None else f"{value:.2f}×"
