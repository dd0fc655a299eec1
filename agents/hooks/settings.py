"""What the node agent tells the hooks, through environment variables. All optional.

With none set the hooks run standalone: no reporting, checkpoints in the directory the training
script passes, resume from the newest verified checkpoint found there.

| variable | meaning |
| --- | --- |
| NIGHTWATCH_URL | control plane base URL; unset = no reporting |
| NIGHTWATCH_TOKEN / NIGHTWATCH_TOKEN_FILE | bearer token for the control plane |
| NIGHTWATCH_JOB | job id used in report URLs and records |
| NIGHTWATCH_GENERATION | fencing token of this (re)start, an integer |
| NIGHTWATCH_CKPT_DIR | checkpoint directory; wins over the script's argument |
| NIGHTWATCH_RESUME_FROM | checkpoint the control plane chose to resume from |
| NIGHTWATCH_SPOOL_DIR | where undelivered reports wait during an outage |
| NIGHTWATCH_SNAPSHOT_EVERY | in-memory snapshot every N steps (0: off); wins over ``Hooks(snapshot_every=)`` |
| NIGHTWATCH_SNAPSHOT_DIR | where snapshots live in node memory (default ``/dev/shm/nightwatch``) |
| NIGHTWATCH_BRANCH_GENERATION | first generation of the job's lineage branch: no older snapshot is restored |
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Environment:
    url: str | None = None
    token: str | None = None
    job: str = "local"
    generation: int = 0
    ckpt_dir: str | None = None
    resume_from: str | None = None
    spool_dir: str | None = None
    #: Global sample ranges [start, end) a rollback chose to skip: ``NIGHTWATCH_SKIP_DATA=a-b,c-d``.
    skip_data: tuple[tuple[int, int], ...] = ()
    snapshot_every: int | None = None
    snapshot_dir: str | None = None
    branch_generation: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Environment:
        def get(name: str) -> str | None:
            return environ.get(name) or None

        token = get("NIGHTWATCH_TOKEN")
        token_file = get("NIGHTWATCH_TOKEN_FILE")
        if token is None and token_file:
            token = Path(token_file).read_text().strip()
        return cls(url=get("NIGHTWATCH_URL"), token=token, job=get("NIGHTWATCH_JOB") or "local",
                   generation=int(get("NIGHTWATCH_GENERATION") or 0), ckpt_dir=get("NIGHTWATCH_CKPT_DIR"),
                   resume_from=get("NIGHTWATCH_RESUME_FROM"), spool_dir=get("NIGHTWATCH_SPOOL_DIR"),
                   skip_data=parse_skip_data(get("NIGHTWATCH_SKIP_DATA") or ""),
                   snapshot_every=_optional_int(get("NIGHTWATCH_SNAPSHOT_EVERY")),
                   snapshot_dir=get("NIGHTWATCH_SNAPSHOT_DIR"),
                   branch_generation=_optional_int(get("NIGHTWATCH_BRANCH_GENERATION")))

    def spool_path(self, rank: int) -> Path:
        """One spool per rank: each rank reports on its own and must replay only its own records."""
        directory = Path(self.spool_dir) if self.spool_dir else Path(tempfile.gettempdir()) / "nightwatch-spool"
        safe_job = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.job)
        return directory / f"hooks-{safe_job}-rank{rank}.sqlite3"


def parse_skip_data(raw: str) -> tuple[tuple[int, int], ...]:
    """``"100-200,500-520"`` as ((100, 200), (500, 520)); a malformed value stops the run with why."""
    ranges = []
    for part in filter(None, (p.strip() for p in raw.split(","))):
        start, sep, end = part.partition("-")
        if not sep or not start.isdigit() or not end.isdigit() or int(start) >= int(end):
            raise ValueError(f"NIGHTWATCH_SKIP_DATA: {part!r} is not a range start-end with start < end")
        ranges.append((int(start), int(end)))
    return tuple(ranges)


def _optional_int(raw: str | None) -> int | None:
    return None if raw is None else int(raw)
