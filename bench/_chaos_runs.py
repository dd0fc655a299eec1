"""Every finished chaos run, kept on disk, so the report can show the spread over runs that
separate invocations made: ``make bench`` runs one 30-minute run, a later ``python -m bench.chaos
--runs 2`` adds two more, and the report covers the newest three.

Only runs made with exactly the same settings (seed, so the same fault schedule; lengths, policies,
scaled timings) are reported together; each run keeps the commit and the command that made it, and
the report lists them, so a reader can see when a run predates a change.

One JSON file a run under ``bench/results/chaos-runs/`` (like every raw result, not committed):

    {"setup": {...}, "finished_at": "2026-11-30T01:02:03+00:00", "commit": "cb145ce",
     "command": "python -m bench.chaos --runs 2", "elapsed_s": 1890, "results": {"nightwatch": {...}, ...}}
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from bench._common import RESULTS

DIRECTORY = RESULTS / "chaos-runs"

#: Setup entries that describe an invocation rather than the conditions of a run.
PER_INVOCATION = frozenset({"elapsed_s"})


def conditions(setup: dict) -> dict:
    return {k: v for k, v in setup.items() if k not in PER_INVOCATION}


def commit(root: Path) -> str:
    """The checked-out commit, ``+changes`` when code (anything outside docs/) differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"],
                                 cwd=root, capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def record(setup: dict, results: dict[str, dict], *, command: str, revision: str, elapsed_s: float,
           now: datetime | None = None) -> dict:
    """One finished run: every side's result and what made it."""
    finished = (now or datetime.now(UTC)).replace(microsecond=0)
    return {"setup": conditions(setup), "finished_at": finished.isoformat(), "commit": revision,
            "command": command, "elapsed_s": round(elapsed_s), "results": results}


def save(run: dict, directory: Path | None = None) -> Path:
    """Keep one run record on disk; returns the file written (never overwrites another run)."""
    directory = directory or DIRECTORY
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.fromisoformat(run['finished_at']):%Y%m%dT%H%M%SZ}-{'-'.join(sorted(run['results']))}"
    path, suffix = directory / f"{stem}.json", 1
    while path.exists():  # two runs finishing within a second (tests)
        suffix += 1
        path = directory / f"{stem}-{suffix}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(run) + "\n")
    tmp.replace(path)  # a run cut short while writing leaves no half file behind
    return path


def newest(setup: dict, count: int, *, directory: Path | None = None) -> list[dict]:
    """The newest ``count`` kept runs made under the same conditions as ``setup``, oldest first.
    A file that cannot be read is named on stderr and left out (one bad file must not cost the
    report of a 30-minute run)."""
    wanted, directory = conditions(setup), directory or DIRECTORY
    runs = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            finished = _checked(record)
        except (OSError, ValueError, KeyError, TypeError) as error:
            print(f"chaos: {path} left out of the report: not a run record ({error!r})", file=sys.stderr)
            continue
        if record["setup"] == wanted:
            runs.append((finished, path.name, record))
    runs.sort(key=lambda item: item[:2])
    return [record for _, _, record in runs[-count:]] if count > 0 else []


def _checked(record: dict) -> datetime:
    """When the run finished; raises if ``record`` does not have the shape ``record()`` gives."""
    if not isinstance(record, dict) or not isinstance(record.get("setup"), dict):
        raise ValueError("no setup")
    results = record.get("results")
    if not isinstance(results, dict) or not all(isinstance(r, dict) and "ettr" in r for r in results.values()):
        raise ValueError("results are not one result with an ETTR per side")
    return datetime.fromisoformat(record["finished_at"])
