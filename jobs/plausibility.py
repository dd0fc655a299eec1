"""Whether the hooks' step reports are plausible for the job: a pure function, no Django.

A report of the current generation is still arbitrary code's word (DESIGN.md, "Trust
boundaries"): a bug or a forged record with step 100,154 in a job that ends at 400 would move
``last_step`` for good. ``judge`` refuses, with the reason, a report

1. **far ahead**: more than ``allowance`` steps past the job's last step, where the allowance is
   ``max(policy.max_step_jump, 10 × the reports in the batch)`` (1,000 by default: a batch
   replayed after an outage covers at most ``BATCH_LIMIT`` steps, and the hooks send spooled
   batches oldest first, so an honest batch never starts far past what was stored);
2. **past the end**: beyond the job's configured ``max_steps`` (the policy's, when set);
3. **backwards**: a data cursor below the one already reported for an earlier step of the same
   generation, or below an earlier step's in the same batch (the global sample cursor only moves
   forward within a generation; a rollback starts a new generation);
4. **wrong world size**: a world size other than the generation's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

#: The reason codes, also the ``kind`` label of ``nightwatch_job_reports_refused_total``.
FAR_AHEAD = "step_far_ahead"
PAST_END = "step_past_max_steps"
BACKWARDS = "data_cursor_backwards"
WORLD_SIZE = "world_size_mismatch"
REASONS = (FAR_AHEAD, PAST_END, BACKWARDS, WORLD_SIZE)
#: Each report of a batch widens the allowance by this many steps.
STEPS_PER_REPORT = 10


class _Report(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def data_cursor(self) -> int: ...
    @property
    def world_size(self) -> int: ...


@dataclass(frozen=True)
class Refusal:
    index: int  # the report's position in the batch
    rank: int
    step: int
    reason: str  # one of REASONS
    detail: str


@dataclass(frozen=True)
class Known:
    """What the control plane already holds for the job and generation."""

    last_step: int | None  # the job's newest step (any generation)
    #: (step, data cursor) of the generation's newest stored report below the batch's first step.
    earlier: tuple[int, int] | None
    world_size: int | None  # the generation's; None when unknown (no generation row)
    max_steps: int | None  # the job's configured end; None: none configured
    max_step_jump: int


def allowance(known: Known, batch_reports: int) -> int:
    return max(known.max_step_jump, STEPS_PER_REPORT * batch_reports)


def judge(reports: Sequence[_Report], known: Known) -> list[Refusal]:
    """The refused reports of a batch, with why; empty when every report is plausible."""
    refused: list[Refusal] = []
    limit = (known.last_step or 0) + allowance(known, len(reports))
    cursor_floor = known.earlier
    for index, r in sorted(enumerate(reports), key=lambda pair: pair[1].step):
        reason = detail = None
        if known.max_steps is not None and r.step > known.max_steps:
            reason, detail = PAST_END, f"step {r.step} is past the job's max_steps {known.max_steps}"
        elif r.step > limit:
            reason, detail = FAR_AHEAD, (f"step {r.step} is more than {limit - (known.last_step or 0)} steps past "
                                         f"the job's last step {known.last_step or 0}")
        elif known.world_size is not None and r.world_size != known.world_size:
            reason, detail = WORLD_SIZE, (f"world size {r.world_size} is not the generation's "
                                          f"{known.world_size}")
        elif cursor_floor is not None and r.step > cursor_floor[0] and r.data_cursor < cursor_floor[1]:
            reason, detail = BACKWARDS, (f"data cursor {r.data_cursor} at step {r.step} is below {cursor_floor[1]}, "
                                         f"reported at step {cursor_floor[0]} of the same generation")
        if reason is not None:
            refused.append(Refusal(index, r.rank, r.step, reason, detail or ""))
        elif cursor_floor is None or r.step > cursor_floor[0]:
            cursor_floor = (r.step, r.data_cursor)
    return sorted(refused, key=lambda refusal: refusal.index)
