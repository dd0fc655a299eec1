"""The chaos benchmark's fault schedule: what breaks, when and where, drawn from a seed.

Faults arrive as a Poisson process (exponential gaps with the given mean time between failures,
from a seeded ``random.Random``), so the same seed always gives the same schedule and both sides
of the comparison face the same faults at the same offsets from their start. Kinds are dealt
from a shuffled deck of every kind, so any run with at least as many faults as kinds sees each
kind once; later faults are dealt from a fresh deck. An Xid takes the primary node out of
service for good (the job moves to the one spare), so the deck deals it once per run.

The schedule is the benchmark's ground truth: it is printed and saved before anything starts.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

RANK_KILL = "rank_kill"
RANK_HANG = "rank_hang"
AGENT_DEATH = "agent_death"
XID = "xid"
NAN = "nan"
CORRUPT_CHECKPOINT = "corrupt_checkpoint"
CONTROL_PLANE_OUTAGE = "control_plane_outage"
KINDS = (RANK_KILL, RANK_HANG, AGENT_DEATH, XID, NAN, CORRUPT_CHECKPOINT, CONTROL_PLANE_OUTAGE)
ONCE_PER_RUN = frozenset({XID})
#: The Xid the scripted GPU raises: "GPU has fallen off the bus", a hardware fault.
XID_CODE = 79
PRIMARY_NODE = "node-a"


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the side's start
    kind: str
    rank: int | None = None  # the training rank a rank or checkpoint fault hits
    duration_s: float | None = None  # how long an outage lasts

    @property
    def target(self) -> str:
        """Where the fault lands, in words (the node running the job is only known at run time)."""
        if self.kind == CONTROL_PLANE_OUTAGE:
            return f"stop the control plane (daphne) for {self.duration_s:g} s"
        return {
            RANK_KILL: f"SIGKILL rank {self.rank}",
            RANK_HANG: f"SIGSTOP rank {self.rank}",
            AGENT_DEATH: "SIGKILL the agent of the node running the job (restarted like systemd would)",
            XID: f"scripted Xid {XID_CODE} on {PRIMARY_NODE} GPU 0",
            NAN: f"NaN loss on rank {self.rank} at its next step",
            CORRUPT_CHECKPOINT: f"flip bytes in a shard of the newest committed checkpoint, "
                                f"then SIGKILL rank {self.rank}",
        }[self.kind]

    def as_dict(self) -> dict:
        return {**asdict(self), "target": self.target}


def fault_schedule(seed: int, *, duration_s: float, mtbf_s: float, warmup_s: float = 20.0, tail_s: float = 15.0,
                   outage_s: float = 15.0, world_size: int = 2) -> list[Fault]:
    """Faults at ``warmup_s`` + exponential gaps (mean ``mtbf_s``), none in the last ``tail_s``
    (a fault there could not show its effect before the run ends)."""
    if duration_s <= warmup_s + tail_s:
        raise ValueError(f"a {duration_s:g} s run leaves no time for faults after the {warmup_s:g} s warm-up "
                         f"and before the last {tail_s:g} s")
    if mtbf_s <= 0:
        raise ValueError("the mean time between failures must be positive")
    rng = random.Random(seed)
    faults: list[Fault] = []
    deck: list[str] = []
    dealt_once: set[str] = set()
    at = warmup_s
    while True:
        at += rng.expovariate(1.0 / mtbf_s)
        if at > duration_s - tail_s:
            return faults
        if not deck:
            deck = [k for k in KINDS if k not in dealt_once]
            rng.shuffle(deck)
        kind = deck.pop()
        if kind in ONCE_PER_RUN:
            dealt_once.add(kind)
        rank = rng.randrange(world_size) if kind in (RANK_KILL, RANK_HANG, NAN, CORRUPT_CHECKPOINT) else None
        faults.append(Fault(round(at, 3), kind, rank, outage_s if kind == CONTROL_PLANE_OUTAGE else None))


def describe(faults: list[Fault]) -> str:
    return "\n".join(f"{f.at:8.1f} s  {f.kind:21} {f.target}" for f in faults)
