"""Overload hold: a control plane that could not keep up does not call live nodes dead.

A node turns unreachable when no heartbeat of it arrived for a heartbeat timeout. That verdict is
only as good as our side's ability to hear: an overloaded control plane refuses heartbeats
(admission control's 503s, ``core.admission``) or answers them late, and then a live agent looks
exactly like a dead one. Issue 18's probe had 512 and 1,024 agents heartbeating at an overloaded
control plane: 486 and 841 ``unreachable`` verdicts for nodes that were alive, each pausing its
jobs and paging a human. The fleet-silence watch (``nodes.services.silence``) did not see it,
because some heartbeats still got through.

So before it expires anyone, the heartbeat sweeper asks whether the control plane kept up over
the last heartbeat timeout, the silent period of every node whose deadline is passing now:

1. admission refusals, every web process together (``core.shared_counts``): heartbeats and
   registrations refused (``OVERLOAD_HEARTBEAT_REFUSALS``), or requests of any kind
   (``OVERLOAD_REFUSALS``: step reports shed, so progress deadlines say nothing either);
2. heartbeats answered ``OVERLOAD_HEARTBEAT_LAG_S`` or more after they arrived (queued behind other
   work: their deadlines moved that much late), at least ``OVERLOAD_LATE_HEARTBEATS`` of them;
3. messages waiting in Celery's default queue (``OVERLOAD_QUEUE_DEPTH``, off by default): heartbeats
   and step reports are taken by the web processes, so a backlog hides neither; it only delays what
   a verdict sets off. A deployment that would rather not decide while its worker is that far
   behind sets a bound. Either way the depth is in every ``fleet.overload`` event's evidence.

Any of them past its threshold is overload, and no job is declared hung (the jobs' sweep asks
``held()``): their step reports may be among those refused. No node turns unreachable either while
the overload touches heartbeats (refused, answered late, or a queue past its bound); refused bulk
alone does not, since the heartbeats' reserve let them in. When a whole window passes without
any, the hold lifts: deadlines that ran out during it start over one heartbeat timeout from now
(the agents' heartbeats were refused or queued, not missing), and so do the jobs' progress
deadlines (``nodes.signals.fleet_contact_restored``, whose receivers treat it like contact coming
back after a silence). A hold that outlasts ``OVERLOAD_HOLD_S`` is given up: a node that really
died during a long overload is declared unreachable then, at the price of verdicts the overload
may have made up.

Each transition is one ``fleet.overload`` event (``overloaded`` → ``recovered``, or → ``given_up``
→ ``recovered``); the newest is the state, so every process reads the same answer, and
``/metrics`` exports it. Only the heartbeat sweeper writes them (one beat task), so transitions
are not raced. Without Redis the refusals, late heartbeats and queue depth are unknown (the
embedded broker has no cheap count either): the embedded demo never holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core import shared_counts
from core.events import EventKind, record_event
from core.models import Event
from nodes import signals
from nodes.models import Node
from nodes.services.fleet import heartbeat_timeout

log = logging.getLogger(__name__)
ACTOR = "system:overload-watch"
OVERLOADED, GIVEN_UP, RECOVERED = "overloaded", "given_up", "recovered"


@dataclass(frozen=True)
class Load:
    """How the control plane fared over the last ``window_s``; None where it could not be read."""

    window_s: float
    heartbeats_refused: int | None
    refused: int | None  # every class, heartbeats included
    late_heartbeats: int | None
    queue_depth: int | None

    def reasons(self) -> list[str]:
        """Each signal past its threshold, in words (empty: the control plane kept up)."""
        return [text for text, _ in self._past_thresholds()]

    def heartbeats_unheard(self) -> bool:
        """Whether a signal past its threshold says heartbeats were refused, queued or answered late.
        Refused bulk alone does not: the heartbeats' reserve (``PRIORITY_RESERVE``) let them in."""
        return any(about_heartbeats for _, about_heartbeats in self._past_thresholds())

    def _past_thresholds(self) -> list[tuple[str, bool]]:
        config = settings.NIGHTWATCH
        window = f"in the last {self.window_s:.0f} s"
        checks = (
            (self.heartbeats_refused, config["OVERLOAD_HEARTBEAT_REFUSALS"], f"heartbeats refused {window}", True),
            (self.refused, config["OVERLOAD_REFUSALS"], f"requests refused {window}", False),
            (self.late_heartbeats, config["OVERLOAD_LATE_HEARTBEATS"],
             f"heartbeats answered {config['OVERLOAD_HEARTBEAT_LAG_S']:g} s or more late {window}", True),
            (self.queue_depth, config["OVERLOAD_QUEUE_DEPTH"], "tasks waiting in the Celery queue", True),
        )
        return [(f"{value} {what}", about_heartbeats) for value, threshold, what, about_heartbeats in checks
                if value is not None and threshold > 0 and value >= threshold]

    def evidence(self) -> dict:
        return {"window_s": self.window_s, "heartbeats_refused": self.heartbeats_refused, "refused": self.refused,
                "late_heartbeats": self.late_heartbeats, "queue_depth": self.queue_depth}


def measure(now: datetime) -> Load:
    """Two Redis round trips (the window's counts, the queue's length), no SQL."""
    window = heartbeat_timeout().total_seconds()
    counts = shared_counts.within(window, now=now.timestamp())
    if counts is None:
        refused = heartbeats_refused = late = None
    else:
        heartbeats_refused = counts.get("refused:priority", 0)
        refused = heartbeats_refused + counts.get("refused:other", 0)
        late = counts.get("late:priority", 0)
    return Load(window_s=window, heartbeats_refused=heartbeats_refused, refused=refused, late_heartbeats=late,
                queue_depth=_queue_depth())


def _queue_depth() -> int | None:
    redis = shared_counts.client()
    if redis is None:
        return None
    try:
        return int(redis.llen(current_app.conf.task_default_queue or "celery"))
    except Exception:  # a broker that does not answer: unknown, like the other signals without Redis
        log.warning("overload: the broker did not answer", exc_info=True)
        return None


def last_transition() -> Event | None:
    return Event.objects.filter(kind=EventKind.FLEET_OVERLOAD).order_by("-created_at", "-pk").first()


def held() -> bool:
    """Whether the sweepers hold for overload now. Read-only: one indexed query."""
    last = last_transition()
    return last is not None and last.new_state == OVERLOADED


def watch(now: datetime | None = None) -> bool:
    """The heartbeat sweeper's overload step: record a transition if there is one; returns whether
    the sweeper must hold (mark nobody unreachable) this round: while overloaded, and the overload
    touches heartbeats (``Load.heartbeats_unheard``)."""
    now = now or timezone.now()
    load = measure(now)
    last = last_transition()
    state = last.new_state if last is not None else RECOVERED
    reasons = load.reasons()
    if reasons:
        if _hold_s() <= 0:
            return False
        if state == RECOVERED:
            _record(OVERLOADED, now, load, f"control plane overloaded ({'; '.join(reasons)}): holding up to "
                    f"{_hold_s()} s (no job hung, and no node unreachable unless only bulk requests were "
                    f"refused)")
            return load.heartbeats_unheard()
        if state == OVERLOADED:
            held_for = (now - last.created_at).total_seconds()
            if held_for < _hold_s():
                return load.heartbeats_unheard()
            _record(GIVEN_UP, now, load, f"overloaded for {held_for:.0f} s, longer than the {_hold_s()} s hold "
                    f"({'; '.join(reasons)}): silent nodes turn unreachable again")
        return False
    if state != RECOVERED:
        _lift(now, load, since=_hold_started(last))
        return True
    return False


def _hold_s() -> int:
    return settings.NIGHTWATCH["OVERLOAD_HOLD_S"]


def _hold_started(last: Event) -> datetime:
    if last.new_state == OVERLOADED:
        return last.created_at
    return datetime.fromisoformat(last.evidence.get("since") or last.created_at.isoformat())


def _lift(now: datetime, load: Load, *, since: datetime) -> None:
    """The control plane kept up for a whole window: deadlines that ran out since the hold began
    start over, the nodes' here and the jobs' in the receivers of ``fleet_contact_restored``."""
    grace = heartbeat_timeout()
    with transaction.atomic():
        nodes = Node.objects.filter(heartbeat_deadline__lt=now).update(heartbeat_deadline=now + grace)
        jobs = sum(moved for _, moved in signals.fleet_contact_restored.send(
            sender=Node, now=now, grace=grace, silent_since=since))
        _record(RECOVERED, now, load,
                f"control plane kept up for {load.window_s:.0f} s after {(now - since).total_seconds():.0f} s of "
                f"overload: {nodes} node and {jobs} job deadline(s) start over",
                extra={"deadlines_reset": {"nodes": nodes, "jobs": jobs}})


def _record(state: str, now: datetime, load: Load, reason: str, extra: dict | None = None) -> None:
    last = last_transition()
    since = now if state == OVERLOADED else _hold_started(last)
    record_event(EventKind.FLEET_OVERLOAD, actor=ACTOR, created_at=now, old_state=last.new_state if last else "",
                 new_state=state, reason=reason,
                 evidence={**load.evidence(), "since": since.isoformat(), **(extra or {})})
    (log.warning if state != RECOVERED else log.info)("overload: %s", reason)
