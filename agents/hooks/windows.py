"""Step timings per node and window: how every rank's timings reach the control plane in a few rows.

Each rank sums its own step timings between two cross-rank exchanges (``RankTimings``) and adds
them to the exchange's all-gather, which runs anyway every ``check_every`` steps. Rank 0 then holds
every rank's figures and reports one ``NodeWindow`` per node (``node_windows``): the node's median
and longest step, and its slowest rank with that rank's phases. The control plane stores a row per
node and window instead of a row per rank and step (4,096 ranks on 512 nodes with a 10-step window:
51 rows a second instead of 4,096), and a straggler is still seen: it is the slowest rank of its
node, with the phase that makes it slow.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from agents.protocol.hooks import PHASES, NodeWindow

#: What each rank adds to the exchange, in this order (floats: the all-gather carries float64).
FIELDS = ("node", "steps", "first_step", "last_step", "mean_s", "max_s", *(f"{p}_s" for p in PHASES))


@dataclass
class RankTimings:
    """One rank's steps since the last exchange."""

    steps: int = 0
    first_step: int = 0
    last_step: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, step: int, phases: dict[str, float]) -> None:
        seconds = sum(phases.values())
        if not self.steps:
            self.first_step = step
        self.steps += 1
        self.last_step = step
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)
        for name, value in phases.items():
            self.phase_s[name] += value

    def row(self, node: int) -> list[float]:
        """This window's figures for the exchange, laid out as ``FIELDS``."""
        n = self.steps or 1
        return [float(node), float(self.steps), float(self.first_step), float(self.last_step), self.total_s / n,
                self.max_s, *(self.phase_s[p] / n for p in PHASES)]


def node_windows(rows: list[list[float]], *, job: str, generation: int, time: float) -> list[NodeWindow]:
    """One window per node from every rank's exchange figures (``rows[rank]``, laid out as
    ``FIELDS``); ranks that trained no step since the last exchange are left out."""
    by_node: dict[int, list[tuple[int, dict[str, float]]]] = {}
    for rank, row in enumerate(rows):
        figures = dict(zip(FIELDS, row, strict=True))
        if figures["steps"] >= 1:
            by_node.setdefault(int(figures["node"]), []).append((rank, figures))
    windows = []
    for node, ranks in sorted(by_node.items()):
        # The rank that holds the others up. In a synchronous job every rank's whole step is about
        # as long (its peers' share of it is waiting), so its own work (input + compute) counts
        # twice: the slowest whole step still wins where the ranks do not wait for each other.
        slowest_rank, slowest = max(ranks, key=lambda item: item[1]["mean_s"] + item[1]["input_s"]
                                    + item[1]["compute_s"])
        windows.append(NodeWindow(
            job=job, generation=generation, node=node,
            first_step=int(min(f["first_step"] for _, f in ranks)),
            last_step=int(max(f["last_step"] for _, f in ranks)),
            ranks=len(ranks), step_median_s=statistics.median(f["mean_s"] for _, f in ranks),
            step_max_s=max(f["max_s"] for _, f in ranks), slowest_rank=slowest_rank, slowest_s=slowest["mean_s"],
            slowest_phases={p: slowest[f"{p}_s"] for p in PHASES},
            phases={p: statistics.fmean(f[f"{p}_s"] for _, f in ranks) for p in PHASES},
            time=time))
    return windows
