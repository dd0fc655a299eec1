"""Overload hold: a control plane that could not keep up does not call live nodes dead.

A node turns unreachable when no heartbeat of it arrived for a heartbeat timeout. That verdict is
only as good as our side's ability to hear: an overloaded control plane refuses heartbeats
(admission control's 503s, ``core.admission``) or answers them late, and then a live agent looks
exactly like a dead one. Issue 18's probe had 512 and 1,024 agents heartbeating at an overloaded
control plane: 486 and 841 ``unreachable`` verdicts for nodes that were alive, each pausing its
jobs and paging a human. The fleet-silence watch (``nodes.services.silence``) did not see it,
because some heartbeats still got through.

Two answers, for two kinds of not keeping up:

- **Refused** (admission control's 503s): we know whom. ``core.admission`` records the digest of
  each refused request's token, and the sweepers judge each node and each job by whether it tried
  (``core.refusals``): a node whose heartbeats were refused is spared until a heartbeat timeout
  after its last attempt, a job whose reports were refused until a progress timeout after it. So a
  node that dies while the control plane sheds load is found a timeout after it stopped trying,
  and a live one is never called dead for our 503s; refusals alone hold nobody.
- **Late or waiting**: a heartbeat that waited in our queue may hold a node's only proof of life
  while its deadline passes, and we cannot say whose. So the sweepers hold (no node unreachable,
  no job hung) while, within the last heartbeat timeout, at least ``OVERLOAD_LATE_HEARTBEATS``
  heartbeats were answered ``OVERLOAD_HEARTBEAT_LAG_S`` or more after they arrived (default: one
  heartbeat interval, the lag past which a queued heartbeat can let a deadline run out), or the
  Celery queue holds ``OVERLOAD_QUEUE_DEPTH`` messages (off by default: heartbeats and step reports
  are taken by the web processes, so a backlog hides neither; it only delays what a verdict sets
  off; the depth is in every ``fleet.overload`` event's evidence either way).

Refusals past their thresholds (``OVERLOAD_HEARTBEAT_REFUSALS``, ``OVERLOAD_REFUSALS``) still make
the control plane *overloaded*: an event and a metric say so, for capacity planning. When a whole
window passes without any signal, the overload ends: deadlines that ran out during it start over
one heartbeat timeout from now, and so do the jobs' progress deadlines
(``nodes.signals.fleet_contact_restored``, whose receivers treat it like contact coming back after
a silence). A hold that outlasts ``OVERLOAD_HOLD_S`` is given up: a node that really died during a
long overload is declared unreachable then, at the price of verdicts the overload may have made up.

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

from core import admission, shared_counts
from core.events import EventKind, record_event
from core.models import Event
from nodes import signals
from nodes.models import Node
from nodes.services.fleet import base_heartbeat_interval_s, heartbeat_timeout

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
        """Whether a signal past its threshold says heartbeats were queued or answered late, so that
        a silence may be ours. Refusals do not: whom we refused is known (``core.refusals``)."""
        return any(about_heartbeats for _, about_heartbeats in self._past_thresholds())

    def _past_thresholds(self) -> list[tuple[str, bool]]:
        config = settings.NIGHTWATCH
        window = f"in the last {self.window_s:.0f} s"
        checks = (
            (self.heartbeats_refused, config["OVERLOAD_HEARTBEAT_REFUSALS"], f"heartbeats refused {window}", False),
            (self.refused, config["OVERLOAD_REFUSALS"], f"requests refused {window}", False),
            (self.late_heartbeats, config["OVERLOAD_LATE_HEARTBEATS"],
             f"heartbeats answered {heartbeat_lag_s():g} s or more late {window}", True),
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
        refused = sum(counts.get(f"refused:{kind}", 0) for kind in admission.REFUSABLE)
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


def heartbeat_lag_s() -> float:
    """How late a heartbeat may be answered before it counts as late (``OVERLOAD_HEARTBEAT_LAG_S``;
    0, the default: one configured heartbeat interval, however far pacing stretched it: an answer
    that late is the control plane's queue, not the node's)."""
    return settings.NIGHTWATCH["OVERLOAD_HEARTBEAT_LAG_S"] or base_heartbeat_interval_s()


def overloaded() -> bool:
    """Whether the control plane is overloaded now (the newest transition says so). Read-only: one
    indexed query."""
    last = last_transition()
    return last is not None and last.new_state == OVERLOADED




def watch(now: datetime | None = None) -> bool:
    """The heartbeat sweeper's overload step: record a transition if there is one; returns whether
    the sweeper must hold (mark nobody unreachable) this round. An episode holds from the first round
    in which heartbeats were answered late or queued (``Load.heartbeats_unheard``) until it ends or
    the hold is given up; one in which callers were only refused never holds (``core.refusals``)."""
    now = now or timezone.now()
    load = measure(now)
    last = last_transition()
    state = last.new_state if last is not None else RECOVERED
    reasons = load.reasons()
    if reasons:
        unheard = load.heartbeats_unheard() and _hold_s() > 0
        if state == RECOVERED or (state == OVERLOADED and unheard and not _holding(last)):
            what = (f"holding up to {_hold_s()} s (no node unreachable, no job hung)" if unheard else
                    "callers whose requests were refused are spared one by one, nobody else is held")
            _record(OVERLOADED, now, load, f"control plane overloaded ({'; '.join(reasons)}): {what}",
                    extra={"holding": unheard})
            return unheard
        if state == OVERLOADED and _holding(last):
            held_for = (now - last.created_at).total_seconds()
            if held_for < _hold_s():
                return True
            _record(GIVEN_UP, now, load, f"held for {held_for:.0f} s, longer than the {_hold_s()} s bound "
                    f"({'; '.join(reasons)}): silent nodes turn unreachable again")
        return False
    if state != RECOVERED:
        held = state == GIVEN_UP or _holding(last)
        _end(now, load, since=_episode_started(last), reset=held)
        return held
    return False


def holding() -> bool:
    """Whether the sweepers hold now: overloaded and holding (the newest transition says so)."""
    last = last_transition()
    return last is not None and last.new_state == OVERLOADED and _holding(last)


def _holding(last: Event) -> bool:
    return bool(last.evidence.get("holding", True))


def _hold_s() -> int:
    return settings.NIGHTWATCH["OVERLOAD_HOLD_S"]


def _episode_started(last: Event) -> datetime:
    return datetime.fromisoformat(last.evidence.get("since") or last.created_at.isoformat())


def _end(now: datetime, load: Load, *, since: datetime, reset: bool) -> None:
    """The control plane kept up for a whole window. If the episode held, deadlines that ran out
    since it began start over, the nodes' here and the jobs' in the receivers of
    ``fleet_contact_restored``; one that only refused callers judged them one by one already."""
    overloaded_for = f"{(now - since).total_seconds():.0f} s of overload"
    if not reset:
        _record(RECOVERED, now, load, f"control plane kept up for {load.window_s:.0f} s after {overloaded_for}")
        return
    grace = heartbeat_timeout()
    with transaction.atomic():
        nodes = Node.objects.filter(heartbeat_deadline__lt=now).update(heartbeat_deadline=now + grace)
        jobs = sum(moved for _, moved in signals.fleet_contact_restored.send(
            sender=Node, now=now, grace=grace, silent_since=since))
        _record(RECOVERED, now, load,
                f"control plane kept up for {load.window_s:.0f} s after {overloaded_for}: {nodes} node and "
                f"{jobs} job deadline(s) start over", extra={"deadlines_reset": {"nodes": nodes, "jobs": jobs}})


def _record(state: str, now: datetime, load: Load, reason: str, extra: dict | None = None) -> None:
    last = last_transition()
    since = _episode_started(last) if last is not None and last.new_state != RECOVERED else now
    record_event(EventKind.FLEET_OVERLOAD, actor=ACTOR, created_at=now, old_state=last.new_state if last else "",
                 new_state=state, reason=reason,
                 evidence={**load.evidence(), "since": since.isoformat(), **(extra or {})})
    (log.warning if state != RECOVERED else log.info)("overload: %s", reason)
