"""The lineage drawn as a list: a chain stays in its lane, a rollback's branch moves one lane right,
listed above the checkpoint it forked from; newest first, older rows folded."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


def _chain(job, generation, parent, steps):
    from checkpoints.models import Checkpoint

    made = []
    for step in steps:
        parent = Checkpoint.objects.create(job=job, generation=generation, step=step, state="verified",
                                           location=f"/ck/{step}-{len(made)}", parent=parent)
        made.append(parent)
    return made


@pytest.fixture
def branched(cast):
    return branched_lineage(cast.job)


def branched_lineage(job):
    """30 checkpoints on the main line (steps 10..300); a branch of 3 from step 100 and one of 2
    from step 200, each started by a rollback; the job now trains on the main line."""
    from jobs.models import Generation

    first, second, third = (Generation.objects.create(job=job, number=n, world_size=2) for n in (1, 2, 3))
    main = _chain(job, first, None, range(10, 301, 10))
    by_step = {c.step: c for c in main}
    branch_a = _chain(job, second, by_step[100], (110, 120, 130))
    branch_b = _chain(job, third, by_step[200], (210, 220))
    return job, main, branch_a, branch_b


def test_a_chain_is_a_list_and_only_a_branch_is_indented(branched):
    from dashboard import lineage

    job, main, branch_a, branch_b = branched
    drawn = lineage.rows(job)
    rows = drawn["visible"] + drawn["older"]
    assert len(drawn["visible"]) == lineage.VISIBLE_ROWS and len(rows) == 35 and drawn["depth"] == 1
    steps = [(row.node.checkpoint.step, row.depth) for row in rows]
    # Newest first on the main line; each branch just above the checkpoint it forked from.
    assert steps[:10] == [(s, 0) for s in range(300, 200, -10)]
    assert steps[10:13] == [(220, 1), (210, 1), (200, 0)]
    assert steps[22:26] == [(130, 1), (120, 1), (110, 1), (100, 0)]
    forks = {row.node.checkpoint.step: row.fork_of for row in rows if row.fork_of is not None}
    assert forks == {210: 200, 110: 100}
    assert all(row.node.on_active_branch for row in rows if row.depth == 0)


def test_the_page_draws_no_row_deeper_than_its_branch_and_folds_the_older_ones(signed_in, cast, branched):
    job, *_ = branched
    body = signed_in(cast.viewer).get(f"/jobs/{job.pk}/").content.decode()
    depths = {int(part.split('"')[0]) for part in body.split('data-depth="')[1:] if part[0].isdigit()}
    assert depths == {0, 1}
    assert "show 23 older" in body and body.count('class="ck d') == 35
    assert "↱ from step 200" in body and "↱ from step 100" in body
