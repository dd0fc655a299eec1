"""Chaos runs are kept one file each, and a report takes the newest made under the same conditions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from bench import _chaos_runs

SETUP = {"seed": 1, "duration_s": 1800.0, "mtbf_s": 180.0, "sides": ["nightwatch", "torchrun"], "elapsed_s": 10}
T0 = datetime(2026, 11, 30, 1, 0, tzinfo=UTC)


def keep(directory, setup, ettr, minutes):
    run = _chaos_runs.record(setup, {"nightwatch": {"ettr": ettr}}, command="python -m bench.chaos",
                             revision="abc1234", elapsed_s=1850.4, now=T0 + timedelta(minutes=minutes))
    return _chaos_runs.save(run, directory)


def test_the_newest_runs_with_the_same_conditions_oldest_first(tmp_path):
    for minutes, ettr in [(0, 0.90), (40, 0.91), (80, 0.92), (120, 0.93)]:
        keep(tmp_path, SETUP, ettr, minutes)
    keep(tmp_path, {**SETUP, "seed": 2}, 0.5, 160)  # another schedule: never mixed in
    later_invocation = {**SETUP, "elapsed_s": 99}  # how long an invocation took is not a condition
    runs = _chaos_runs.newest(later_invocation, 3, directory=tmp_path)
    assert [r["results"]["nightwatch"]["ettr"] for r in runs] == [0.91, 0.92, 0.93]
    assert runs[0]["commit"] == "abc1234" and runs[0]["elapsed_s"] == 1850 and "elapsed_s" not in runs[0]["setup"]
    assert [r["results"]["nightwatch"]["ettr"] for r in _chaos_runs.newest({**SETUP, "seed": 2}, 3,
                                                                            directory=tmp_path)] == [0.5]


def test_runs_finishing_in_the_same_second_are_both_kept(tmp_path):
    first, second = keep(tmp_path, SETUP, 0.9, 0), keep(tmp_path, SETUP, 0.8, 0)
    assert first != second and len(_chaos_runs.newest(SETUP, 5, directory=tmp_path)) == 2


def test_a_file_that_is_not_a_run_is_named_and_left_out(tmp_path, capsys):
    keep(tmp_path, SETUP, 0.9, 0)
    (tmp_path / "20261130T000000Z-broken.json").write_text('{"setup": ')
    (tmp_path / "20261130T000001Z-other.json").write_text('{"setup": {}, "finished_at": "yesterday"}')
    (tmp_path / "20261130T000002Z-sideless.json").write_text(
        '{"setup": {}, "finished_at": "2026-11-30T00:00:02+00:00", "results": {"nightwatch": 0.9}}')
    assert [r["results"]["nightwatch"]["ettr"] for r in _chaos_runs.newest(SETUP, 3, directory=tmp_path)] == [0.9]
    err = capsys.readouterr().err
    assert "20261130T000000Z-broken.json left out" in err and "20261130T000001Z-other.json left out" in err
    assert "20261130T000002Z-sideless.json left out" in err


def test_no_kept_runs_and_no_directory_give_nothing(tmp_path):
    assert _chaos_runs.newest(SETUP, 3, directory=tmp_path / "missing") == []


def test_a_later_invocation_reports_its_runs_with_the_earlier_ones(tmp_path, monkeypatch):
    from bench import _common, chaos
    from tests.bench.test_chaos_report import result

    monkeypatch.setattr(_chaos_runs, "DIRECTORY", tmp_path / "runs")
    monkeypatch.setattr(_common, "RESULTS", tmp_path / "results")
    sides = result()["details"]["runs"]
    schedule = chaos.F.fault_schedule(1, duration_s=60, mtbf_s=20, warmup_s=20, tail_s=5)

    def invocation(runs, *extra):
        opts = chaos.options(["--quick", "--duration", "60", "--report-dir", str(tmp_path / "docs"), *extra])
        mine = chaos.Invocation(opts)
        for _ in range(runs):
            mine.keep({name: rows[0] for name, rows in sides.items()}, 61.0)
        chaos.finish(mine, schedule, opts, 130.0)
        return (tmp_path / "docs" / "chaos.md").read_text()

    assert "| ETTR (productive / wall) | 0.8 | 0.5 |" in invocation(1)  # make bench: one run
    page = invocation(2)  # a later --runs 2 adds two: the report covers three
    assert "### Runs" in page and "| 3 | " in page and "| 4 | " not in page
    assert "over the faults of run 3, the newest" in page
    assert "| 2 | " in invocation(2, "--fresh") and "| 3 | " not in invocation(1, "--fresh")
    assert "| 2 | " in invocation(1, "--spread", "2") and "| 3 | " not in invocation(1, "--spread", "2")
