"""Goodput accounting: how much of a job's wall time was productive, and where the rest went.

ETTR (effective training time ratio) = productive training time / wall time. Badput is split
into the kinds an operator can act on:

- ``startup``: launch of the first generation until its first step;
- ``detection``: from a fault to its detection; while a running job reports no step for longer
  than a few step times (``stall_grace_s``), the stretch since its last step counts here as it
  happens (a hang not detected yet is detection time in the making; once it is detected, the
  incident's own fault → detection span, which starts at that same last step, takes over);
- ``restart``: from detection to the first step of the resumed generation (quiesce, relaunch,
  restore); a pause waiting for a human is counted apart as ``paused``;
- ``lost_work``: steps trained after the last checkpoint and redone after the restore;
- ``checkpoint_stall``: time training was blocked by checkpoint saves.

Everything is computed from recorded facts (incident timestamps, lost steps, checkpoint
blocking times, step times), never from estimates. ``compute()`` is pure; ``jobs.goodput``
gathers its inputs from the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

KINDS = ("startup", "detection", "restart", "paused", "lost_work", "checkpoint_stall")


@dataclass(frozen=True)
class IncidentTimes:
    fault_at: datetime | None
    detected_at: datetime
    first_step_at: datetime | None  # None while recovery is still under way
    lost_steps: int = 0
    paused_s: float = 0.0  # time spent waiting for a human inside this incident


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    productive_s: float
    badput_s: dict[str, float] = field(default_factory=dict)

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


def compute(*, started_at: datetime, now: datetime, first_step_at: datetime | None,
            incidents: list[IncidentTimes], median_step_s: float, checkpoint_blocking_s: float,
            last_step_at: datetime | None = None, stall_grace_s: float = 0.0) -> Goodput:
    """Split ``now - started_at`` into productive time and badput by kind.

    1. Startup runs until the first step (or until now, if none yet).
    2. Each incident costs detection (fault → detected) and restart (detected → first step of
       the next generation, or now), less the time it sat paused for a human, counted apart.
    3. Lost work is lost steps × the median step time.
    4. Checkpoint stalls are the summed blocking time of saves.
    5. A step-less stretch still under way: ``last_step_at`` (given for a running job) more than
       ``stall_grace_s`` ago, and no incident detected since, counts as detection from
       ``last_step_at`` to now. Without it ETTR *rose* during a hang (wall time grew, badput did
       not) and only fell at detection.
    Productive time is what is left, never below zero.
    """
    wall = max(0.0, (now - started_at).total_seconds())
    bad = dict.fromkeys(KINDS, 0.0)
    # A first generation that never trained counts as startup only until its first fault.
    startup_end = first_step_at or min([i.fault_at or i.detected_at for i in incidents] + [now])
    bad["startup"] = _span(started_at, startup_end)
    for incident in incidents:
        if incident.fault_at is not None:
            bad["detection"] += _span(incident.fault_at, incident.detected_at)
        recovery = _span(incident.detected_at, incident.first_step_at or now)
        paused = min(incident.paused_s, recovery)
        bad["paused"] += paused
        bad["restart"] += recovery - paused
        bad["lost_work"] += incident.lost_steps * median_step_s
    bad["checkpoint_stall"] = checkpoint_blocking_s
    if last_step_at is not None and _span(last_step_at, now) > stall_grace_s \
            and not any(i.detected_at >= last_step_at for i in incidents):
        bad["detection"] += _span(last_step_at, now)
    productive = max(0.0, wall - sum(bad.values()))
    return Goodput(wall_s=wall, productive_s=productive, badput_s=bad)


def _span(start: datetime, end: datetime) -> float:
    return max(0.0, (end - start).total_seconds())
