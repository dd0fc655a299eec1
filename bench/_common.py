"""Helpers every benchmark shares (see ../shared/BENCHMARKS.md for the conventions).

A benchmark repeats each measurement (3 runs with ``--quick``, 5 otherwise), interleaving
Nightwatch and the alternative, and ends by calling ``emit``: the last line it prints is one JSON
object, also written to ``bench/results/NAME.json`` for the report generator.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def arguments(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="3 runs, under a minute on 2 cores")
    parser.add_argument("--runs", type=int, help="override the number of runs")
    args = parser.parse_args(argv)
    args.runs = args.runs or (3 if args.quick else 5)
    return args


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took (monotonic, high resolution)."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float]) -> list[float]:
    """[min, max] of the runs: how far apart repeated measurements landed."""
    return [min(values), max(values)]


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform()}
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * page_size / 2**30, 1)
    except (ValueError, OSError):
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
    return info


def command_line(bench: str) -> str:
    """How this benchmark was started, as a reader would retype it."""
    return " ".join([Path(sys.executable).name, "-m", f"bench.{bench}", *sys.argv[1:]])


def emit(bench: str, *, metric: str, value: float | None, target: float | None, better: str, unit: str,
         runs: int, spread: list[float] | None, details: dict[str, Any], skipped: str | None = None) -> dict[str, Any]:
    """Print the result as the last line of output and save it under bench/results/."""
    if better not in ("lower", "higher"):
        raise ValueError("better must be 'lower' or 'higher'")
    result: dict[str, Any] = {"bench": bench, "metric": metric, "value": value, "target": target,
                              "better": better, "unit": unit, "runs": runs, "spread": spread,
                              "details": details, "machine": machine(), "command": command_line(bench)}
    if skipped:
        result["skipped"] = skipped
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{bench}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)
    return result
