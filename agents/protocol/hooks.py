"""Messages between the training hooks (inside ``train.py``) and the control plane.

Endpoints (``{job}`` is NIGHTWATCH_JOB, ``G`` the generation, ``R`` the rank):

- ``POST /api/v1/jobs/{job}/reports`` with a ``ReportBatch``; answers 202 with ``ReportsAccepted``,
  or 409 when the batch's generation is stale.
- ``POST /api/v1/jobs/{job}/checkpoints`` with a ``CheckpointCommit``; answers 201, or 200 when
  that checkpoint was already recorded (a replay after an outage).
- ``GET /api/v1/jobs/{job}/control?generation=G&rank=R`` answers a ``Control``.

Every record carries its job and generation (the fencing token) so a record stands on its own in
the hooks' spool and on the server; the server deduplicates step reports on
(job, generation, rank, step), node windows on (job, generation, node, last_step, time) and
events on (job, generation, key).

What a job sends grows with its steps and nodes, not with its ranks (docs/architecture.md, "Step
data"): rank 0 reports every step for the job; the other ranks report only the steps they flagged
(NaN, spike, skipped, inconsistent); every rank's timings reach rank 0 in the cross-rank exchange,
and rank 0 reports them summarised per node (``NodeWindow``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.protocol.base import MAX_TIME, ProtocolError, field

REPORTS_PATH = "/api/v1/jobs/{job}/reports"
CHECKPOINTS_PATH = "/api/v1/jobs/{job}/checkpoints"
CONTROL_PATH = "/api/v1/jobs/{job}/control"
#: Says whether a report request can move the job's progress: ``1`` from rank 0, whose step reports
#: the hang sweep reads, ``0`` from every other rank, whose reports the control plane keeps only when
#: flagged. Admission control (``core.admission``) lets rank 0's through ahead of bulk data, and does
#: not count a refused ``0`` as the job trying to report progress. Absent (older hooks): bulk, and
#: a refusal spares the job as before.
PROGRESS_HEADER = "X-Nightwatch-Progress"


def progress_header(rank: int) -> dict[str, str]:
    """The report requests' ``PROGRESS_HEADER`` for ``rank`` (the reporter's, and the fleet bench's)."""
    return {PROGRESS_HEADER: "1" if rank == 0 else "0"}

#: Exit codes of a training process stopped by the hooks. The node agent reads them to tell a
#: requested stop from a crash, so it does not restart what was meant to stay stopped.
EXIT_PAUSED = 85  # "pause" was requested: a checkpoint was committed, then the process exited.
EXIT_STALE_GENERATION = 86  # the control plane fenced this generation off: nothing more was written.
EXIT_RESUME_REFUSED = 87  # the checkpoint named by NIGHTWATCH_RESUME_FROM failed verification.

#: Per-step timing phases, in seconds. ``compute`` is this rank's own forward and backward: under
#: DDP until its last gradient bucket is ready. ``optimizer`` is communication and the update: the
#: rest of DDP's gradient all-reduce (waiting for the slowest rank included), the hooks' collectives
#: (consistency all-gather) and the optimizer and scheduler step.
PHASES = ("input", "compute", "optimizer", "checkpoint")

EVENT_KINDS = (
    "resumed",              # detail: step, checkpoint, world_size, previous_world_size
    "checkpoint_rejected",  # detail: path, reason (why resume skipped it)
    "world_size_change",    # detail: previous, current, data_cursor
    "guard_skip",           # detail: grad_norm, median, reason
    "nan",                  # detail: loss, grad_norm
    "spike",                # detail: loss, action (marker|pause), score, baseline, threshold, consecutive, reason
    "level_shift",          # detail: loss, action (marker), rise, baseline, reason (re-baselined, not paused)
    "divergence",           # detail: loss, action (pause), since_step, rise, reason
    "inconsistency",        # detail: losses, grad_norms, loss_spread, grad_norm_spread, suspect_rank
    "checkpoint_saved",     # detail: path, blocking_s, total_s
    "snapshot_committed",   # detail: step, generation, size_bytes (both in-memory copies; throttled)
    "checkpoint_failed",    # detail: path, reason (the cause in words), errno, error, peer_lost (a rank went away)
    "pause_ack",            # detail: checkpoint
    "data_skipped",         # detail: from, to (global sample cursor; a rollback's skip range)
    "model",                # detail: parameters, flops_per_token (when overridden), tokens_per_sample
    "run_ending",           # detail: step, max_steps (the loop is done: the final save and flush follow)
)

_JOB_MAX_LEN = 128


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """What one rank did in one optimizer step: every step from rank 0, flagged steps from the others."""

    job: str = field(max_len=_JOB_MAX_LEN)
    generation: int = field(min=0)
    rank: int = field(min=0, max=1_000_000)
    step: int = field(min=1)  # steps completed, counting this one
    loss: float = field(nonfinite=True)  # this rank's loss; NaN/Inf allowed (sent as "nan"/"inf")
    #: Global gradient norm before clipping (NaN/Inf allowed); None if not computed.
    grad_norm: float | None = field(nonfinite=True)
    world_size: int = field(min=1)
    data_cursor: int = field(min=0)  # global samples consumed by all ranks after this step
    samples: int = field(min=0)  # samples this rank trained on in this step
    tokens: int = field(min=0, default=0)
    phases: dict[str, float] = field(default_factory=dict, choices=PHASES)
    skipped: bool = field(default=False)  # the optimizer step was not applied (guard or AMP overflow)
    spike: bool = field(default=False)
    nan: bool = field(default=False)
    inconsistent: bool = field(default=False)  # the last consistency check flagged the ranks
    time: float = field(min=0, max=MAX_TIME)  # unix time at the end of the step


@dataclass(frozen=True, kw_only=True)
class NodeWindow:
    """The step times of one node's ranks over the steps between two cross-rank exchanges.

    Rank 0 builds it from what every rank contributed to the exchange (each rank's mean and
    longest step and its mean phases over the window), so straggler and skew views still see the
    slowest rank of every node while the control plane stores one row per node and window.
    ``node`` is torchrun's node rank (``GROUP_RANK``); times are seconds per step.
    """

    job: str = field(max_len=_JOB_MAX_LEN)
    generation: int = field(min=0)
    node: int = field(min=0, max=1_000_000)
    first_step: int = field(min=1)
    last_step: int = field(min=1)
    ranks: int = field(min=1, max=1_000_000)  # ranks of the node that trained in the window
    step_median_s: float = field(min=0)  # median over the node's ranks of each rank's mean step
    step_max_s: float = field(min=0)  # the longest single step of any of the node's ranks
    #: The rank that holds the others up: the highest mean step plus own work (input + compute).
    slowest_rank: int = field(min=0, max=1_000_000)
    slowest_s: float = field(min=0)  # that rank's mean step time
    slowest_phases: dict[str, float] = field(default_factory=dict, choices=PHASES)  # its mean phases
    phases: dict[str, float] = field(default_factory=dict, choices=PHASES)  # the node's mean phases
    time: float = field(min=0, max=MAX_TIME)  # unix time of the exchange

    def __post_init__(self) -> None:
        if self.last_step < self.first_step:
            raise ProtocolError("last_step", f"{self.last_step} is before first_step {self.first_step}")
        if self.slowest_s > self.step_max_s + 1e-9:
            raise ProtocolError("slowest_s", "a mean step longer than the longest step")


@dataclass(frozen=True, kw_only=True)
class Event:
    """Something worth a line in the job's timeline; ``key`` makes a replay idempotent."""

    job: str = field(max_len=_JOB_MAX_LEN)
    generation: int = field(min=0)
    rank: int = field(min=0, max=1_000_000)
    step: int = field(min=0)
    kind: str = field(choices=EVENT_KINDS)
    key: str = field(max_len=200)
    message: str = field(max_len=2000)
    detail: dict[str, Any] = field(default_factory=dict, max_len=32)
    time: float = field(min=0, max=MAX_TIME)


@dataclass(frozen=True, kw_only=True)
class ReportBatch:
    """Step reports, node windows and events of one rank, oldest first; all of the batch's job and
    generation."""

    job: str = field(max_len=_JOB_MAX_LEN)
    generation: int = field(min=0)
    reports: list[StepReport] = field(default_factory=list, max_len=1000)
    events: list[Event] = field(default_factory=list, max_len=1000)
    windows: list[NodeWindow] = field(default_factory=list, max_len=1000)
    #: Set only when nothing of the rank waits behind this batch, so that its newest step report is
    #: the newest step the rank has made: that step's age in seconds as the batch was sent, by the
    #: rank's own clock (no skew with ours). The control plane dates the progress deadline from it
    #: rather than from the arrival (``jobs.progress.progress_anchor``): a hang whose last steps
    #: arrive late, behind a spool that overload held back, is found as they arrive, not a whole
    #: timeout later. None: more of the rank's records wait, or a reporter that does not say.
    newest_step_age_s: float | None = field(default=None, min=0, max=MAX_TIME)

    def __post_init__(self) -> None:
        for name in ("reports", "events", "windows"):
            for i, record in enumerate(getattr(self, name)):
                if (record.job, record.generation) != (self.job, self.generation):
                    raise ProtocolError(f"{name}.{i}", "job or generation differs from the batch's")


@dataclass(frozen=True, kw_only=True)
class CheckpointCommit:
    """Rank 0 committed a checkpoint (manifest and commit marker are on disk)."""

    job: str = field(max_len=_JOB_MAX_LEN)
    generation: int = field(min=0)
    step: int = field(min=0)
    path: str = field(max_len=4096)
    loss: float = field(nonfinite=True)  # NaN when the training loop reported none
    config_hash: str = field(max_len=64)
    data_cursor: int = field(min=0)
    world_size: int = field(min=1)
    size_bytes: int = field(min=0)
    blocking_s: float = field(min=0)  # how long training was stalled by the save
    total_s: float = field(min=0)  # from the start of the save to the commit marker
    manifest: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Control:
    """What the control plane wants from a running generation.

    ``checkpoint_now`` is acted on when it turns true (the server may keep it set until it sees
    the commit); ``pause`` means checkpoint then exit with EXIT_PAUSED; ``stale`` means exit with
    EXIT_STALE_GENERATION at once, writing nothing.
    """

    generation: int = field(min=0)
    stale: bool = field(default=False)
    checkpoint_now: bool = field(default=False)
    pause: bool = field(default=False)
    checkpoint_interval_steps: int | None = field(default=None, min=1)


@dataclass(frozen=True, kw_only=True)
class ReportsAccepted:
    """The 202 answer to a ReportBatch: how many step reports were new, how many already known, how
    many not stored (another rank's step it did not flag: rank 0 speaks for the job), and control."""

    accepted: int = field(min=0)
    duplicates: int = field(default=0, min=0)
    ignored: int = field(default=0, min=0)
    control: Control | None = field(default=None)
