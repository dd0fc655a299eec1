"""The failure policy of DESIGN.md as a pure function: evidence in, decision out.

No Django, no I/O: ``decide()`` reads a ``Evidence`` snapshot that the orchestrator assembles
from the database, and returns what to do and why. Every row of the policy table is one branch
here and one unit test in ``tests/jobs/test_policy.py``.

    evidence                                   classification      action
    one rank/node exits, node health bad       hardware            drain node, restart on a spare
    one rank/node exits, node healthy          crash               restart
    no step progress past the timeout          hang                kill the group, restart
      …ranks stuck at different steps          hang (mismatch)     pause
    same signature twice, same config          deterministic       pause
    NaN loss / a spike the hooks said pauses   numerical           pause, propose rollback
    loss rising for hundreds of steps          numerical           pause, rollback to before the rise
    cross-rank spread above threshold          corruption          pause with per-rank values
    many nodes lost in a short window          partition           pause and escalate
    a node of the generation unreachable       partition           pause and escalate (split brain)
    straggler                                  straggler           alert, or restart on a spare when the
                                                                   time it saves exceeds the restart cost
    restarts in the window over the budget     retry storm         open the breaker (pause)
    a checkpoint save failed (disk full, ...)  checkpoint          alert and page; training goes on
    the job's pre-flight on a node failed      deterministic /     pause, page: no restart spent
      (entrypoint missing, ckpt dir unwritable)  checkpoint
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from core.text import ELLIPSIS, clean, one_line
from jobs.policies import RecoveryPolicy

# Signals, as the orchestrator names the evidence it saw.
EXIT = "exit"
HANG = "hang"
NODE_UNHEALTHY = "node_unhealthy"
NODE_UNREACHABLE = "node_unreachable"
NAN = "nan"
#: Not a signal ``decide`` judges: a rank already replaced inside its generation (``jobs.inprocess``
#: records it; the crash-lemon rule counts it).
IN_PROCESS_RESTART = "in_process_restart"
SPIKE = "spike"
INCONSISTENCY = "inconsistency"
STRAGGLER = "straggler"
DIVERGENCE = "divergence"
CHECKPOINT_FAILED = "checkpoint_failed"
LAUNCH_PREFLIGHT = "launch_preflight"

#: Exit signatures that say the hardware, not the program, failed.
HARDWARE_SIGNATURES = frozenset({"xid", "cuda_error"})
#: Exit signatures that are requests, not failures.
REQUESTED_SIGNATURES = frozenset({"paused", "stale_generation"})
#: The job's limits when the evidence names none: the recovery policy's defaults.
_DEFAULTS = RecoveryPolicy()


@dataclass(frozen=True)
class PastFailure:
    """A previous failure of the same job, to recognise a deterministic one."""

    signature: str | None
    error_line: str | None
    step: int | None
    config_hash: str


@dataclass(frozen=True)
class Evidence:
    signal: str
    config_hash: str = ""
    #: exit: the signature and last error line the agent found, and the step reached.
    signature: str | None = None
    error_line: str | None = None
    step: int | None = None
    #: Nodes blamed by this evidence (hostnames), and whether each is healthy now.
    nodes: tuple[str, ...] = ()
    unhealthy_nodes: tuple[str, ...] = ()
    #: spike: how many consecutive steps spiked; the job's limit.
    consecutive_spikes: int = 0
    spike_limit: int = _DEFAULTS.loss_spike_limit
    #: spike: the hooks' own verdict ("pause" or "marker"; "" from hooks that send none).
    spike_verdict: str = ""
    #: divergence: the step the rise started from, and its size.
    since_step: int | None = None
    rise: float | None = None
    #: straggler: the share of throughput the job loses to it, the seconds of training left (None:
    #: unknown), and what restarting on a spare costs.
    lost_fraction: float = 0.0
    remaining_s: float | None = None
    restart_cost_s: float = 300.0
    #: partition: how many distinct nodes became unreachable inside the window.
    nodes_lost_in_window: int = 0
    partition_threshold: int = 2
    #: budget: automatic restarts already made inside the window, and the budget.
    restarts_in_window: int = 0
    max_restarts: int = _DEFAULTS.max_restarts
    backoff_base_s: float = _DEFAULTS.backoff_seconds
    #: placement: are there free healthy nodes to replace the blamed ones? May the job shrink?
    spares_available: int = 0
    allow_shrink: bool = _DEFAULTS.allow_shrink
    history: tuple[PastFailure, ...] = ()


@dataclass(frozen=True)
class Decision:
    classification: str  # an IncidentKind value
    action: str  # a Decision value: restart, restart_on_spare, shrink, pause, escalate, alert
    reason: str
    drain: tuple[str, ...] = ()
    backoff_s: float = 0.0
    propose_rollback: bool = False
    page: bool = False  # needs a human now

    @property
    def restarts(self) -> bool:
        return self.action in ("restart", "restart_on_spare", "shrink")


def decide(ev: Evidence) -> Decision:
    """Classify the evidence and pick the action. Pure; see the module docstring for the table."""
    judged = _classify(ev)
    if not judged.restarts:
        return judged
    # Restarting is the remedy: is it still safe and within the budget?
    if _repeats(ev):
        return Decision("deterministic", "pause", page=True,
                        reason=f"the same failure ({_label(ev)}) happened again with the same config: "
                               "retrying cannot help")
    if ev.restarts_in_window >= ev.max_restarts:
        return Decision("retry_storm", "pause", page=True,
                        reason=f"{ev.restarts_in_window} automatic restarts inside the window reached the budget "
                               f"of {ev.max_restarts}: circuit breaker open")
    backoff = ev.backoff_base_s * (2 ** ev.restarts_in_window) if ev.restarts_in_window else 0.0
    return Decision(judged.classification, judged.action, judged.reason, drain=judged.drain, backoff_s=backoff)


def _classify(ev: Evidence) -> Decision:
    if ev.signal == NAN:
        return Decision("numerical", "pause", "the loss became NaN/Inf", propose_rollback=True, page=True)
    if ev.signal == DIVERGENCE:
        since = f" since step {ev.since_step}" if ev.since_step is not None else ""
        rise = f" ({ev.rise:+.1%})" if ev.rise is not None else ""
        return Decision("numerical", "pause", propose_rollback=True, page=True,
                        reason=f"the loss has been rising against its own baseline{since}{rise}: roll back to the "
                               "last checkpoint before the rise")
    if ev.signal == SPIKE:
        if ev.spike_verdict == "pause" and not spike_run_pauses(ev.consecutive_spikes, ev.spike_limit):
            return Decision("numerical", "pause", propose_rollback=True, page=True,
                            reason="a loss spike the guard did not absorb (its update was applied)")
        if spike_run_pauses(ev.consecutive_spikes, ev.spike_limit) or ev.spike_verdict == "pause":
            return Decision("numerical", "pause", propose_rollback=True, page=True,
                            reason=f"{ev.consecutive_spikes} consecutive loss spikes (limit {ev.spike_limit})")
        return Decision("numerical", "alert", f"loss spike ({ev.consecutive_spikes} in a row)")
    if ev.signal == INCONSISTENCY:
        return Decision("corruption", "pause", page=True,
                        reason="ranks disagree on loss or gradient norm beyond the threshold: possible silent "
                               "data corruption")
    if ev.signal == LAUNCH_PREFLIGHT:
        # The job's own spec or storage, found by the agent before torchrun started: every node and
        # every restart would fail the same way, so none is spent on it.
        kind = "checkpoint" if ev.signature == "checkpoint_dir" else "deterministic"
        where = f" on {', '.join(ev.nodes)}" if ev.nodes else ""
        return Decision(kind, "pause", page=True,
                        reason=f"the job cannot start{where}: {ev.error_line or 'pre-flight failed'}; "
                               "retrying cannot help")
    if ev.signal == CHECKPOINT_FAILED:
        # Training goes on from the previous checkpoint, so nothing is to be recovered; but every
        # save that fails makes the next fault lose more work, and a full disk does not empty
        # itself: a human hears of it now (once per cause: the orchestrator folds repeats in).
        at = f" at step {ev.step}" if ev.step is not None else ""
        return Decision("checkpoint", "alert", page=True,
                        reason=f"checkpoint save{at} failed: {ev.error_line or 'unknown cause'}; training goes on "
                               "from the previous checkpoint")
    if ev.signal == STRAGGLER:
        return _straggler(ev)
    if ev.signal == NODE_UNREACHABLE or ev.nodes_lost_in_window >= ev.partition_threshold:
        return Decision("partition", "escalate", page=True,
                        reason=f"{max(ev.nodes_lost_in_window, 1)} node(s) lost contact in the partition window: a "
                               "restart could run beside ranks that are still alive (split brain)")
    if ev.signal == HANG:
        return Decision("hang", "restart", "no step progress past the progress timeout")
    if ev.signal in (EXIT, NODE_UNHEALTHY):
        bad = tuple(ev.unhealthy_nodes)
        hardware = bool(bad) or ev.signature in HARDWARE_SIGNATURES or ev.signal == NODE_UNHEALTHY
        if hardware:
            blamed = bad or tuple(ev.nodes)
            if ev.spares_available >= len(blamed):
                return Decision("hardware", "restart_on_spare", drain=blamed,
                                reason=f"{', '.join(blamed)} unhealthy: drain and restart on a spare")
            if ev.allow_shrink:
                return Decision("hardware", "shrink", drain=blamed,
                                reason=f"{', '.join(blamed)} unhealthy and no spare: restart on the remaining nodes")
            return Decision("hardware", "pause", drain=blamed, page=True,
                            reason=f"{', '.join(blamed)} unhealthy, no spare, and the job may not shrink")
        return Decision("crash", "restart", f"a rank exited ({_label(ev)})")
    raise ValueError(f"unknown signal {ev.signal!r}")


def straggler_gain_s(ev: Evidence) -> float | None:
    """Seconds a restart on a spare would save over the rest of the job: the time lost to the
    straggler (``lost_fraction`` of what is left) minus the restart cost; None when the remaining
    time is unknown."""
    if ev.remaining_s is None:
        return None
    return ev.lost_fraction * ev.remaining_s - ev.restart_cost_s


def _straggler(ev: Evidence) -> Decision:
    where = ", ".join(ev.nodes) or "a node"
    gain = straggler_gain_s(ev)
    cost = f"the job runs {ev.lost_fraction:.0%} slower"
    if gain is not None and gain > 0 and ev.spares_available >= 1 and ev.nodes:
        return Decision("straggler", "restart_on_spare", drain=tuple(ev.nodes),
                        reason=f"straggler on {where}: {cost}; replacing it saves about {gain:.0f} s over the "
                               f"rest of the job, more than the restart costs ({ev.restart_cost_s:.0f} s)")
    if gain is None:
        why = "the job's remaining time is unknown"
    elif gain <= 0:
        why = f"a restart ({ev.restart_cost_s:.0f} s) would cost more than it saves"
    else:
        why = "no spare node is free"
    return Decision("straggler", "alert", f"straggler on {where}: {cost}; alert only ({why})")


def spike_run_pauses(consecutive_spikes: int, spike_limit: int) -> bool:
    """Whether a run of consecutive loss spikes (as the hooks count them, on one rank) is long
    enough to pause the job. The one place the limit is judged: the ingest asks it before handing
    a spike run to the orchestrator, and ``decide`` asks it again of the evidence."""
    return consecutive_spikes >= spike_limit


def _repeats(ev: Evidence) -> bool:
    """Same signature and error (and step, when known) as the previous failure, same config."""
    if ev.signal != EXIT or not ev.history or ev.signature in (None, "signal"):
        return False
    last = ev.history[-1]
    same_failure = (last.signature, failure_key(last.error_line)) == (ev.signature, failure_key(ev.error_line))
    same_step = last.step is None or ev.step is None or last.step == ev.step
    return same_failure and same_step and last.config_hash == ev.config_hash


#: Parts of an error line that differ between two runs of the same failure: addresses and ids.
_VOLATILE = re.compile(r"0x[0-9a-fA-F]+|\b(?:pid|tid)[ =:]*\d+", re.IGNORECASE)
#: A failure key is at most this long: the start of the line, then a hash of the whole of it.
FAILURE_KEY_LEN = 120


def failure_key(error_line: str | None) -> str | None:
    """What "the same error" means when two failures are compared: the line on one line, cleaned,
    without addresses and process ids, and bounded (its start plus a hash of all of it). Two runs
    of a deterministic failure give the same key however long the line is; lines that differ
    anywhere give different keys."""
    if error_line is None:
        return None
    text = _VOLATILE.sub("#", one_line(clean(error_line)))
    if len(text) <= FAILURE_KEY_LEN:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{text[:FAILURE_KEY_LEN - 18]}{ELLIPSIS}#{digest}"


def _label(ev: Evidence) -> str:
    return ev.error_line or ev.signature or "unknown cause"
