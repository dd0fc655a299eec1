"""Runs ``torchrun`` for one generation of a job on this node, reports how it ended, and stops it
completely.

- One generation per job at a time; the generation is the fencing token: a launch or stop for an
  older generation than the newest one seen here raises ``StaleGeneration``.
- torchrun runs in its own session and process group, with ``--max-restarts=0`` (Nightwatch
  decides restarts), the job's validated NCCL profile and the hooks' variables.
- Its output goes to a size-rotated log; a tail is kept in memory for the exit report, and
  torchrun's failure summary is parsed for per-rank exit codes and the first failed rank.
- ``stop`` sends SIGTERM to the process group, SIGKILL after the grace period, and confirms in
  /proc that every process of the generation is gone, including children that left the group.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import logging.handlers
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from agents.protocol.agent import MAX_LOG_LINE, MAX_LOG_TAIL_LINES, ExitReport, LaunchPayload, RankExit, \
    RunningGeneration
from agents.protocol.hooks import EXIT_PAUSED, EXIT_RESUME_REFUSED, EXIT_STALE_GENERATION
from agents.supervisor_nccl import NcclProfileError, validate_nccl_profile

log = logging.getLogger(__name__)

DEFAULT_TORCHRUN = (sys.executable, "-m", "torch.distributed.run")

__all__ = ["NcclProfileError", "StaleGeneration", "Supervisor", "classify_exit", "validate_nccl_profile"]
