"""Fleet silence: when (nearly) every node stops heartbeating at once, suspect ourselves first.

One node that misses its heartbeats is a node problem: it turns unreachable and the failure
policy treats its jobs as partitioned (pause and escalate, never a split brain). But when most of
the fleet goes quiet *together*, the likeliest cause is on this side: the API process died or was
redeployed, a load balancer or the control plane's own network failed. Declaring every node
unreachable then would pause every job in the cluster, and their ranks are most likely still
training: the agents and the hooks buffer what they could not send and deliver it when we are back.

The fleet is *silent* when at least ``FLEET_SILENCE_MIN_NODES`` nodes, and at least
``FLEET_SILENCE_FRACTION`` of those we expect heartbeats from, are past their deadline, and no node
at all has got a heartbeat through since the first of those deadlines ran out. The last clause
tells our outage from a real partition: if some nodes still reach us, our ingress works and the
silent ones are cut off on their side. It is silent too when at least ``FLEET_SILENCE_MIN_NODES``
are past their deadline and no heartbeat at all arrived for ``QUIET_INTERVALS`` heartbeat
intervals: a fleet beats every interval, each node on its own clock, so a stretch that long
without any is our side. That catches an outage of an overloaded control plane, whose nodes' last
contacts (and so deadlines) are spread over a whole timeout rather than one interval: at 1,024
nodes the first sweeps of an outage saw 17 % of the fleet past its deadline, below the fraction,
and marked 1,023 live nodes unreachable. And once heartbeat pacing stretches the interval
(``nodes.services.fleet``), it is silent when no heartbeat at all arrived for ``QUIET_INTERVALS``
of the *configured* interval from a fleet that sends at least ``HUSH_BEATS`` in that time, before
any deadline passed: paced deadlines are a minute away at 1,000 nodes, longer than an outage that
already runs the jobs' progress deadlines (seconds) out.

So, like the Kubernetes node controller in its "full disruption" mode, the heartbeat sweeper holds:
while the fleet is silent no node is marked unreachable and no job is declared hung (the jobs'
sweep asks ``held()``). When contact returns, every deadline that ran out during the silence starts
over (the nodes and hooks had no way to reach us), and the hold lasts one more heartbeat timeout so
that buffered reports can arrive. If the silence outlasts ``FLEET_SILENCE_HOLD_S``, the hold is
given up: the nodes turn unreachable and the partition policy pages a human as before.

Each transition is one ``fleet.silence`` event (``silent`` → ``restored`` or ``given_up``); the
newest of them is the state, so every worker and the web process read the same answer. Only the
heartbeat sweeper writes them (one beat task), so transitions are not raced. The deadlines of
the work on the nodes are not this app's: the jobs app restarts its progress deadlines when
``nodes.signals.fleet_contact_restored`` tells it, by its own progress-timeout rule.

A control plane that still hears some heartbeats but refuses or queues the rest is not silent by
this rule; its hold is the overload watch's (``nodes.services.overload``), asked right after this one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Max, Min, Q
from django.utils import timezone

from core.events import EventKind, record_event
from core.models import Event
from nodes import signals
from nodes.models import Node
from nodes.services.fleet import base_heartbeat_interval_s, heartbeat_interval_s, heartbeat_timeout

log = logging.getLogger(__name__)
ACTOR = "system:fleet-watch"
SILENT, RESTORED, GIVEN_UP = "silent", "restored", "given_up"
#: No heartbeat from any node for this many heartbeat intervals is our silence, whatever the fraction.
QUIET_INTERVALS = 1.5
#: No heartbeat at all for QUIET_INTERVALS of the *configured* interval, from a fleet that would have
#: sent at least this many in that time, is our silence before any deadline ran out (``Silence.hushed``).
HUSH_BEATS = 20
#: A lull (``lull``) lasts at least this long: four hang sweeps, and several times the gap between the
#: heartbeats of a fleet that sends dozens a second.
LULL_FLOOR_S = 1.0


@dataclass(frozen=True)
class Silence:
    """How many of the nodes we expect heartbeats from have missed them, and since when."""

    silent: int
    expected: int
    since: datetime | None  # the oldest missed deadline
    last_heard: datetime | None  # the newest heartbeat from any of them
    quiet_s: float | None = None  # how long no heartbeat at all has arrived

    @property
    def hushed(self) -> bool:
        """No heartbeat from anyone for ``QUIET_INTERVALS`` configured intervals, from a fleet that
        sends at least ``HUSH_BEATS`` in that time. Heartbeat pacing made this rule necessary: at 1,088
        nodes a node's deadline is 66 s away, so a 30 s outage of our ingress passes no deadline and the
        rules below never speak, while the jobs' progress deadlines (seconds) run out: bench.fleet's
        storm declared 20 jobs hung. A fleet that sends 50 heartbeats a second and none for 7.5 s is
        our side. Only while pacing stretches the interval: unpaced, deadlines pass within an outage."""
        interval, base = heartbeat_interval_s(), base_heartbeat_interval_s()
        if (self.quiet_s is None or interval <= base  # unpaced: the deadlines pass in time, as before
                or self.expected < settings.NIGHTWATCH["FLEET_SILENCE_MIN_NODES"]):
            return False
        return self.quiet_s >= QUIET_INTERVALS * base and self.expected / interval * self.quiet_s >= HUSH_BEATS

    @property
    def lulled(self) -> bool:
        """No heartbeat from anyone for as long as the fleet takes to send ``HUSH_BEATS`` of them, and
        at least ``LULL_FLOOR_S``: the first seconds of an outage of our ingress, before
        ``QUIET_INTERVALS`` make it a fleet silence (``hushed`` is the same count over a longer quiet).

        Bench.fleet's reconnect storm (run N) declared a training job hung 7 s into the web processes'
        outage: the refusals that had spared it were over 15 s old, its nodes had last been heard 7-8 s
        before, under 1.5 heartbeat intervals, and the fleet silence would have engaged at 7.5 s. At
        1,088 nodes, 50 heartbeats a second, 7 s are 350 heartbeats missing from the fleet: ours, not
        the job's. A small fleet's lull is long (2 nodes at 5 s: 50 s), so there the job's own nodes'
        silence speaks first."""
        if self.quiet_s is None or not self.expected:
            return False
        return (self.quiet_s >= LULL_FLOOR_S
                and self.expected / heartbeat_interval_s() * self.quiet_s >= HUSH_BEATS)

    @property
    def onset(self) -> datetime | None:
        """When the silence began: the oldest missed deadline, or the last heartbeat when hushed first."""
        return self.since if self.since is not None else self.last_heard

    @property
    def is_fleet_wide(self) -> bool:
        config = settings.NIGHTWATCH
        if self.hushed:
            return True
        if self.since is None or self.silent < config["FLEET_SILENCE_MIN_NODES"]:
            return False
        if self.quiet_s is not None and self.quiet_s >= QUIET_INTERVALS * heartbeat_interval_s():
            return True
        return (self.silent >= config["FLEET_SILENCE_FRACTION"] * self.expected
                and (self.last_heard is None or self.last_heard <= self.since))


def measure(now: datetime) -> Silence:
    """One query: nodes with a heartbeat deadline (the ones we hear from), those silent, and when
    we last heard from any of them.

    Silent is past the deadline *or within one heartbeat interval of it*: nodes that stop together
    still pass their deadlines up to one interval apart (each beats on its own clock), and the
    sweeper must not take the first one for a lone failure before the others have caught up."""
    overdue = Q(heartbeat_deadline__lt=now)
    row = Node.objects.filter(heartbeat_deadline__isnull=False).aggregate(
        expected=Count("pk"), silent=Count("pk", filter=Q(heartbeat_deadline__lt=now + _interval())),
        since=Min("heartbeat_deadline", filter=overdue), last_heard=Max("last_heartbeat_at"))
    last_heard = row["last_heard"]
    return Silence(silent=row["silent"], expected=row["expected"], since=row["since"], last_heard=last_heard,
                   quiet_s=None if last_heard is None else (now - last_heard).total_seconds())


def _interval() -> timedelta:
    return timedelta(seconds=heartbeat_interval_s())


def lull(now: datetime) -> bool:
    """Whether the fleet is in a lull now (``Silence.lulled``). The hang sweep asks it before a verdict
    (``jobs.progress``), and nothing else: it is no state and records nothing."""
    return measure(now).lulled


def last_transition() -> Event | None:
    return Event.objects.filter(kind=EventKind.FLEET_SILENCE).order_by("-created_at", "-pk").first()


def held(now: datetime | None = None) -> bool:
    """Whether the sweepers must hold: the fleet is silent, or contact came back less than one
    heartbeat timeout ago (buffered reports are still arriving). Read-only."""
    now = now or timezone.now()
    last = last_transition()
    if last is None:
        return False
    if last.new_state == SILENT:
        return True
    return last.new_state == RESTORED and now - last.created_at < heartbeat_timeout()


def watch(now: datetime | None = None) -> bool:
    """The heartbeat sweeper's first step: record a transition if there is one; returns whether
    the sweeper must hold (mark nobody unreachable) this round."""
    now = now or timezone.now()
    silence = measure(now)
    last = last_transition()
    holding = last is not None and last.new_state == SILENT
    if silence.is_fleet_wide:
        hold_s = settings.NIGHTWATCH["FLEET_SILENCE_HOLD_S"]
        silent_for = (now - silence.onset).total_seconds()
        if silent_for >= hold_s:
            if holding:
                _record(GIVEN_UP, now, silence,
                        f"{silence.silent} of {silence.expected} nodes silent for {silent_for:.0f} s, longer than "
                        f"the {hold_s} s hold: treating them as unreachable (partition policy)")
            return False
        if not holding:
            what = (f"no heartbeat from any of {silence.expected} nodes for {silence.quiet_s:.1f} s"
                    if silence.since is None else
                    f"{silence.silent} of {silence.expected} nodes missed their heartbeats together")
            _record(SILENT, now, silence, f"{what}: suspecting the control plane's own ingress; holding up to "
                                          f"{hold_s} s (no node unreachable, no job hung)")
        return True
    if holding:
        _restore(now, silence, since=last.created_at)
        return True
    return held(now)


def _restore(now: datetime, silence: Silence, *, since: datetime) -> None:
    """Contact is back: deadlines that ran out while nobody could reach us start over, the nodes'
    here and the jobs' in the receivers of ``fleet_contact_restored`` (in this transaction)."""
    grace = heartbeat_timeout()
    with transaction.atomic():
        nodes = Node.objects.filter(heartbeat_deadline__lt=now).update(heartbeat_deadline=now + grace)
        jobs = sum(moved for _, moved in signals.fleet_contact_restored.send(
            sender=Node, now=now, grace=grace, silent_since=since))
        _record(RESTORED, now, silence,
                f"contact restored after {(now - since).total_seconds():.0f} s of fleet silence: "
                f"{nodes} node and {jobs} job deadline(s) start over",
                extra={"silent_since": since.isoformat(), "deadlines_reset": {"nodes": nodes, "jobs": jobs}})


def _record(state: str, now: datetime, silence: Silence, reason: str, extra: dict | None = None) -> None:
    last = last_transition()
    record_event(EventKind.FLEET_SILENCE, actor=ACTOR, created_at=now, old_state=last.new_state if last else "",
                 new_state=state, reason=reason,
                 evidence={"silent": silence.silent, "expected": silence.expected,
                           "oldest_missed_deadline": silence.since.isoformat() if silence.since else None,
                           **(extra or {})})
    (log.warning if state != RESTORED else log.info)("fleet silence: %s", reason)

