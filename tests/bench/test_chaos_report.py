"""The chaos report renders what the benchmark measured, and keeps the hand-written notes."""

from __future__ import annotations

from bench import _chaos_report, _faults

SETUP = {"seed": 1, "duration_s": 60.0, "mtbf_s": 20.0, "quick": True, "ckpt_every": 50, "plain_max_restarts": 3,
         "human_response_s": 20.0, "agent_restart_s": 5.0, "outage_s": 10.0, "warmup_s": 20.0,
         "progress_timeout_s": 10, "gpu_mtbf_hours": 1, "step_s": 0.1, "world_size": 2, "batch_size": 4,
         "elapsed_s": 150}


def side(name, ettr, faults):
    return {"system": name, "ettr": ettr, "first_step_s": 5.0, "ettr_after_first_step": ettr + 0.05,
            "steps_surviving": 300, "lost_steps": 12, "trained_twice": 0, "skipped": 0,
            "corrupt_checkpoints_loaded": 0, "newest_dir_was_corrupt_at_resume": 1, "human_interventions_count": 1,
            "timeline": [[5.0, 1], [20.0, 100], [26.0, 90], [60.0, 300]], "faults": faults,
            "by_kind": {"rank_kill": {"injected": 1, "scheduled": 1, "detected": 1, "recovered": 1,
                                      "detection_s": {"p50": 0.9, "max": 0.9, "n": 1},
                                      "recovery_s": {"p50": 5.2, "max": 5.2, "n": 1}},
                        "xid": {"injected": 0, "scheduled": 1, "detected": 0, "recovered": 0,
                                "detection_s": None, "recovery_s": None}},
            "human_interventions": [{"paused_at_s": 30.0, "approved_at_s": 50.0, "status": 200,
                                     "pause_reason": "NaN loss"}]}


def result(runs=1):
    schedule = _faults.fault_schedule(1, duration_s=60, mtbf_s=20, warmup_s=20, tail_s=5)
    faults = [{"kind": "rank_kill", "at_s": 21.0, "effective_at_s": 21.0, "applied": True, "detection_s": 0.9,
               "recovery_s": 5.2, "resumed_step": 50},
              {"kind": "xid", "at_s": 40.0, "applied": False, "note": "not applicable to torchrun"}]
    ettr = [(0.8 + n / 100, 0.5 + n / 100) for n in range(runs)]
    info = [{"finished_at": f"2026-11-30T0{n}:00:00+00:00", "commit": "abc1234", "command": "python -m bench.chaos",
             "elapsed_s": 70, "ettr": {"nightwatch": nw, "torchrun": plain}} for n, (nw, plain) in enumerate(ettr)]
    return {"bench": "chaos", "runs": runs, "command": "python -m bench.chaos --quick",
            "machine": {"nproc": 2, "memory_gib": 23.5, "python": "3.11", "torch": "2.13.0"},
            "details": {"setup": SETUP, "schedule": [f.as_dict() for f in schedule], "run_info": info,
                        "runs": {"nightwatch": [side("nightwatch", nw, faults[:1]) for nw, _ in ettr],
                                 "torchrun": [side("torchrun", plain, faults) for _, plain in ettr]}}}


def test_the_report_has_the_table_the_schedule_and_the_figure(tmp_path):
    _chaos_report.write(result(), tmp_path)
    page = (tmp_path / "chaos.md").read_text()
    assert "Quick run on a shared machine" in page
    assert "| ETTR (productive / wall) | 0.8 | 0.5 |" in page
    assert "| rank kill | 0.9 / 0.9 (1/1) | 5.2 / 5.2 (1/1) | 0.9 / 0.9 (1/1) | 5.2 / 5.2 (1/1) |" in page
    assert "| xid | not applicable | — | not applicable | — |" in page
    assert "![steps vs wall time, faults marked](chaos.png)" in page
    assert (tmp_path / "chaos.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_several_runs_show_their_spread_each_run_and_the_newest_in_detail(tmp_path):
    _chaos_report.write(result(runs=3), tmp_path)
    page = (tmp_path / "chaos.md").read_text()
    assert "| ETTR (productive / wall) | 0.81 [0.8–0.82] | 0.51 [0.5–0.52] |" in page
    assert "| 3 | 2026-11-30T02:00:00 | `abc1234` | `python -m bench.chaos` | 70 | 0.8200 | 0.5200 |" in page
    assert "### What happened: Nightwatch (run 3, the newest)" in page
    assert "over the faults of run 3, the newest" in page


def test_hand_written_notes_survive_a_regeneration(tmp_path):
    _chaos_report.write(result(), tmp_path)
    page = tmp_path / "chaos.md"
    page.write_text(page.read_text() + "\n" + _chaos_report.NOTES + "\n\nThe Xid run was odd.\n")
    _chaos_report.write(result(), tmp_path)
    assert page.read_text().count("The Xid run was odd.") == 1


def test_the_plotted_line_breaks_where_training_stood_still_or_went_back():
    timeline = [[5.0, 1], [5.5, 5], [6.0, 9], [20.0, 10], [20.5, 14], [21.0, 8], [21.5, 12]]
    assert _chaos_report.pieces(timeline) == [[[5.0, 1], [5.5, 5], [6.0, 9]], [[20.0, 10], [20.5, 14]],
                                              [[21.0, 8], [21.5, 12]]]
