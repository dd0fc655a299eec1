"""How well the detectors do on labelled traces: precision, recall and delay, per kind, of pauses
(what wakes a human) and of markers (what the chart shows), with 1 s and 0.1 s steps.

    python -m bench.detect [--quick] [--detectors product|legacy|naive]

The traces come from ``bench._traces`` (seeded; see its docstring for what they hold). Each one is
run through the product's own path:

- per rank, the hooks' ``GradientGuard`` and ``LossWatch`` judge every step, and the real
  ``Telemetry.step_done`` / ``Telemetry.exchange`` (a stand-in collective hands rank 0 every rank's
  row) turn the verdicts into the step reports and events the reporter would send;
- the records are cut into batches as ``Reporter`` does: one per flush tick (1 s), or at once when an
  urgent event (one that may pause) is queued. 1 s steps put one step in a batch, 0.1 s steps ten;
- each batch goes through ``jobs.detection.judge_batch`` (what ``jobs.ingest`` calls) and the
  orchestrator's precedence (NaN > disagreeing rank > divergence > spike; a disagreeing rank that
  follows a spike pause re-classifies it); a pause stands for the fault it overlaps;
- step times become node windows through the hooks' ``RankTimings``/``node_windows`` and the control
  plane's ``agents.detectors.find_straggler`` over the newest windows (what ``jobs.stragglers`` reads).

Besides the synthetic suite, the curves of real small runs of ``examples/train.py`` with faults
injected for real (``bench/real_traces.json``, made by ``python -m bench.real_traces``) go through
the same path and are reported as a kind of their own ("real runs"): 2 ranks on one node, so the
straggler is judged against the rest of its node, with the bar for noisy step times
(``REAL_STRAGGLER_RATIO``: CPU ranks on a shared machine).

``--detectors legacy`` runs the rules as they were before issue 23 (spike z > 6 over a 50-step window
with the spikes kept in it, a pause after 3 consecutive spikes, the 0.5 spread check, no divergence
and no straggler detector, the dashboard's 1.25× straggler highlight as the only straggler mark);
``--detectors naive`` the rules a user would write by hand (a loss above 1.2× its trailing median
pauses; a rank whose windows are 1.08× the job's median is a straggler).
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from agents import detectors
from agents.hooks.guards import GradientGuard, GuardSettings, LossWatch, judge_consistency
from agents.hooks.settings import Environment
from agents.hooks.topology import Topology
from agents.hooks.windows import RankTimings, node_windows
from agents.protocol.hooks import Event, StepReport
from bench import _common, _traces, real_traces
from jobs import detection

CHECK_EVERY = 10
FLUSH_S = 1.0
#: After a pause, further flags within this many steps belong to the same incident (the job is stopping).
QUIESCE_STEPS = 20
#: A pause or mark this many steps after a short fault's last step still counts for it.
GRACE = 30


@dataclass
class Incident:
    step: int  # the newest step of the batch that raised it: when the control plane knew
    judged_step: int  # the step the verdict was about
    kind: str  # nan, spike, divergence, corruption
    rank: int | None = None
    node: int | None = None


@dataclass
class Outcome:
    pauses: list[Incident] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)  # (step, event kind)


class Capture:
    """Stands in for ``Reporter``: keeps what the hooks queue, cut into batches by flush tick."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.queue: list[Any] = []
        self.batches: list[tuple[int, list[Any]]] = []
        self.now_step = 0

    def report(self, r: StepReport) -> None:
        self.queue.append(r)

    def window(self, w: Any) -> None:
        self.queue.append(w)

    def event(self, e: Event, *, urgent: bool = False) -> None:
        self.queue.append(e)
        if urgent:
            self.cut()

    def commit(self, c: Any) -> None:
        self.cut()

    def tick(self, step: int) -> None:
        """The end of ``step``: a flush tick passed since the previous step cuts a batch."""
        self.now_step = step
        if math.floor(step * self.step_s / FLUSH_S + 1e-9) > math.floor((step - 1) * self.step_s / FLUSH_S + 1e-9):
            self.cut()

    def cut(self) -> None:
        if self.queue:
            self.batches.append((self.now_step, self.queue))
            self.queue = []

    stale = False
    pause_requested = False
    checkpoint_interval = None

    def take_checkpoint_request(self) -> bool:
        return False


class Gather(Topology):
    """Rank 0's view of the exchange: the other ranks' rows are handed in by the bench."""

    others: list[list[float]] = []

    def all_gather_floats(self, values: list[float]) -> list[list[float]]:
        return [list(values), *self.others]


# -- loss traces ------------------------------------------------------------------------------

def run_loss_product(trace: _traces.LossTrace, step_s: float) -> Outcome:
    from agents.hooks.api import StepOutcome
    from agents.hooks.telemetry import Telemetry

    settings = GuardSettings(check_every=CHECK_EVERY)
    ranks = len(trace.losses)
    guards = [GradientGuard(settings) for _ in range(ranks)]
    watches = [LossWatch(settings.detection, speaks_for_job=r == 0) for r in range(ranks)]
    captures = [Capture(step_s) for _ in range(ranks)]
    tels = []
    for r in range(ranks):
        topo = Gather(rank=r, world_size=ranks, node=r) if r == 0 else Topology(rank=r, world_size=ranks, node=r)
        tel = Telemetry(Environment(), topo, settings)
        tel.reporter = captures[r]  # type: ignore[assignment]
        tels.append(tel)
    inconsistent = False
    out = Outcome()
    server = Server(out)
    for t in range(1, trace.steps + 1):
        grad = trace.grad_norms[t - 1]
        for r in range(ranks):
            captures[r].now_step = t
            loss = trace.losses[r][t - 1]
            decision = guards[r].judge(grad)
            skipped = decision.skip
            verdict = watches[r].observe(loss, lr=trace.lrs[t - 1], skipped=skipped)
            tels[r].judged(t, verdict, loss)
            if t % CHECK_EVERY == 0 and r == ranks - 1:
                means = [w.take_window_mean() for w in watches]
                rows = [[trace.losses[q][t - 1], grad, 0.0, 0.0, 0.0, 0.0, means[q], float(tels[q].spike_mask(t)),
                         *RankTimings(steps=1, first_step=t, last_step=t, total_s=step_s, max_s=step_s).row(q)]
                        for q in range(ranks)]
                Gather.others = rows[1:]
                exchange = tels[0].exchange(t, rows[0][0], grad, means[0])
                inconsistent = exchange.consistency.inconsistent
            nan = not math.isfinite(loss) or not math.isfinite(grad)
            outcome = StepOutcome(t, loss, grad, skipped, verdict.spike, nan, inconsistent)
            tels[r].step_done(outcome, decision, verdict, compute_s=step_s, optimizer_s=0.0, checkpoint_s=0.0,
                              data_cursor=t, samples=1, tokens=0)
        for c in captures:
            c.tick(t)
        for c in captures:
            for step, batch in c.batches:
                server.judge(step, batch)
            c.batches = []
    return out


class Server:
    """``jobs.detection.judge_batch`` and the orchestrator's precedence, per batch."""

    def __init__(self, out: Outcome):
        self.out = out
        self.open: Incident | None = None

    def judge(self, step: int, batch: list[Any]) -> None:
        reports = [x for x in batch if isinstance(x, StepReport)]
        events = [x for x in batch if isinstance(x, Event)]
        for e in events:
            if e.kind in ("spike", "level_shift", "divergence"):
                self.out.marks.append((e.step, e.kind))
        flags = detection.judge_batch(reports, events, spike_limit=3)
        if not flags.any:
            return
        quiescing = self.open is not None and step - self.open.step <= QUIESCE_STEPS
        inconsistency = next((e for e in events if e.kind == "inconsistency"), None)
        if flags.nan:
            first = min([r.step for r in reports if r.nan or not math.isfinite(r.loss)]
                        + [e.step for e in events if e.kind == "nan"])
            incident = Incident(step, first, "nan")
        elif flags.inconsistent:
            rank = inconsistency.detail.get("suspect_rank") if inconsistency else None
            first = inconsistency.step if inconsistency else step
            incident = Incident(step, first, "corruption", rank, rank)
            if quiescing and self.open is not None and self.open.kind in ("spike", "divergence"):
                self.open.kind, self.open.rank, self.open.node = "corruption", rank, rank  # precedence
                return
        elif flags.divergence:
            incident = Incident(step, flags.divergence["step"], "divergence")
        else:
            assert flags.spike is not None
            incident = Incident(step, flags.spike["step"], "spike")
        if quiescing:
            return
        self.open = incident
        self.out.pauses.append(incident)


def run_loss_legacy(trace: _traces.LossTrace, step_s: float, naive: bool = False) -> Outcome:
    """The rules before issue 23 (or the naive one), batched the same way."""
    out = Outcome()
    ranks = len(trace.losses)
    windows = [deque(maxlen=50) for _ in range(ranks)]
    consecutive = [0] * ranks
    per_batch = max(1, round(FLUSH_S / step_s))
    batch_flags: list[tuple[int, str, int | None]] = []
    open_at = -10**9
    for t in range(1, trace.steps + 1):
        for r in range(ranks):
            loss = trace.losses[r][t - 1]
            if not math.isfinite(loss):
                batch_flags.append((t, "nan", None))
                continue
            recent = windows[r]
            if naive:
                spike = len(recent) >= 10 and loss > 1.2 * statistics.median(recent)
                if spike:
                    batch_flags.append((t, "spike", None))
                    out.marks.append((t, "spike"))
            else:
                spike = detectors.is_loss_spike(loss, recent, z_threshold=6.0, min_history=10)
                consecutive[r] = consecutive[r] + 1 if spike else 0
                if spike:
                    out.marks.append((t, "spike"))
                    if consecutive[r] >= 3:
                        batch_flags.append((t, "spike", None))
            recent.append(loss)
        if t % CHECK_EVERY == 0 and not naive:
            losses = [trace.losses[r][t - 1] for r in range(ranks)]
            c = judge_consistency(losses, [trace.grad_norms[t - 1]] * ranks, 0.5)
            if c.inconsistent:
                batch_flags.append((t, "corruption", c.suspect_rank))
        if t % per_batch == 0 and batch_flags:
            order = {"nan": 0, "corruption": 1, "spike": 2}
            first = min(batch_flags, key=lambda f: order[f[1]])
            if t - open_at > QUIESCE_STEPS:
                out.pauses.append(Incident(t, first[0], first[1], first[2], first[2]))
                open_at = t
            batch_flags = []
    return out


# -- scoring ----------------------------------------------------------------------------------

MATCHES = {"spike": {"spike", "nan", "divergence", "corruption"}, "broad_spike": {"spike", "divergence", "corruption"},
           "nan": {"nan"}, "divergence": {"divergence", "spike"}, "divergent_rank": {"corruption"}}


def score_loss(trace: _traces.LossTrace, out: Outcome, tally: dict[str, Any]) -> None:
    faults = [lab for lab in trace.labels if lab.kind in MATCHES]
    claimed: set[int] = set()
    for lab in faults:
        end = trace.steps if lab.kind in ("divergence", "divergent_rank") else lab.end + GRACE
        hit = None
        for i, p in enumerate(out.pauses):
            if lab.start <= p.judged_step <= end and p.kind in MATCHES[lab.kind] and i not in claimed:
                if lab.kind == "divergent_rank" and p.rank != lab.rank:
                    continue
                hit = (i, p)
                break
        stats = tally["pause"][lab.kind]
        stats["n"] += 1
        if hit:
            claimed.add(hit[0])
            stats["found"] += 1
            stats["delays"].append(hit[1].judged_step - lab.start)
            stats["server_delays"].append(hit[1].step - lab.start)
        until = trace.steps if lab.kind in ("divergence", "divergent_rank") else lab.end + GRACE
        marked = any(lab.start <= s <= until for s, _ in out.marks) or bool(hit)
        tally["mark"][lab.kind]["n"] += 1
        tally["mark"][lab.kind]["found"] += int(marked)
    # Pauses not explained by a fault are false: name the look-alike they sat on.
    for i, p in enumerate(out.pauses):
        if i in claimed:
            continue
        explained = any(lab.start <= p.judged_step <= (trace.steps if lab.kind in ("divergence", "divergent_rank")
                                                       else lab.end + GRACE) for lab in faults)
        if explained:
            tally["pause_dup_or_wrong_kind"] += 1
            continue
        near = [lab.kind for lab in trace.labels if lab.start - 5 <= p.judged_step <= lab.end + GRACE]
        tally["false_pauses"][near[0] if near else "unexplained"] += 1
    for lab in trace.labels:
        if lab.kind in ("skipped_spike", "level_shift"):
            marked = any(lab.start <= s <= lab.end + GRACE for s, _ in out.marks)
            tally["mark"][lab.kind]["n"] += 1
            tally["mark"][lab.kind]["found"] += int(marked)
    # Mark precision: marks (one per episode of adjacent steps) inside a labelled window.
    windows = [(lab.start, trace.steps if lab.kind in ("divergence", "divergent_rank") else lab.end + GRACE)
               for lab in trace.labels if lab.kind in MATCHES or lab.kind in _traces.MARKER_KINDS]
    last = -10
    for s, _ in sorted(out.marks):
        if s - last > 3:
            tally["marks_total"] += 1
            tally["marks_true"] += int(any(a <= s <= b for a, b in windows))
            if not any(a <= s <= b for a, b in windows):
                near = [lab.kind for lab in trace.labels if lab.start - 5 <= s <= lab.end + GRACE]
                tally["false_marks"][near[0] if near else "unexplained"] += 1
        last = s


# -- step-time traces ---------------------------------------------------------------------------

#: The real runs' CPU ranks share a loaded 2-core machine: their step times vary by tens of per cent
#: from window to window, so they are judged with the bar the product offers for noisy step times
#: (``NIGHTWATCH_STRAGGLER_RATIO``; the e2e straggler test uses the same 1.25).
REAL_STRAGGLER_RATIO = 1.25


def run_timing(trace: _traces.TimingTrace, scale: float, rule: str,
               policy: detectors.DetectionPolicy | None = None) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(rank, node, step) of each straggler raised; steps of dashboard-highlight marks."""
    world = len(trace.phases)
    policy = policy or detectors.DetectionPolicy()
    seen: deque[list[detectors.WindowFigures]] = deque(maxlen=3 * policy.straggler_windows)
    raised: list[tuple[int, int, int]] = []
    named: set[int] = set()
    marks: list[int] = []
    timings = [RankTimings() for _ in range(world)]
    naive_held: dict[int, int] = defaultdict(int)
    for t in range(1, trace.steps + 1):
        for r in range(world):
            timings[r].add(t, {k: v * scale for k, v in trace.phases[r][t - 1].items()})
        if t % CHECK_EVERY:
            continue
        rows = [timings[r].row(trace.node_of[r]) for r in range(world)]
        timings = [RankTimings() for _ in range(world)]
        windows = node_windows(rows, job="bench", generation=1, time=time.time())
        figures = [detectors.WindowFigures(w.node, w.ranks, w.step_median_s, w.slowest_rank, w.slowest_s,
                                           w.slowest_phases, w.phases) for w in windows]
        median = statistics.median(w.step_median_s for w in windows)
        for w in windows:
            if w.slowest_s >= 1.25 * median:
                marks.append(t)
        if rule == "product":
            seen.append(figures)
            found = detectors.find_straggler(list(seen), policy)
            if found and found.rank not in named:
                named.add(found.rank)
                raised.append((found.rank, found.node, t))
        elif rule == "naive":
            for w in windows:
                slow = w.slowest_s >= 1.08 * median
                naive_held[w.slowest_rank] = naive_held[w.slowest_rank] + 1 if slow else 0
                if naive_held[w.slowest_rank] >= 3 and w.slowest_rank not in named:
                    named.add(w.slowest_rank)
                    raised.append((w.slowest_rank, w.node, t))
    return raised, marks


def score_timing(trace: _traces.TimingTrace, raised: list[tuple[int, int, int]], marks: list[int],
                 tally: dict[str, Any]) -> None:
    label = next((lab for lab in trace.labels if lab.kind == "straggler"), None)
    kind = f"straggler-{label.detail['phase']}-{label.detail['pattern']}" if label else None
    if label is not None:
        stats = tally["pause"][kind]
        stats["n"] += 1
        hit = next(((r, n, s) for r, n, s in raised if r == label.rank and n == label.node and s >= label.start), None)
        if hit:
            stats["found"] += 1
            stats["delays"].append(hit[2] - label.start)
            stats["server_delays"].append(hit[2] - label.start)
        tally["mark"][kind]["n"] += 1
        tally["mark"][kind]["found"] += int(any(s >= label.start for s in marks))
    for r, _node, s in raised:
        if label is None or r != label.rank or s < label.start:
            near = [lab.kind for lab in trace.labels if lab.kind != "straggler" and lab.start - 20 <= s <= lab.end + 50]
            tally["false_pauses"][near[0] if near else "unexplained"] += 1
    for s in marks:
        tally["marks_total"] += 1
        true = label is not None and s >= label.start
        tally["marks_true"] += int(true)
        if not true:
            near = [lab.kind for lab in trace.labels if lab.start - 10 <= s <= lab.end + 10]
            tally["false_marks"][near[0] if near else "unexplained"] += 1


# -- the run ------------------------------------------------------------------------------------

def new_tally() -> dict[str, Any]:
    def kind() -> dict[str, Any]:
        return {"n": 0, "found": 0, "delays": [], "server_delays": []}
    return {"pause": defaultdict(kind), "mark": defaultdict(kind), "false_pauses": defaultdict(int),
            "false_marks": defaultdict(int), "marks_total": 0, "marks_true": 0, "pause_dup_or_wrong_kind": 0}


def summarise(tally: dict[str, Any]) -> dict[str, Any]:
    kinds = {}
    found = sum(s["found"] for s in tally["pause"].values())
    false = sum(tally["false_pauses"].values())
    for name, s in sorted(tally["pause"].items()):
        delays, server = s["delays"], s["server_delays"]
        kinds[name] = {"faults": s["n"], "paused": s["found"],
                       "recall": round(s["found"] / s["n"], 3) if s["n"] else None,
                       "median_delay_steps": statistics.median(delays) if delays else None,
                       "max_delay_steps": max(delays) if delays else None,
                       "median_server_delay_steps": statistics.median(server) if server else None}
    marks = {name: {"n": s["n"], "marked": s["found"], "recall": round(s["found"] / s["n"], 3) if s["n"] else None}
             for name, s in sorted(tally["mark"].items())}
    return {"pause_precision": round(found / (found + false), 4) if found + false else None,
            "pauses_true": found, "pauses_false": false, "false_pauses_on": dict(tally["false_pauses"]),
            "pauses_extra_same_fault": tally["pause_dup_or_wrong_kind"], "pause": kinds, "mark": marks,
            "mark_precision": round(tally["marks_true"] / tally["marks_total"], 4) if tally["marks_total"] else None,
            "marks_total": tally["marks_total"], "false_marks_on": dict(tally["false_marks"])}


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--detectors", choices=("product", "legacy", "naive"), default="product")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.getLogger("nightwatch").setLevel(logging.CRITICAL)  # the hooks' own log lines, thousands of them
    started = time.perf_counter()
    loss_traces = _traces.loss_suite(args.seed, quick=args.quick)
    timing_traces = _traces.timing_suite(args.seed + 1, quick=args.quick)
    real_loss, real_timing = real_traces.load()
    results: dict[str, Any] = {}
    for step_s in (1.0, 0.1):
        for suite, losses, timings in (("", loss_traces, timing_traces), ("real runs, ", real_loss, real_timing)):
            tally = new_tally()
            for trace in losses:
                if args.detectors == "product":
                    out = run_loss_product(trace, step_s)
                else:
                    out = run_loss_legacy(trace, step_s, naive=args.detectors == "naive")
                score_loss(trace, out, tally)
            for trace in timings:
                # The real runs' step times are what they were: the 0.1 s column runs them as measured too.
                real = detectors.DetectionPolicy(straggler_ratio=REAL_STRAGGLER_RATIO) if suite else None
                raised, marks = run_timing(trace, step_s if not suite else 1.0, args.detectors, real)
                score_timing(trace, raised, marks, tally)
            results[f"{suite}{step_s:g}s"] = summarise(tally)
    for name, res in results.items():
        print(f"\n== {args.detectors} detectors, {name} steps: pause precision {res['pause_precision']} "
              f"({res['pauses_true']} true, {res['pauses_false']} false: {res['false_pauses_on']}); "
              f"mark precision {res['mark_precision']} of {res['marks_total']} (false on {res['false_marks_on']})")
        print(f"{'kind':32} {'faults':>6} {'paused':>6} {'recall':>6} {'delay':>6} {'max':>5} {'srv':>5} {'marked':>7}")
        for kind, s in res["pause"].items():
            m = res["mark"].get(kind, {})
            print(f"{kind:32} {s['faults']:6} {s['paused']:6} {s['recall']!s:>6} {s['median_delay_steps']!s:>6} "
                  f"{s['max_delay_steps']!s:>5} {s['median_server_delay_steps']!s:>5} {m.get('recall')!s:>7}")
        for kind, m in res["mark"].items():
            if kind not in res["pause"]:
                print(f"{kind:32} {'(marker expected)':>20} marked {m['marked']}/{m['n']}")
    worst = min((k["recall"] for res in results.values() for k in res["pause"].values() if k["recall"] is not None),
                default=None)
    _common.emit("detect", metric="min_pause_recall", value=worst, target=0.98, better="higher", unit="ratio",
                 runs=1, spread=None,
                 details={"detectors": args.detectors, "seed": args.seed, "quick": args.quick,
                          "loss_traces": len(loss_traces), "timing_traces": len(timing_traces),
                          "real_runs": {"loss_traces": len(real_loss), "timing_traces": len(real_timing),
                                        "fixture": "bench/real_traces.json", "made_by": real_traces.COMMAND},
                          "targets": {"pause_precision": 0.98, "pause_recall": 0.98, "benign_pauses": 0,
                                      "delay_spike_nan": 0, "delay_straggler": 100, "delay_divergence": 300},
                          "seconds": round(time.perf_counter() - started, 1), **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
