"""A job's recovery policy, typed: what ``Job.recovery_policy`` holds.

The defaults are written here and nowhere else: ``jobs.api.serializers`` takes its defaults from
this class, and every reader goes through ``RecoveryPolicy.of(job)``. (The job's other policy,
``CheckpointPolicy``, belongs to the checkpoints app that reads it: ``checkpoints.policies``.)

The API stores a policy with its defaults filled in, but a row may still lack a field (a launch
that sent no policy stores ``{}``; a row written before the field existed, or by the demo command),
so ``of`` fills in the default for a missing or null field and ignores a field it no longer knows.
Pure Python: no Django, so the pure modules may use it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol


class _HasRecoveryPolicy(Protocol):
    recovery_policy: Mapping[str, Any] | None


@dataclass(frozen=True)
class RecoveryPolicy:
    #: Automatic restarts allowed per window (then the circuit breaker opens).
    max_restarts: int = 5
    window_minutes: int = 60
    backoff_seconds: int = 5
    #: Restart on fewer nodes when no spare is free.
    allow_shrink: bool = False
    #: No step within this long = hang; None: derived from recent step times.
    progress_timeout_s: int | None = None
    #: First step of a new generation within this long; None: derived from the job's earlier starts.
    startup_timeout_s: int | None = None
    #: A run of this many consecutive loss-spike steps always pauses. Current hooks say in each spike
    #: event whether it pauses (``agents.detectors.DetectionPolicy``, docs/detection.md), so this decides
    #: only for hooks that send no verdict, or a longer run.
    loss_spike_limit: int = 3
    #: After an approved retry storm the budget is halved (then quartered, …) until the job has run
    #: this long without an automatic restart; then the whole budget is back.
    clean_run_minutes: int = 60
    #: The job's configured end: a step report past it is refused (``jobs.plausibility``). None: no end.
    max_steps: int | None = None
    #: A step report more than max(this, 10 × the reports in its batch) past the job's last step is refused.
    max_step_jump: int = 1000
    #: A rank that crashes on a healthy node is replaced in its generation, the other ranks keeping
    #: their interpreters (``agents.hooks.inprocess``), up to this many times per rank and
    #: generation; 0: off (every crash restarts the whole generation). Needs agents with warm workers
    #: and a script that opts in; a job with snapshots loses at most ``snapshot_every`` steps.
    inprocess_restarts: int = 0

    @classmethod
    def of(cls, job: _HasRecoveryPolicy) -> RecoveryPolicy:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (job.recovery_policy or {}).items() if k in known and v is not None})
