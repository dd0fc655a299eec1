"""The benchmark index keeps the last figures of benchmarks that were not rerun, marked as such."""

from __future__ import annotations

from bench.report import carried_rows, render

PREVIOUS = """# Benchmark report

| benchmark | metric | value | target | meets | spread (min–max) | runs | command |
| --- | --- | --- | --- | --- | --- | --- | --- |
| ingest | samples_per_s (higher) | 14110 samples/s | 10000 | yes | 12903–14678 | 3 | `python -m bench.ingest --quick` |
| chaos | ettr_nightwatch (higher) | 0.27 ratio | 0.9 | **no** | 0.27–0.27 | 1 | `python -m bench.chaos --quick` |
"""

FRESH = {"bench": "chaos", "metric": "ettr_nightwatch", "better": "higher", "value": 0.93, "target": 0.9,
         "unit": "ratio", "spread": [0.92, 0.94], "runs": 3, "command": "python -m bench.chaos",
         "machine": {"nproc": 2}}


def test_rows_not_rerun_are_carried_over_and_marked():
    rows = carried_rows(PREVIOUS, {"chaos"})
    assert len(rows) == 1 and rows[0].startswith("| ingest |")
    assert rows[0].endswith("`python -m bench.ingest --quick` (not rerun) |")
    # Carried twice, marked once.
    assert carried_rows("\n".join(["| benchmark | a | b | c | d | e | f | g |", *rows]), set()) == rows


def test_the_fresh_result_replaces_its_old_row():
    text = render([FRESH], carried_rows(PREVIOUS, {"chaos"}))
    assert "| chaos | ettr_nightwatch (higher is better) | 0.93 ratio | 0.9 | yes | 0.92–0.94 | 3 |" in text
    assert "0.27 ratio" not in text
    assert "(not rerun)" in text and "carried over from the previous report" in text
