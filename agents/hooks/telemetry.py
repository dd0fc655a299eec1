"""What the hooks say about each step: logs, events, step reports, and the cross-rank exchange.

Events that are the same on every rank (a skipped step under DDP, a resume, a checkpoint) are
logged on every rank but reported by rank 0 only; events about one rank's own numbers (its loss
is NaN or spiking) are reported by that rank. Likewise rank 0 reports every step for the job and
the other ranks only the steps they flagged. Every rank's timings travel in the cross-rank
exchange and rank 0 reports them per node (``agents.hooks.windows``): what the control plane
stores grows with steps and nodes, not with ranks.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from agents.detectors import GuardDecision
from agents.hooks.guards import Consistency, DriftWatch, GuardSettings, LossVerdict, SpreadWatch, judge_consistency
from agents.hooks.reporter import DROPPABLE, Reporter
from agents.hooks.settings import Environment
from agents.hooks.topology import Topology
from agents.hooks.windows import RankTimings, node_windows
from agents.http import ControlPlaneClient
from agents.protocol.hooks import CheckpointCommit, Event, StepReport
from agents.spool import Spool

if TYPE_CHECKING:
    from agents.hooks.api import StepOutcome
    from agents.hooks.checkpointer import Commit

log = logging.getLogger("nightwatch.hooks")

SPOOL_MAX_RECORDS = 100_000
#: The exchange's leading floats: loss, grad norm, rank 0's control flags, the rank's mean loss
#: over the window (for the drift check) and which of its recent steps it judged a loss spike
#: (``Telemetry.spike_mask``: bit k is the step k steps before the exchange's).
CONTROL_FIELDS = 8
SPIKE_MASK_FIELD = 7
#: Steps a spike mask can cover: the bits a float holds exactly.
SPIKE_MASK_MAX_STEPS = 52
#: Sent at once, not at the reporter's next tick: they may pause the job, or (``run_ending``) hold
#: the hang sweep while a finished run saves and exits.
URGENT = frozenset({"nan", "spike", "divergence", "inconsistency", "run_ending"})


@dataclass(frozen=True)
class Exchange:
    """What the ranks agreed on at an exchange step (the same on every rank)."""

    consistency: Consistency
    stale: bool  # any rank was told its generation is stale
    pause: bool  # rank 0's control said pause
    checkpoint_now: bool
    checkpoint_interval: int | None


class Telemetry:
    def __init__(self, env: Environment, topology: Topology, settings: GuardSettings):
        self.env = env
        self.topology = topology
        self.settings = settings
        self.reporter: Reporter | None = None
        if env.url:
            spool = Spool(env.spool_path(topology.rank), max_records=SPOOL_MAX_RECORDS,
                          droppable_kinds=DROPPABLE)
            self.reporter = Reporter(ControlPlaneClient(env.url, env.token), spool, job=env.job,
                                     generation=env.generation, rank=topology.rank,
                                     poll_control=topology.rank == 0)
        self._input_s = 0.0
        self._later_input_s = 0.0
        self._batch_handed_out = time.perf_counter()
        self._event_numbers: Counter[tuple[int, str]] = Counter()
        self._timings = RankTimings()
        self._drift = DriftWatch(settings.detection)
        #: Two windows: room for a spike a rank saw just before a missed or late exchange.
        self._mask_steps = min(2 * settings.check_every, SPIKE_MASK_MAX_STEPS)
        self._spike_steps: deque[int] = deque(maxlen=self._mask_steps)
        self._held: list[tuple[int, LossVerdict, float]] = []  # (step, verdict, loss) awaiting the others' word
        self._spread = SpreadWatch(settings.spread_threshold, hold=settings.spread_hold, now=settings.spread_now)

    # -- timing --------------------------------------------------------------------------------

    def begin_step(self, input_s: float, *, continuing: bool = False) -> None:
        """A batch was handed out after ``input_s`` of waiting. ``continuing``: a later micro-batch
        of the same accumulation window, whose wait adds to the step's input time, not its compute."""
        if continuing:
            self._input_s += input_s
            self._later_input_s += input_s
            return
        self._input_s = input_s
        self._later_input_s = 0.0
        self._batch_handed_out = time.perf_counter()

    def compute_done(self, now: float) -> float:
        return now - self._batch_handed_out - self._later_input_s

    # -- the cross-rank exchange ---------------------------------------------------------------

    def exchange(self, step: int, loss: float, grad_norm: float, window_loss: float = math.nan) -> Exchange:
        """All-gather (loss, grad norm, control flags, step timings): a collective, called at the
        same step everywhere.

        Only rank 0 polls the control plane; sharing its answer here is what makes every rank
        checkpoint or pause at the same step, which DCP's collectives require. Rank 0 also reports
        the timings of every node's ranks since the previous exchange.
        """
        reporter = self.reporter
        stale = pause = checkpoint_now = False
        interval = 0
        if reporter is not None:
            stale = reporter.stale
            if self.topology.rank == 0:
                pause = reporter.pause_requested
                checkpoint_now = reporter.take_checkpoint_request()
                interval = reporter.checkpoint_interval or 0
        timings, self._timings = self._timings, RankTimings()
        rows = self.topology.all_gather_floats(
            [loss, grad_norm, float(stale), float(pause), float(checkpoint_now), float(interval), window_loss,
             float(self.spike_mask(step)), *timings.row(self.topology.node)])
        if self._held:
            self._judge_held(step, rows)
        if reporter is not None and self.topology.rank == 0:
            for window in node_windows([r[CONTROL_FIELDS:] for r in rows], job=self.env.job,
                                       generation=self.env.generation, time=time.time()):
                reporter.window(window)
        means, losses = [r[6] for r in rows], [r[0] for r in rows]
        drift = self._drift.judge(means)
        disagreement = self._spread.judge(means, losses)
        consistency = judge_consistency(losses, [r[1] for r in rows], self.settings.spread_threshold, drift,
                                        disagreement=disagreement)
        if consistency.inconsistent:
            suspect = consistency.suspect_rank
            node = int(rows[suspect][CONTROL_FIELDS]) if suspect is not None else None
            drifted = (f", its mean loss {consistency.drift:+.1%} off the others'" if consistency.drift is not None
                       else "")
            if disagreement is not None:
                drifted += f", mean-loss spread {disagreement.spread:.3g} for {disagreement.held} exchange(s)"
            self.event(step, "inconsistency",
                       f"ranks disagree at step {step}: loss spread {consistency.loss_spread:.3g}, "
                       f"grad-norm spread {consistency.grad_norm_spread:.3g}, suspect rank {suspect}"
                       f" on node {node}{drifted}",
                       {"losses": consistency.losses, "grad_norms": consistency.grad_norms,
                        "loss_spread": consistency.loss_spread, "grad_norm_spread": consistency.grad_norm_spread,
                        "suspect_rank": suspect, "suspect_node": node, "drift": consistency.drift,
                        "mean_loss_spread": disagreement.spread if disagreement else None,
                        "held": disagreement.held if disagreement else None,
                        "window_losses": [r[6] if math.isfinite(r[6]) else None for r in rows]},
                       level=logging.WARNING)
        leader = rows[0]
        return Exchange(consistency, stale=any(r[2] for r in rows), pause=bool(leader[3]),
                        checkpoint_now=bool(leader[4]), checkpoint_interval=int(leader[5]) or None)

    def judged(self, step: int, verdict: LossVerdict, loss: float) -> None:
        """The loss watch's verdict on ``step``, as soon as it is made (before the step's exchange):
        a spike goes into this rank's mask, and a lone one rank 0 would pause on is held for the
        other ranks' word (``_judge_held``) at this exchange or the next."""
        if verdict.spike:
            self._spike_steps.append(step)
        if self._holds(verdict):
            self._held.append((step, verdict, loss))

    def _holds(self, verdict: LossVerdict) -> bool:
        return verdict.alone and self.topology.world_size > 1

    def spike_mask(self, step: int) -> int:
        """Which of the steps before ``step`` (bit k: ``step - k``) this rank judged a loss spike."""
        return sum(1 << (step - s) for s in self._spike_steps if 0 <= step - s < self._mask_steps)

    def _judge_held(self, step: int, rows: list[list[float]]) -> None:
        """A lone spike whose update was applied pauses only if the other ranks saw it too (at least
        half of them): the model's spike shows on every rank's batch, one rank's hard micro-batch on
        its own. Rank 0's four-sample loss jumped +16-25 % three times in a 30-minute chaos run
        while the other rank's did not; each paused the job and paged the on-call."""
        me, others = self.topology.rank, len(rows) - 1
        for spiked, verdict, loss in self._held:
            offset = step - spiked
            if offset >= self._mask_steps:  # too old to tell: the verdict stands
                self._verdict_event(spiked, replace(verdict, alone=False), loss)
                continue
            seen = sum(1 for rank, row in enumerate(rows) if rank != me and _bit(row[SPIKE_MASK_FIELD], offset))
            if 2 * seen >= others:
                judged = replace(verdict, alone=False, reason=f"{verdict.reason}; {seen} of {others} other ranks "
                                                              "saw it too")
            else:
                judged = replace(verdict, action="marker", alone=False,
                                 reason=f"a loss spike on this rank's batch alone ({seen} of {others} other ranks "
                                        "saw it): not the model's")
            self._verdict_event(spiked, judged, loss, {"ranks_saw": seen, "ranks_asked": others})
        self._held = []

    def _verdict_event(self, step: int, verdict: LossVerdict, loss: float, extra: dict[str, Any] | None = None) -> None:
        # Judged here, once, as the step happened (or, for a lone spike, at the next exchange): the
        # control plane acts on ``action`` and does not re-judge, so how the reports are batched
        # cannot change the outcome.
        score = f", z={verdict.score:.1f}" if verdict.score is not None else ""
        baseline = f" over baseline {verdict.baseline:.4g}" if verdict.baseline is not None else ""
        self.event(step, verdict.kind or "", f"{verdict.reason} at step {step}: loss {loss:.4g}{baseline}"
                   f"{score} ({verdict.action})", {**verdict.detail(loss), **(extra or {})},
                   level=logging.WARNING, local=True)

    # -- per step ------------------------------------------------------------------------------

    def step_done(self, outcome: StepOutcome, decision: GuardDecision, verdict: LossVerdict, *,
                  compute_s: float, optimizer_s: float, checkpoint_s: float,
                  data_cursor: int, samples: int, tokens: int) -> None:
        step = outcome.step
        if decision.skip:
            self.event(step, "guard_skip", f"{'skipped' if outcome.skipped else 'kept (reporting only)'} "
                       f"step {step}: {decision.reason}",
                       {"grad_norm": outcome.grad_norm, "median": decision.median, "reason": decision.reason},
                       level=logging.WARNING)
        own_loss_bad = not math.isfinite(outcome.loss)
        if outcome.nan and (own_loss_bad or self.topology.rank == 0):
            self.event(step, "nan", f"non-finite {'loss' if own_loss_bad else 'gradient norm'} at step {step}",
                       {"loss": outcome.loss, "grad_norm": outcome.grad_norm}, level=logging.WARNING, local=True)
        if verdict.kind in ("spike", "level_shift", "divergence") and not self._holds(verdict):
            self._verdict_event(step, verdict, outcome.loss)
        phases = {"input": self._input_s, "compute": compute_s, "optimizer": optimizer_s, "checkpoint": checkpoint_s}
        self._timings.add(step, phases)
        flagged = outcome.skipped or outcome.spike or outcome.nan or outcome.inconsistent
        if self.reporter is None or not (flagged or self.topology.rank == 0):
            return
        self.reporter.report(StepReport(
            job=self.env.job, generation=self.env.generation, rank=self.topology.rank, step=step,
            loss=outcome.loss, grad_norm=outcome.grad_norm, world_size=self.topology.world_size,
            data_cursor=data_cursor, samples=samples, tokens=tokens, phases=phases,
            skipped=outcome.skipped, spike=outcome.spike, nan=outcome.nan, inconsistent=outcome.inconsistent,
            time=time.time()))

    def event(self, step: int, kind: str, message: str, detail: dict[str, Any] | None = None, *,
              level: int | None = logging.INFO, local: bool = False) -> None:
        """Log ``message`` here (unless ``level`` is None: already logged); report it from rank 0,
        or from this rank when ``local``."""
        if level is not None:
            log.log(level, message)
        if self.reporter is None or not (local or self.topology.rank == 0):
            return
        urgent = kind in URGENT and (kind != "spike" or (detail or {}).get("action") == "pause")
        number = self._event_numbers[(step, kind)]
        self._event_numbers[(step, kind)] += 1
        # The key names the occurrence, so a replay after a crash is recognised as the same event,
        # while the same event on a later torchrun attempt, or in-process round, is a new one.
        key = f"{self.topology.attempt}:{self.topology.rank}:{step}:{kind}:{number}"
        self.reporter.event(Event(job=self.env.job, generation=self.env.generation, rank=self.topology.rank,
                                  step=step, kind=kind, key=key, message=message[:2000],
                                  detail=_without_nulls(detail), time=time.time()), urgent=urgent)

    def checkpoint_committed(self, commit: Commit, config_hash: str) -> None:
        """Called on rank 0 by the commit thread once the marker is on disk."""
        manifest = commit.manifest
        self.event(commit.step, "checkpoint_saved", f"checkpoint saved at step {commit.step}: {commit.path}",
                   {"path": commit.path, "blocking_s": commit.blocking_s, "total_s": commit.total_s})
        if self.reporter is None:
            return
        loss = manifest.get("loss")
        self.reporter.commit(CheckpointCommit(
            job=self.env.job, generation=self.env.generation, step=commit.step, path=commit.path,
            loss=math.nan if loss is None else loss, config_hash=config_hash,
            data_cursor=manifest["data_cursor"], world_size=manifest["world_size"],
            size_bytes=commit.size_bytes, blocking_s=commit.blocking_s, total_s=commit.total_s,
            manifest=manifest))

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()


def _without_nulls(detail: dict[str, Any] | None) -> dict[str, Any]:
    """The wire schema has no null detail values: an unknown value is simply left out."""
    return {key: value for key, value in (detail or {}).items() if value is not None}


def _bit(mask: float, k: int) -> bool:
    return math.isfinite(mask) and bool(int(mask) >> k & 1)
