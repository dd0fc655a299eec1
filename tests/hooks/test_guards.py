"""In-loop guards on real torchrun, reporting to a real HTTP control plane: an exploding gradient is
skipped, a NaN is reported, a rank whose loss is off is flagged, and every report arrives once."""

from __future__ import annotations

import math

import pytest

from tests.hooks.conftest import torchrun

pytestmark = pytest.mark.e2e

STEPS = 30


def test_guards_skip_flag_and_report_on_every_rank(tmp_path, control_plane):
    control_plane.generation = 3
    env = {"NIGHTWATCH_URL": control_plane.url, "NIGHTWATCH_TOKEN": "agent-token", "NIGHTWATCH_JOB": "job-7",
           "NIGHTWATCH_GENERATION": "3", "NIGHTWATCH_SPOOL_DIR": str(tmp_path / "spool")}
    run = torchrun(["--steps", str(STEPS), "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "10",
                    "--guard-min-history", "5", "--check-every", "5",
                    "--inject-grad-explosion-at", "15", "--inject-nan-at", "22", "--fault-rank", "0",
                    "--perturb-loss-rank", "1", "--perturb-factor", "3"], env=env)
    assert run.returncode == 0, run.output[-3000:]
    reports = control_plane.reports

    # Every step of rank 0 arrived, once, from generation 3, and nothing was refused. Rank 1 sent
    # only the steps it flagged: from the first consistency check that flagged it (step 15) on, all.
    assert sorted(reports) == [(3, 0, s) for s in range(1, STEPS + 1)] + [(3, 1, s) for s in range(15, STEPS + 1)]
    assert sum(len(batch["reports"]) for batch in control_plane.received) == len(reports)
    # Both ranks' timings arrived through rank 0, one window per exchange.
    assert sorted((w["first_step"], w["last_step"], w["ranks"]) for w in control_plane.windows.values()) == [
        (max(1, s - 5), s - 1, 2) for s in range(5, STEPS + 1, 5)]
    assert control_plane.bad_requests == [] and set(control_plane.tokens) == {"Bearer agent-token"}

    # The exploded step was skipped on both ranks (same all-reduced gradient, same decision) ...
    assert [step for (_, rank, step), r in sorted(reports.items()) if r["skipped"] and rank == 0] == [15, 22]
    assert reports[(3, 1, 15)]["skipped"] and reports[(3, 1, 22)]["skipped"]
    (skip,) = [e for e in control_plane.events_of("guard_skip") if e["step"] == 15]
    assert skip["rank"] == 0 and skip["detail"]["grad_norm"] > 10 * skip["detail"]["median"]
    assert run.lines("skipped step 15: gradient norm")

    # ... the NaN was reported by the rank whose loss it was, and its step skipped as well.
    assert reports[(3, 0, 22)]["nan"] and reports[(3, 0, 22)]["loss"] == "nan"
    (nan,) = control_plane.events_of("nan")
    assert (nan["rank"], nan["step"]) == (0, 22)
    assert not any(r["nan"] for (_, _, step), r in reports.items() if step != 22)

    # Rank 1's loss is three times its peers': on the same side at every exchange, so from the third
    # (the spread's hold: noise does not stay on one side) every consistency check flags it.
    flagged = control_plane.events_of("inconsistency")
    assert sorted(e["step"] for e in flagged) == [15, 20, 25, 30]
    assert all(e["detail"]["suspect_rank"] == 1 and e["detail"]["held"] >= 3 for e in flagged)
    for e in flagged:
        losses = e["detail"]["losses"]
        if all(isinstance(x, float) and math.isfinite(x) for x in losses):
            assert losses[1] / losses[0] == pytest.approx(3.0, rel=0.3)
    assert not reports[(3, 0, 10)]["inconsistent"]
    assert reports[(3, 0, 15)]["inconsistent"] and reports[(3, 1, 15)]["inconsistent"]
    assert run.lines("ranks disagree at step 15")

    # Checkpoint commits reached the control plane too, with their manifests.
    assert [c["step"] for c in control_plane.commits] == [10, 20, 30]
    assert all(c["generation"] == 3 and c["job"] == "job-7" and c["manifest"]["files"] for c in control_plane.commits)
