"""Labelled synthetic traces for ``bench.detect``: training curves and per-rank step times, faults
injected with labels, benign look-alikes labelled as such. Seeded: the same seed gives the same
suite.

Loss traces (one job, ``RANKS`` data-parallel ranks):

- a power-law curve ``a + b·(t + t0)^-α`` with a warm-up (linear LR ramp, a faster early fall),
  a cosine LR schedule, and per trace some of: LR restarts (the LR jumps back up and the loss bumps
  +2–6 % then decays over ~150 steps), LR drops, data-mix level shifts (+2–6 %, permanent), hard
  single batches (one rank, +3–8 %), noisy stretches (noise ×2–2.5 for hundreds of steps);
- heavy-tailed noise (Student t, 5 degrees of freedom, clipped at 5σ), per rank: each rank sees
  other batches;
- a gradient norm that follows the loss with its own log-normal noise and bumps with LR restarts.

Faults, each labelled with the action that is right for it:

- ``spike``: 1–3 steps, ×1.2 to ×8 (log-uniform), on every rank (the model, not one batch); the
  gradient norm rises with it but stays under the guard's skip bar: expect a pause, delay 0;
- ``skipped_spike``: one step, ×2–×8 with a gradient explosion the guard skips: expect a marker;
- ``broad_spike``: rises over 10–40 steps to ×1.3–×2.5 and falls back: expect a pause;
- ``nan``: a NaN or Inf loss on one rank: expect a pause, delay 0;
- ``divergence``: the loss rises 0.03–0.1 % a step until the end (+10 % after 100–330 steps):
  expect a pause proposing a rollback, within 300 steps;
- ``divergent_rank``: one rank's loss drifts from the others by 3–10 % (reached over 0–100 steps)
  and stays: expect a pause naming that rank.

Step-time traces (``NODES`` nodes × ``RANKS_PER_NODE`` ranks), per rank and step, in the phases the
hooks report: per-rank offsets (±2 %), per-step jitter, network jitter on the communication
(``optimizer``) phase, whole-job checkpoint stalls, one-step hiccups of single ranks (×3–×10), and
``straggler`` faults: one rank 5–50 % slower in its compute or its communication phase, steady or
intermittent (on/off stretches of 100–300 steps), until the end: expect a straggler incident naming
the rank and node within 100 steps.

Step times are modelled as the hooks report them: ``compute`` is a rank's own forward and backward
(to its last gradient bucket), and the peers of a compute-slow rank wait for it in the all-reduce,
which shows in their ``optimizer`` (communication) phase. A communication-slow rank is modelled as
slow in its own ``optimizer`` phase without the others waiting — which a ring all-reduce would not
show per rank (docs/detection.md, known limits).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

RANKS = 4
NODES = 8
RANKS_PER_NODE = 4
PHASES = ("input", "compute", "optimizer", "checkpoint")

#: What each labelled kind should cause.
PAUSE_KINDS = ("spike", "broad_spike", "nan", "divergence", "divergent_rank", "straggler")
MARKER_KINDS = ("skipped_spike", "level_shift")
BENIGN_KINDS = ("lr_restart", "level_shift", "hard_batch", "noisy_stretch", "lr_drop", "checkpoint_stall",
                "hiccup", "skipped_spike")


@dataclass
class Label:
    kind: str
    start: int  # first affected step (1-based)
    end: int  # last affected step
    rank: int | None = None
    node: int | None = None
    detail: dict = field(default_factory=dict)


@dataclass
class LossTrace:
    name: str
    steps: int
    losses: list[list[float]]  # [rank][step-1]
    grad_norms: list[float]  # the all-reduced norm: the same on every rank
    lrs: list[float]
    labels: list[Label]


@dataclass
class TimingTrace:
    name: str
    steps: int
    #: [rank][step-1] -> {phase: seconds}
    phases: list[list[dict[str, float]]]
    node_of: list[int]
    labels: list[Label]


def _t4(rng: random.Random) -> float:
    """Heavy-tailed noise: Student t with 5 degrees of freedom scaled to unit variance, clipped at
    ±5 (a batch's loss is bounded; a larger jump is a labelled hard batch or fault)."""
    z = rng.gauss(0.0, 1.0)
    chi = sum(rng.gauss(0.0, 1.0) ** 2 for _ in range(5))
    return max(-5.0, min(5.0, z / math.sqrt(chi / 5.0) / math.sqrt(5.0 / 3.0)))


def _slots(rng: random.Random, count: int, lo: int, hi: int, gap: int) -> list[int]:
    """``count`` start steps in [lo, hi) at least ``gap`` apart (fewer when they do not fit)."""
    starts: list[int] = []
    for _ in range(count * 50):
        if len(starts) == count:
            break
        s = rng.randrange(lo, hi)
        if all(abs(s - o) >= gap for o in starts):
            starts.append(s)
    return sorted(starts)


def loss_trace(seed: int, *, steps: int = 3000, faults: tuple[str, ...] = (), benign: bool = True) -> LossTrace:
    rng = random.Random(seed)
    a, b, alpha, t0 = rng.uniform(1.5, 3.0), rng.uniform(2.0, 6.0), rng.uniform(0.3, 0.7), rng.uniform(20, 80)
    warmup = rng.randrange(50, 200)
    sigma = rng.uniform(0.008, 0.015)
    lr0 = 10 ** rng.uniform(-4.5, -3)
    labels: list[Label] = []
    mult = [1.0] * (steps + 2)  # multiplicative effects on the job's loss, per step
    noise = [sigma] * (steps + 2)
    grad_mult = [1.0] * (steps + 2)
    lrs = []
    restarts = []
    period = steps
    if benign and rng.random() < 0.6:
        period = rng.randrange(500, 1000)  # cosine with warm restarts
    drop_at = rng.randrange(800, steps - 200) if benign and period == steps and rng.random() < 0.5 else None
    for t in range(1, steps + 1):
        if t <= warmup:
            lr = lr0 * t / warmup
        else:
            phase = (t - warmup) % period
            if phase == 0 and t > warmup:
                restarts.append(t)
            lr = lr0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * phase / period)))
        if drop_at is not None and t >= drop_at:
            lr *= 0.3
        lrs.append(lr)
    for r in restarts:
        bump = rng.uniform(0.02, 0.06)
        for t in range(r, min(steps + 1, r + 600)):
            mult[t] *= 1 + bump * math.exp(-(t - r) / 50.0)
            grad_mult[t] *= 1 + 3 * bump * math.exp(-(t - r) / 50.0)
        labels.append(Label("lr_restart", r, min(steps, r + 150), detail={"bump": bump}))
    if drop_at is not None:
        labels.append(Label("lr_drop", drop_at, drop_at + 50))
    busy: list[tuple[int, int]] = [(r - 20, r + 200) for r in restarts]

    def free(s: int, e: int) -> bool:
        return all(e < bs or s > be for bs, be in busy)

    if benign:
        for _ in range(rng.randrange(0, 3)):
            s = rng.randrange(400, steps - 300)
            if free(s - 50, s + 250):
                shift = rng.uniform(0.02, 0.06)
                for t in range(s, steps + 1):
                    mult[t] *= 1 + shift
                busy.append((s - 50, s + 250))
                labels.append(Label("level_shift", s, s + 200, detail={"shift": shift}))
        for _ in range(rng.randrange(0, 2)):
            s = rng.randrange(300, steps - 500)
            length = rng.randrange(200, 500)
            factor = rng.uniform(2.0, 2.5)
            for t in range(s, min(steps + 1, s + length)):
                noise[t] = sigma * factor
            labels.append(Label("noisy_stretch", s, s + length))
    losses = [[0.0] * steps for _ in range(RANKS)]
    hard: dict[tuple[int, int], float] = {}
    if benign:
        for s in _slots(rng, rng.randrange(2, 12), 300, steps, 30):
            rank = rng.randrange(RANKS)
            hard[(rank, s)] = rng.uniform(0.03, 0.08)
            labels.append(Label("hard_batch", s, s, rank=rank))
    # Faults, away from each other and from the benign events that change the level.
    fault_starts = _slots(rng, len(faults), 400, steps - 400, 350)
    extra: dict[tuple[int | None, int], float] = {}  # (rank or None for all, step) -> multiplier
    nan_at: dict[tuple[int, int], float] = {}
    divergent: list[tuple[int, int, float, int]] = []
    for kind, s in zip(faults, fault_starts, strict=False):
        if kind == "spike":
            length = rng.randrange(1, 4)
            factor = math.exp(rng.uniform(math.log(1.2), math.log(8.0)))
            for t in range(s, s + length):
                extra[(None, t)] = factor * rng.uniform(0.95, 1.05)
                grad_mult[t] *= min(6.0, 1 + (factor - 1) * rng.uniform(0.3, 1.0))
            labels.append(Label("spike", s, s + length - 1, detail={"factor": factor, "steps": length}))
        elif kind == "skipped_spike":
            factor = rng.uniform(2.0, 8.0)
            extra[(None, s)] = factor
            grad_mult[s] *= rng.uniform(20.0, 100.0)
            labels.append(Label("skipped_spike", s, s, detail={"factor": factor}))
        elif kind == "broad_spike":
            rise = rng.randrange(10, 41)
            peak = rng.uniform(1.3, 2.5)
            for i in range(2 * rise):
                height = (i / rise) if i < rise else (2 - i / rise)
                extra[(None, s + i)] = 1 + (peak - 1) * height
                grad_mult[s + i] *= 1 + (peak - 1) * height
            labels.append(Label("broad_spike", s, s + 2 * rise - 1, detail={"peak": peak, "rise": rise}))
        elif kind == "nan":
            rank = rng.randrange(RANKS)
            nan_at[(rank, s)] = rng.choice([math.nan, math.inf])
            labels.append(Label("nan", s, s, rank=rank))
        elif kind == "divergence":
            rate = rng.uniform(0.0003, 0.001)
            for t in range(s, steps + 1):
                mult[t] *= 1 + rate * (t - s)
                grad_mult[t] *= 1 + 2 * rate * (t - s)
            labels.append(Label("divergence", s, steps, detail={"rate": rate}))
        elif kind == "divergent_rank":
            rank = rng.randrange(RANKS)
            drift = rng.uniform(0.03, 0.10)
            ramp = rng.randrange(0, 101)
            divergent.append((rank, s, drift, ramp))
            labels.append(Label("divergent_rank", s, steps, rank=rank, detail={"drift": drift, "ramp": ramp}))
    grads = []
    g0 = rng.uniform(0.5, 3.0)
    for t in range(1, steps + 1):
        base = (a + b * (t + t0) ** -alpha) * mult[t]
        if t <= warmup:
            base *= 1 + 0.3 * (1 - t / warmup)
        job_extra = extra.get((None, t), 1.0)
        for r in range(RANKS):
            value = base * job_extra * (1 + noise[t] * _t4(rng)) * (1 + hard.get((r, t), 0.0))
            for rank, s, drift, ramp in divergent:
                if rank == r and t >= s:
                    value *= 1 + drift * (min(1.0, (t - s + 1) / ramp) if ramp else 1.0)
            if (r, t) in nan_at:
                value = nan_at[(r, t)]
            losses[r][t - 1] = value
        grads.append(g0 * (base / a) * grad_mult[t] * math.exp(rng.gauss(0.0, 0.15)))
    return LossTrace(f"loss-{seed}-{'+'.join(faults) or 'benign'}", steps, losses, grads, lrs, labels)


def timing_trace(seed: int, *, steps: int = 2000, straggler: str | None = None) -> TimingTrace:
    """``straggler``: None, or "<compute|comm>-<steady|intermittent>"."""
    rng = random.Random(seed)
    world = NODES * RANKS_PER_NODE
    node_of = [r // RANKS_PER_NODE for r in range(world)]
    compute0, comm0, input0 = rng.uniform(0.5, 0.8), rng.uniform(0.1, 0.3), rng.uniform(0.01, 0.05)
    offsets = [rng.uniform(-0.02, 0.02) for _ in range(world)]
    jitter = rng.uniform(0.02, 0.05)
    labels: list[Label] = []
    every = rng.choice([200, 250, 500])
    stalls = list(range(every, steps + 1, every))
    stall_s = rng.uniform(3.0, 20.0)
    for s in stalls:
        labels.append(Label("checkpoint_stall", s, s + 2))
    hiccups: dict[tuple[int, int], float] = {}
    for s in _slots(rng, rng.randrange(5, 20), 50, steps, 10):
        rank = rng.randrange(world)
        hiccups[(rank, s)] = rng.uniform(3.0, 10.0)
        labels.append(Label("hiccup", s, s, rank=rank, node=node_of[rank]))
    slow_rank, slow_from, slow_by, slow_phase, on = None, steps + 1, 0.0, "compute", None
    if straggler:
        phase_kind, pattern = straggler.split("-")
        slow_rank = rng.randrange(world)
        slow_from = rng.randrange(300, steps - 600)
        slow_by = math.exp(rng.uniform(math.log(0.05), math.log(0.5)))
        slow_phase = "compute" if phase_kind == "compute" else "optimizer"
        if pattern == "intermittent":
            on = []
            t = slow_from
            while t <= steps:
                length = rng.randrange(100, 301)
                on.append((t, t + length - 1))
                t += length + rng.randrange(100, 301)
        labels.append(Label("straggler", slow_from, steps, rank=slow_rank, node=node_of[slow_rank],
                            detail={"slow_by": slow_by, "phase": slow_phase, "pattern": pattern}))
    phases = [[{} for _ in range(steps)] for _ in range(world)]
    for t in range(1, steps + 1):
        net = math.exp(rng.gauss(0.0, 0.1))  # the network's jitter: the same for every rank this step
        stalled = any(s <= t <= s + 2 for s in stalls)
        slow_now = slow_rank is not None and t >= slow_from and (on is None or any(a <= t <= b for a, b in on))
        # Under DDP the others wait in the all-reduce for a rank slow in its compute (the hooks
        # count that wait as their communication).
        waiting = compute0 * slow_by if slow_now and slow_phase == "compute" else 0.0
        for r in range(world):
            c = compute0 * (1 + offsets[r]) * math.exp(rng.gauss(0.0, jitter))
            m = comm0 * net * math.exp(rng.gauss(0.0, jitter))
            i = input0 * math.exp(rng.gauss(0.0, 0.2))
            if r == slow_rank and slow_now:
                if slow_phase == "compute":
                    c *= 1 + slow_by
                else:
                    m *= 1 + slow_by * (compute0 + comm0) / comm0  # the same lost time as compute-slow
            elif waiting:
                m += waiting
            factor = hiccups.get((r, t))
            if factor:
                i += (c + m) * (factor - 1)  # a data hiccup: waiting for the batch
            ck = 0.0
            if stalled:
                ck = stall_s if t in stalls else 0.0
                c *= 1.3  # the whole job also runs slower while the save drains
            phases[r][t - 1] = {"input": i, "compute": c, "optimizer": m, "checkpoint": ck}
    return TimingTrace(f"timing-{seed}-{straggler or 'benign'}", steps, phases, node_of, labels)


def loss_suite(seed: int = 0, *, quick: bool = False) -> list[LossTrace]:
    """The loss traces: every fault kind many times, and fault-free traces full of look-alikes."""
    rng = random.Random(seed)
    count = 8 if quick else 24
    plans: list[tuple[str, ...]] = []
    for _ in range(count):
        plans.append(("spike", "spike", "skipped_spike", "spike"))
        plans.append(("broad_spike", "nan", "spike"))
        plans.append(("divergence",))
        plans.append(("divergent_rank",))
        plans.append(())  # benign only
    return [loss_trace(rng.randrange(2**31), faults=plan, steps=2000 if quick else 3000) for plan in plans]


def timing_suite(seed: int = 1, *, quick: bool = False) -> list[TimingTrace]:
    rng = random.Random(seed)
    count = 3 if quick else 9
    kinds = [None, "compute-steady", "compute-intermittent", "comm-steady", "comm-intermittent"]
    return [timing_trace(rng.randrange(2**31), straggler=kind, steps=1200 if quick else 2000)
            for _ in range(count) for kind in kinds]
