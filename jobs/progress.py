"""Progress deadlines: how long a generation may go without a new step, and what moves the deadline.

    launch ─▶ start-up allowance (jobs.launching.startup_timeout_s)
    "resumed"/"model" from rank 0 ─▶ end_startup: now + first-step allowance (only ever earlier)
    every new step ─▶ advance_progress: the newest step's time + progress timeout
    contact back after a fleet silence ─▶ restart_after_silence: now + at least the heartbeat grace
    its reports refused by admission control ─▶ expire_one_progress_deadline: last refusal + timeout
        (a refusal before rank 0 last said it had delivered everything spares nothing)
    a launch not yet acknowledged ─▶ expire_one_progress_deadline: the last ack + start-up allowance
    an agent found a rank gone ─▶ expire_one_progress_deadline: the notice + RANK_GONE_WAIT_S
    the hooks said the loop is done ─▶ expire_one_progress_deadline: the word + RUN_ENDING_WAIT_S
    none of its nodes heard from either ─▶ expire_one_progress_deadline: their heartbeat deadline
    no node of the fleet heard from (a lull) ─▶ expire_one_progress_deadline: now + one heartbeat interval
    deadline passed ─▶ expire_one_progress_deadline: a hang, for the orchestrator and the policy

The progress timeout (``progress_timeout_s``) is the one rule for all of them, taken from the job's
own rhythm (``rhythm_timeout_s``) so that a 0.1 s-step job is found hung in seconds and a
10 min-step job is not found hung at all while it steps:

1. The policy's ``progress_timeout_s`` when set (an explicit override, at least
   ``PROGRESS_TIMEOUT_MIN_OVERRIDE_S``; the API refuses less).
2. Else, with step history: ``PROGRESS_TIMEOUT_STEPS`` × the p99 of the job's recent step times
   + ``PROGRESS_TIMEOUT_SLACK_S``, never below ``PROGRESS_TIMEOUT_FLOOR_S``. The step times are
   rank 0's newest ``jobs.steps.RECENT_STEPS`` steps of the job (the current generation's, then
   the previous one's while it has few), each the sum of its phases, so a step that
   blocked on a checkpoint save counts with its ``checkpoint`` phase; and the newest
   ``RHYTHM_CHECKPOINTS`` saves' blocking times (the checkpoint registry's ``blocking_s``), each on
   top of a median step, count as steps too, so a save every 500 steps is still in the rhythm when
   the last 50 steps held none; before any save is measured the timeout is at least
   ``UNMEASURED_SAVE_FLOOR_S`` (the first save's stall is unknown). The slack covers the hooks'
   report batching (rank 0's reporter sends every second,
   ``agents.hooks.reporter.Reporter.flush_interval``): a job's reports arrive a second apart
   however short its steps.
3. Else (no step history): ``DEFAULT_PROGRESS_TIMEOUT_S``.

The deadline runs from the newest step's own time (the hooks' clock, at the end of the step), at
most ``ANCHOR_LAG_MAX_S`` before the report arrived (a node clock behind ours must not make a
healthy job look late), and the hang's fault time is that step's time: the last progress. When the
reporter says nothing waits behind its batch, it also says how old that step was as it sent it
(its own clock, so no skew): the deadline runs from that age before the arrival, however late the
steps arrived (``progress_anchor``).

The deadline is when the verdict may be made at the latest less one progress sweep
(``settings.PROGRESS_SWEEP_INTERVAL_S``): the sweep looks that often, so a hang is declared within
the timeout of its last step, not up to a sweep later.

A rank that dies is not a hang, but its generation goes silent just the same: torchrun reports the
exit only once it has closed the rest of the group, seconds later (3.9-5.3 s measured for a
raising rank), and the crash's own report has its exception and the pause a deterministic one
gets. So the agent tells of the rank at once (its ``rank_gone`` notice, ``agents.protocol.agent``),
and a job past its deadline with such a notice waits up to ``RANK_GONE_WAIT_S`` after it for the
exit report (``_await_exit_report``). A run that ends goes quiet too: after its last step the hooks
save the final checkpoint and flush, and the ranks exit seconds later; they say ``run_ending`` first
(``agents.hooks.api.Hooks``), and the sweep waits for the end (``_await_run_end``). Those two let the
floor come down from 8 s to 2 s.

No progress is evidence of a hang only while the job's nodes are heard from. When none of the
generation's nodes has got a heartbeat through for ``silence.QUIET_INTERVALS`` heartbeat intervals
either, the reports are stuck with the heartbeats: our ingress is down (a redeploy, the API's
process gone) or the nodes are cut off, and the heartbeat rules own that verdict (the fleet-silence
hold, or unreachable and the partition policy). The fleet-wide hold cannot cover a small fleet: its
nodes' heartbeat deadlines (15 s) run out after a fast job's progress deadline (2-10 s), and the
chaos run's 30 s outage of the API declared a training job hung. So the deadline waits for the
nodes' newest heartbeat deadline (``_await_node_contact``); by then their heartbeats and the
buffered steps have arrived, or the heartbeat sweep has spoken. A hung job's agents keep beating,
and one silent node of several does not defer the verdict. A large fleet tells an outage sooner
than a job's few nodes can: when no node at all has been heard for as long as the fleet takes to
send 20 heartbeats (``silence.lull``: 1 s at 1,088 nodes), no job is found hung; its deadline moves
one heartbeat interval on (``_await_ingress``), until the fleet-silence hold takes over or the
heartbeats and the buffered steps are back.

A generation has not started until every node has its launch: under overload a node's heartbeats,
which fetch its commands, may be refused for minutes (bench.fleet at 1,024 nodes: 12 of 23 jobs
declared hung while starting, their launches still pending, then paused when their stops could not
be delivered either). So the start-up allowance runs from the last acknowledgement of the
generation's launches (``_await_launches``); a launch that is never fetched expires with the
command's time to live, and the hang rules apply again.

A slow first step (imports, compilation, a cold cache) is covered by the start-up allowance and,
once the generation has restored, by ``FIRST_STEP_ALLOWANCE_S``: ``end_startup`` never brings the
deadline closer than that. A new generation starts with no deadline (``jobs.state``) until its
launch sets the allowance.

Known limit: a periodic stall that is neither a checkpoint save nor among the newest
``RECENT_STEPS`` steps (an evaluation every 1,000 steps, say) and lasts longer than the timeout
is taken for a hang; set the policy's ``progress_timeout_s`` for such a job.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Max, Q, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from checkpoints.models import Checkpoint
from core import refusals
from jobs import policy, state
from jobs.choices import GenerationState, JobState
from jobs.launching import startup_timeout_s
from jobs.models import Generation, Job, StepMetric, TrainingEvent
from jobs.orchestrator import exit_fault_time, record_first_step, report_fault
from jobs.policies import RecoveryPolicy
from jobs.steps import recent_step_seconds
from nodes.choices import CommandKind, CommandState
from nodes.models import AgentEventRecord, NodeCommand
from nodes.services import overload, silence
from nodes.services.fleet import base_heartbeat_interval_s, heartbeat_interval_s

#: A generation whose ranks report no step for this long (when the policy sets no timeout and
#: there is no step history yet) is considered hung.
DEFAULT_PROGRESS_TIMEOUT_S = 120.0
#: With step history, the timeout is this many p99 step times plus the slack, never below the floor.
PROGRESS_TIMEOUT_STEPS = 3
PROGRESS_TIMEOUT_SLACK_S = 1.0
#: Issue 20's 2 s. Two quiet spells used to need more: a dying rank reported only once torchrun
#: had closed the rest of its group (3.9-5.3 s after the last step), which the agent's ``rank_gone``
#: notice now covers (``_await_exit_report``); and the end of a run, when the hooks wait for the
#: final checkpoint's save and flush their reports and the ranks exit 2-4 s after the last step
#: (5 of 8 tests/e2e/test_recovery.py runs declared hung at 2 s), which their ``run_ending`` word
#: now covers (``_await_run_end``).
PROGRESS_TIMEOUT_FLOOR_S = 2.0
#: The lowest explicit ``progress_timeout_s`` the API accepts: an operator may trade that risk for speed.
PROGRESS_TIMEOUT_MIN_OVERRIDE_S = 2
#: The percentile of recent step times the rhythm is read at: the slow tail, not the typical step.
RHYTHM_PERCENTILE = 99
#: How many of the job's newest checkpoint saves count in the rhythm with their blocking time.
RHYTHM_CHECKPOINTS = 3
#: Until one of the job's saves has been measured, the stall of its next save is unknown: the
#: timeout is at least this long (the fixed floor of the rule before issue 20).
UNMEASURED_SAVE_FLOOR_S = 15.0
#: Once the generation has restored, its first step may take this long (or the progress timeout,
#: if longer): it pays for lazy initialisation, compilation and cold caches that later steps do not.
FIRST_STEP_ALLOWANCE_S = 30.0
#: How far before a report's arrival its step's own time may anchor the deadline: the reporter's
#: flush interval (1 s), the most a report waits after its step. With less, a 2 s timeout ran from
#: up to 0.75 s after the last step, and the hang was found late by that much. The cost: a node clock
#: behind ours by d takes min(d, this) from a healthy job's slack (a false hang needs the next
#: report later than timeout - d after the previous step); fleets keep clocks within milliseconds.
ANCHOR_LAG_MAX_S = 1.0
#: How far before the report that carried it a hang's last step may date the fault: the reporter's
#: flush interval and the network. An earlier step time is a node clock behind ours.
REPORT_DELAY_MAX_S = 2.0
#: Hook events that mean the generation's ranks are past restoring their checkpoint (or found none
#: and start from scratch), i.e. the training loop is about to run: ``resumed`` once a checkpoint
#: is loaded, and ``model``, which every process reports right after that point whether it
#: resumed or not (``agents.hooks.api.Hooks.__init__``). Both come from rank 0.
LOOP_STARTING_EVENTS = frozenset({"resumed", "model"})
#: The hooks' reporter backs off up to this long between tries (``Reporter.max_backoff``).
REPORTER_MAX_BACKOFF_S = 10.0
#: A job past its deadline one of whose ranks an agent found gone (``rank_gone``) waits this long
#: after the notice for the exit report that says how the rank ended (torchrun sends it once it has
#: closed the rest of the group: seconds, or up to its 30 s SIGTERM wait for a rank that ignores it,
#: which the agent cuts to 2 s). Bounded: an exit report that never comes must not hide a stuck job.
RANK_GONE_WAIT_S = 30.0
#: A job whose hooks said its loop is done (``run_ending``) may go this long after the word without
#: a step (or its policy's timeout, if longer): the final save, its commit and the exit. A run stuck
#: there longer is hung.
RUN_ENDING_WAIT_S = 300.0
#: The states in which the hang sweep watches the progress deadline.
PROGRESS_WATCHED = (JobState.INITIALIZING, JobState.RUNNING)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of ``values`` (not empty): a value that occurred, so the
    p99 of 50 steps is their slowest, not an interpolation below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def rhythm_timeout_s(step_seconds: Sequence[float], checkpoint_blocks: Sequence[float] = ()) -> float | None:
    """How long a job with these recent step times may go without a step: ``PROGRESS_TIMEOUT_STEPS``
    p99 step times plus ``PROGRESS_TIMEOUT_SLACK_S``, never below ``PROGRESS_TIMEOUT_FLOOR_S``;
    None without step history. Each of ``checkpoint_blocks`` (a recent save's blocking seconds)
    counts as a typical step that blocked that long, so the next save is in the rhythm too; with
    none (no save measured yet) the next save's stall is unknown, and the timeout is at least
    ``UNMEASURED_SAVE_FLOOR_S``."""
    if not step_seconds:
        return None
    typical = statistics.median(step_seconds)
    rhythm = [*step_seconds, *(typical + blocked for blocked in checkpoint_blocks)]
    floor = PROGRESS_TIMEOUT_FLOOR_S if checkpoint_blocks else UNMEASURED_SAVE_FLOOR_S
    return max(floor, PROGRESS_TIMEOUT_STEPS * percentile(rhythm, RHYTHM_PERCENTILE) + PROGRESS_TIMEOUT_SLACK_S)


def progress_timeout_s(job: Job, step_seconds: Sequence[float], checkpoint_blocks: Sequence[float] = ()) -> float:
    """How long the job may go without a new step before it counts as hung: the policy's override,
    else the job's rhythm (``rhythm_timeout_s``), else ``DEFAULT_PROGRESS_TIMEOUT_S``."""
    configured = RecoveryPolicy.of(job).progress_timeout_s
    if configured:
        return float(configured)
    derived = rhythm_timeout_s(step_seconds, checkpoint_blocks)
    return float(DEFAULT_PROGRESS_TIMEOUT_S) if derived is None else derived


def job_progress_timeout_s(job: Job) -> float:
    """``progress_timeout_s`` for ``job`` now, from its newest step times and its newest checkpoint
    saves (no query when the policy sets the timeout). The newest steps are the current
    generation's first; while it has stepped only a few times, the previous generation's fill the
    window, so the steps right after a restart (warm-up, the first save after it) are judged by
    the job's rhythm, not by one fast first step."""
    if RecoveryPolicy.of(job).progress_timeout_s:
        return progress_timeout_s(job, [])
    return progress_timeout_s(job, recent_step_seconds(job), checkpoint_blocks(job))


def checkpoint_blocks(job: Job) -> list[float]:
    """How long the job's newest ``RHYTHM_CHECKPOINTS`` saves blocked training (the registry's
    ``blocking_s``, any generation: the save cost belongs to the model, not the run)."""
    return list(Checkpoint.objects.filter(job=job, blocking_s__isnull=False).order_by("-step", "-pk")
                .values_list("blocking_s", flat=True)[:RHYTHM_CHECKPOINTS])


def end_startup(job: Job, generation: int, now: datetime) -> bool:
    """The generation's ranks have restored (or started from scratch): bring the progress deadline
    forward to ``now`` + the first-step allowance; returns whether it moved.

    The start-up allowance set at launch (``jobs.launching.startup_timeout_s``) covers process
    start, rendezvous and the restore; once those are over, a missing first step is a hang like
    any other, and waiting out the rest of the start-up allowance only delays its detection. The
    first step may still be slow (lazy initialisation, compilation): without an explicit policy
    timeout it gets at least ``FIRST_STEP_ALLOWANCE_S``, however fast the earlier generation
    stepped. Compare-and-set: only the current generation's deadline moves (an event of a
    generation fenced off meanwhile changes nothing), only in a state the hang sweep watches, and
    only earlier (or from unset), never later.
    """
    timeout = progress_timeout_s(job, *_earlier_rhythm(job, generation))
    if not RecoveryPolicy.of(job).progress_timeout_s:
        timeout = max(timeout, FIRST_STEP_ALLOWANCE_S)
    deadline = now + timedelta(seconds=timeout)  # an allowance, not a verdict due: no lead
    moved = (Job.objects.filter(pk=job.pk, generation=generation, state__in=PROGRESS_WATCHED)
             .filter(Q(progress_deadline__isnull=True) | Q(progress_deadline__gt=deadline))
             .update(progress_deadline=deadline))
    return bool(moved)


def _earlier_rhythm(job: Job, generation: int) -> tuple[list[float], list[float]]:
    """Rank 0's recent step times in the newest earlier generation that trained (the starting
    one has none yet) and the job's recent checkpoint blocks, for a progress timeout derived from
    them; none when the policy sets it."""
    if RecoveryPolicy.of(job).progress_timeout_s:
        return [], []
    previous = (Generation.objects.filter(job=job, number__lt=generation, first_step_at__isnull=False)
                .order_by("-number").values_list("number", flat=True).first())
    if previous is None:
        return [], []
    return recent_step_seconds(job, generation=previous), checkpoint_blocks(job)


def verdict_lead(timeout_s: float) -> timedelta:
    """How much earlier than ``timeout_s`` after its anchor a deadline falls: one progress sweep
    (``settings.PROGRESS_SWEEP_INTERVAL_S``), which finds a passed deadline up to that late, so the
    verdict comes within the timeout; never more than a quarter of it (a slow sweep setting must
    not eat a short timeout's slack)."""
    return timedelta(seconds=min(settings.PROGRESS_SWEEP_INTERVAL_S, timeout_s / 4))


def progress_deadline(anchor: datetime, timeout_s: float) -> datetime:
    """The deadline of a timeout running from ``anchor``, by which the sweep must find it passed."""
    return anchor + timedelta(seconds=timeout_s) - verdict_lead(timeout_s)


def progress_anchor(now: datetime, stepped_at: datetime | None, newest_age_s: float | None = None) -> datetime:
    """Where a new step's deadline runs from.

    - The rank said nothing of it waits behind the batch (``ReportBatch.newest_step_age_s``): ``now``
      less that step's age when the batch was sent, measured on the rank's own clock, so no skew with
      ours; the time in transit is not counted, which errs late. Steps held back by overload (a spool
      refused for half a minute) are dated as old as they are: run O's injected hang was found 47 s
      after it, 19 s after its last steps arrived, against a 20 s timeout.
    - Else the step's own time (``stepped_at``, the hooks' clock), no earlier than
      ``ANCHOR_LAG_MAX_S`` before ``now`` (more may wait behind it, or the node's clock is behind
      ours) and no later than ``now``."""
    if newest_age_s is not None:
        return now - timedelta(seconds=newest_age_s)
    if stepped_at is None:
        return now
    return min(now, max(stepped_at, now - timedelta(seconds=ANCHOR_LAG_MAX_S)))


def advance_progress(job: Job, generation: int, first: int, last: int, now: datetime, *, actor: str,
                     stepped_at: datetime | None = None, newest_age_s: float | None = None) -> None:
    """Steps ``first``..``last`` of ``generation`` are newly reported (the newest ended at
    ``stepped_at``, by the hooks' clock, and was ``newest_age_s`` old when sent if the rank said so):
    the deadline moves to the anchored step time (``progress_anchor``) + the progress timeout, and
    a generation reporting its first step is running (its job too, and the incidents it recovered
    from are over)."""
    deadline = progress_deadline(progress_anchor(now, stepped_at, newest_age_s), job_progress_timeout_s(job))
    caught_up = ({} if newest_age_s is None else
                 {"progress_caught_up_at": now, "progress_caught_up_age_s": newest_age_s})
    Job.objects.filter(pk=job.pk, generation=generation).update(
        last_step=Greatest(Coalesce("last_step", Value(last)), Value(last)),
        last_step_at=now,
        progress_deadline=deadline,
        **caught_up,
    )
    Generation.objects.filter(job=job, number=generation, first_step_at__isnull=True).update(
        first_step=first, first_step_at=now, state=GenerationState.RUNNING
    )
    if job.state == JobState.INITIALIZING:
        try:
            state.transition(job, JobState.RUNNING, actor=actor, generation=generation,
                             expect_state=JobState.INITIALIZING, reason=f"first step {first} reported")
        except state.TransitionConflict:
            pass  # another batch of the same generation got there first
        record_first_step(job, generation)


def hang_fault_time(job: Job) -> datetime:
    """When a hung generation last made progress: its newest step's own time (the hooks' clock),
    no earlier than ``REPORT_DELAY_MAX_S`` before the report that carried it arrived
    (``last_step_at``), no later than that arrival; or, when that report's batch left nothing of
    rank 0 behind, the age the batch gave that step (``Job.progress_caught_up_age_s``, the rank's own
    clock) before the arrival, however late it was, never before the generation started. A
    generation that never stepped hung starting
    up: its fault dates from its launch (the job's last state change), the last thing known to work."""
    stepped = (StepMetric.objects.filter(job=job, generation=job.generation, rank=0)
               .aggregate(at=Max("reported_at"))["at"])
    arrived = job.last_step_at
    if stepped is None or arrived is None:
        return job.state_changed_at
    if arrived == job.progress_caught_up_at and job.progress_caught_up_age_s is not None:
        # The newest batch left nothing behind and said how old its step was (the rank's own clock):
        # however late overload let it arrive, that is when the progress stopped (transit not counted).
        # The hooks are untrusted: an age past the generation's start dates from the start.
        at = arrived - timedelta(seconds=job.progress_caught_up_age_s)
        started = (Generation.objects.filter(job=job, number=job.generation)
                   .values_list("started_at", flat=True).first())
        return at if started is None else max(at, started)
    return min(arrived, max(stepped, arrived - timedelta(seconds=REPORT_DELAY_MAX_S)))


def refused_retry_within_s() -> float:
    """How long after its last refusal a job whose reports admission control refused tries again
    at the latest: its reporter waits the longer of its own backoff and the server's ``Retry-After``
    (which grows with the bulk refused, up to ``RETRY_AFTER_MAX_S``), plus up to 50 % jitter
    (``agents.http.retry_delay``). A refused job is spared at least this long, however short its
    progress timeout: a fast job's 8 s would otherwise read a backed-off reporter as a hang, in
    exactly the overload that caused it."""
    return 1.5 * max(REPORTER_MAX_BACKOFF_S, settings.NIGHTWATCH["RETRY_AFTER_MAX_S"])


def _move_deadline(job: Job, to: datetime | None) -> int:
    """Move ``job``'s progress deadline to ``to`` (None: clear it) if it is still the one ``job`` was
    read with: compare-and-set, so a report that moved it meanwhile wins. Returns rows moved (0 or 1)."""
    return Job.objects.filter(pk=job.pk, progress_deadline=job.progress_deadline).update(progress_deadline=to)


def _spare_refused(job: Job, now: datetime) -> bool:
    """Move ``job``'s progress deadline past the last refusal of its generation's reports, if any
    fell within its progress timeout (at least ``refused_retry_within_s()``) and after rank 0 last
    said it had delivered everything (``Job.progress_caught_up_at``: what was refused before then
    has arrived since); returns whether the job was spared (a report that moved the deadline
    meanwhile wins the compare-and-set: spared all the same)."""
    hold = timedelta(seconds=max(job_progress_timeout_s(job), refused_retry_within_s()))
    refused = refusals.refused_since(hold.total_seconds(), now=now)
    last = refused.generations.get((job.pk, job.generation)) if refused is not None else None
    if last is None or last + hold <= now:
        return False
    if job.progress_caught_up_at is not None and last <= job.progress_caught_up_at:
        return False  # rank 0 delivered everything it had since: the refusal held no step back
    _move_deadline(job, last + hold)
    return True


def _await_exit_report(job: Job, now: datetime) -> bool:
    """Whether ``job``, past its deadline, is one of whose ranks an agent told us gone
    (``rank_gone``) without the steps going on after it; if so it is handled here.

    1. No notice of the current generation, or steps that arrived after it (the rank that ended did
       not stop training; the hang rules apply as before): not handled.
    2. Within ``RANK_GONE_WAIT_S`` of the notice: the deadline moves to the end of the wait. The
       exit report is on its way, and it makes the incident (a crash, with its exception).
    3. Past the wait with that node's exit report stored: not handled (the report was acted on, and
       the generation stays silent for a reason of its own).
    4. Past the wait without it: a crash on that node, with no signature, dated from the rank's
       death. Not a hang: the rank is known to have died, and "no step progress" would send the
       on-call looking for a deadlock that did not happen; what is missing is torchrun's account of
       it. The remedy is the same restart; with no signature it never counts as a repeat.
    """
    # The newest: a rank replaced in process (``jobs.inprocess``) may die again in the same generation.
    notice = (AgentEventRecord.objects.filter(job=job, generation=job.generation, kind="rank_gone")
              .select_related("node").order_by("-received_at", "-pk").first())
    if notice is None:
        return False
    stepped_after = timedelta(seconds=REPORT_DELAY_MAX_S)  # steps from before the death still arriving
    if job.last_step_at is not None and job.last_step_at > notice.received_at + stepped_after:
        return False
    waited_until = notice.received_at + timedelta(seconds=RANK_GONE_WAIT_S)
    if now < waited_until:
        _move_deadline(job, waited_until)
        return True
    if AgentEventRecord.objects.filter(job=job, generation=job.generation, node=notice.node,
                                       kind__in=("exited", "stopped")).exists():
        return False
    hostname = notice.node.hostname
    rank_exited_at = notice.detail.get("at")
    incident = report_fault(job.pk, policy.EXIT, generation=job.generation, nodes=(hostname,),
                            step=job.last_step, actor=f"node:{hostname}",
                            fault_at=exit_fault_time(job, job.generation, {"rank_exited_at": rank_exited_at,
                                                                           "exited_at": notice.time.timestamp()}),
                            detail={"rank_gone": notice.detail, "exit_report": None,
                                    "waited_s": RANK_GONE_WAIT_S, "last_step": job.last_step})
    if incident is None:  # fenced off: clear the deadline so we do not spin on it
        _move_deadline(job, None)
    return True


def _await_launches(job: Job, now: datetime) -> bool:
    """Whether ``job``, still starting and past its deadline, is one whose generation has not had
    every launch acknowledged for a start-up allowance (``jobs.launching.startup_timeout_s``); if so
    its deadline moves to the allowance after now (a launch still open, unexpired) or after the
    last acknowledgement."""
    if job.state != JobState.INITIALIZING:
        return False
    launches = NodeCommand.objects.filter(job=job, generation=job.generation, kind=CommandKind.LAUNCH)
    allowance = timedelta(seconds=startup_timeout_s(job))
    if launches.filter(state__in=CommandState.OPEN, expires_at__gt=now).exists():
        waited_until = now + allowance
    else:
        last_ack = launches.aggregate(at=Max("acked_at"))["at"]
        if last_ack is None or last_ack + allowance <= now:
            return False
        waited_until = last_ack + allowance
    _move_deadline(job, waited_until)
    return True


def _await_run_end(job: Job, now: datetime) -> bool:
    """Whether ``job``, past its deadline, is one whose hooks said the training loop is done
    (``run_ending``, at its last step) within ``RUN_ENDING_WAIT_S``; if so its deadline moves to the
    end of that wait. Steps past the one the word was said at (a script with a second loop) mean it
    ended nothing: the hang rules apply as before."""
    said = (TrainingEvent.objects.filter(job=job, generation=job.generation, kind="run_ending")
            .order_by("received_at").values_list("received_at", "step").first())
    if said is None:
        return False
    received_at, step = said
    if job.last_step is not None and job.last_step > step:
        return False
    waited_until = received_at + timedelta(seconds=max(RUN_ENDING_WAIT_S, job_progress_timeout_s(job)))
    if now >= waited_until:
        return False
    _move_deadline(job, waited_until)
    return True


def restart_after_silence(now: datetime, *, grace: timedelta) -> int:
    """Contact is back after a fleet silence: progress deadlines that ran out (or would within
    ``grace``) while nobody could reach us start over, at ``now`` + the progress timeout and never
    sooner than ``grace`` (the hooks' buffered reports need time to arrive). Returns how many moved.
    Compare-and-set on each deadline, so a report that moved one meanwhile wins."""
    moved = 0
    for job in Job.objects.filter(state__in=PROGRESS_WATCHED, progress_deadline__lt=now + grace):
        timeout = timedelta(seconds=job_progress_timeout_s(job))
        moved += _move_deadline(job, now + max(grace, timeout))
    return moved


def _await_node_contact(job: Job, now: datetime) -> bool:
    """Whether ``job``, past its deadline, is one none of whose generation's nodes got a heartbeat
    through for ``silence.QUIET_INTERVALS`` heartbeat intervals; if so its deadline moves to the
    newest of their heartbeat deadlines (at least one interval on): the heartbeat rules speak
    first. Not deferred: a generation without nodes or never heard from, and one whose nodes the
    heartbeat sweep has already judged (marked unreachable, so no deadline is left to wait for)."""
    interval = timedelta(seconds=heartbeat_interval_s())
    heard = (Generation.objects.filter(job=job, number=job.generation)
             .aggregate(count=Count("nodes"), last=Max("nodes__last_heartbeat_at"),
                        deadline=Max("nodes__heartbeat_deadline")))
    if (not heard["count"] or heard["last"] is None or heard["deadline"] is None
            or now - heard["last"] < silence.QUIET_INTERVALS * interval):
        return False
    waited_until = max(heard["deadline"], now + interval)
    _move_deadline(job, waited_until)
    return True


def _await_ingress(job: Job, now: datetime) -> bool:
    """Whether the fleet is in a lull (``silence.lull``: no heartbeat from any node for a while) as
    ``job``'s deadline passes; if so its deadline moves one configured heartbeat interval on, so that
    the buffered steps have time to arrive once the lull ends. Asked last: it reads the fleet."""
    if not silence.lull(now):
        return False
    waited_until = now + timedelta(seconds=base_heartbeat_interval_s())
    _move_deadline(job, waited_until)
    return True


def expire_one_progress_deadline() -> bool:
    """The first job past its progress deadline is reported as hung; returns whether one was.
    Nothing is while the fleet is silent or the control plane answers heartbeats late: the reports
    may be stuck on our side (see ``nodes.services.silence`` and ``nodes.services.overload``). A job
    whose hooks admission control refused within its progress timeout was heard trying: a refused
    report counts as one that arrived, and its deadline moves a timeout past the last refusal."""
    if silence.held() or overload.holding():
        return False
    now = timezone.now()
    job = (Job.objects.filter(state__in=PROGRESS_WATCHED, progress_deadline__lt=now)
           .order_by("progress_deadline").first())
    if job is None:
        return False
    if (_spare_refused(job, now) or _await_launches(job, now) or _await_exit_report(job, now)
            or _await_run_end(job, now) or _await_node_contact(job, now) or _await_ingress(job, now)):
        return True
    incident = report_fault(job.pk, policy.HANG, generation=job.generation, step=job.last_step,
                            fault_at=hang_fault_time(job),
                            detail={"last_step": job.last_step, "progress_deadline": job.progress_deadline.isoformat()})
    if incident is None:  # fenced off: clear the deadline so we do not spin on it
        _move_deadline(job, None)
    return True

