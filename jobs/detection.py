"""What the control plane makes of the hooks' flags in one report batch. Pure: no Django, no I/O.

The hooks judge every step once, as it happens (``agents.hooks.guards.LossWatch``), and say in each
``spike``/``divergence`` event whether it is a marker or a pause. The control plane acts on that
verdict and does not re-judge, so the outcome cannot depend on how the reports were batched (a 1 s
flush holds one step of a 1 s job and ten of a 0.1 s one). Events from older hooks carry no
``action``: for them a run of ``loss_spike_limit`` consecutive spikes (their own count) pauses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agents.protocol.hooks import Event, StepReport
from jobs import policy


@dataclass(frozen=True)
class Flags:
    nan: bool = False
    inconsistent: bool = False
    #: The spike event that pauses the job (its step and detail), if any.
    spike: dict[str, Any] | None = None
    #: The divergence event (step, since_step, rise), if any.
    divergence: dict[str, Any] | None = None

    @property
    def any(self) -> bool:
        return self.nan or self.inconsistent or self.spike is not None or self.divergence is not None


def judge_batch(reports: Iterable[StepReport], events: Iterable[Event], *, spike_limit: int) -> Flags:
    """The flags of the new reports and events of one batch (replays already left out)."""
    reports, events = list(reports), list(events)
    nan = any(r.nan or not math.isfinite(r.loss) for r in reports) or any(e.kind == "nan" for e in events)
    inconsistent = any(r.inconsistent for r in reports) or any(e.kind == "inconsistency" for e in events)
    spike = None
    for e in events:
        if e.kind == "spike" and spike_pauses(e.detail, spike_limit):
            spike = {"step": e.step, "rank": e.rank, **e.detail}
            break
    # Another rank's divergence is a marker (rank 0 speaks for the job); hooks that send no action pause.
    divergence = next(({"step": e.step, "rank": e.rank, **e.detail} for e in events
                       if e.kind == "divergence" and e.detail.get("action", "pause") == "pause"), None)
    return Flags(nan=nan, inconsistent=inconsistent, spike=spike, divergence=divergence)


def spike_pauses(detail: dict[str, Any], spike_limit: int) -> bool:
    """Whether one ``spike`` event pauses the job: the hooks' verdict, or (hooks that send none) the
    run length it carries against the job's limit. A longer run than the job's limit always pauses."""
    count = detail.get("consecutive")
    run = count if isinstance(count, int) and count > 0 else 1
    return detail.get("action") == "pause" or policy.spike_run_pauses(run, spike_limit)
