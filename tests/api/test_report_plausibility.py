"""Step reports validated against the job (issue 24, item 6): far ahead, past the end, a data cursor
going backwards, another world size are refused with 422 (nothing of the batch stored), recorded in
a ``job.reports_refused`` event and counted on ``/metrics``; the plausible records, sent again on
their own as the hooks' reporter does after a refusal, are stored."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from core.events import EventKind
from core.models import Event
from jobs import plausibility
from jobs.models import Job, StepMetric
from tests.api.test_hooks_api import batch, post_reports, report, running  # noqa: F401 - fixture
from tests.api.test_metrics import samples


def known(**overrides):
    values = {"last_step": 400, "earlier": (400, 3200), "world_size": 2, "max_steps": None, "max_step_jump": 1000}
    return plausibility.Known(**{**values, **overrides})


def r(step, cursor=None, world_size=2, rank=0):
    return SimpleNamespace(rank=rank, step=step, data_cursor=step * 8 if cursor is None else cursor,
                           world_size=world_size)


def test_far_means_past_the_floor_or_ten_steps_per_report_of_the_batch():
    assert plausibility.judge([r(1400)], known()) == []
    (refusal,) = plausibility.judge([r(1401)], known())
    assert refusal.reason == plausibility.FAR_AHEAD and "more than 1000 steps past" in refusal.detail
    # A replayed batch of 500 reports may reach 5,000 past the last step (it covers them all).
    replay = [r(401 + i) for i in range(499)] + [r(5400)]
    assert plausibility.judge(replay, known()) == []
    assert [x.reason for x in plausibility.judge([r(5)], known(last_step=None, max_step_jump=4))] == []
    assert plausibility.judge([r(1_000_000)], known(max_step_jump=10**6)) == []


def test_past_the_end_backwards_and_another_world_size_are_refused_with_their_reason():
    refusals = plausibility.judge([r(401), r(402, cursor=100), r(403, world_size=4), r(500)], known(max_steps=450))
    assert [(x.index, x.reason) for x in refusals] == [
        (1, plausibility.BACKWARDS), (2, plausibility.WORLD_SIZE), (3, plausibility.PAST_END)]
    # Backwards within the batch too, measured from the last plausible report.
    assert [x.step for x in plausibility.judge([r(401, 4000), r(402, 3999)], known())] == [402]
    # The same step from two ranks (a flagged report) carries the same cursor: not backwards.
    assert plausibility.judge([r(401), r(401, rank=1)], known()) == []


@pytest.mark.django_db
def test_an_absurd_step_is_refused_counted_and_its_batch_mates_stored_on_their_own(running, api):  # noqa: F811
    job = running.job
    assert post_reports(api, running, batch(job, [report(job, step=s) for s in (1, 2)])).status_code == 202

    absurd = report(job, step=100_154)
    response = post_reports(api, running, batch(job, [report(job, step=3), absurd]))
    assert response.status_code == 422, response.content
    body = response.json()
    assert body["status"] == 422 and body["type"].endswith("unprocessable")
    assert body["errors"][0]["field"] == "reports.1.step"
    assert body["errors"][0]["reason"].startswith("step_far_ahead: step 100154 is more than 1000 steps past")
    assert sorted(StepMetric.objects.filter(job=job).values_list("step", flat=True)) == [1, 2]  # no half-write
    assert Job.objects.get(pk=job.pk).last_step == 2

    event = Event.objects.get(kind=EventKind.JOB_REPORTS_REFUSED, job=job)
    assert event.evidence["reasons"] == {"step_far_ahead": 1} and event.generation == 1
    metrics = samples(api(running.tokens["viewer"]).get("/metrics").content.decode())
    assert metrics[f'nightwatch_job_reports_refused_total{{job="{job.pk}",kind="step_far_ahead"}}'] == 1
    assert metrics[f'nightwatch_job_reports_refused_total{{job="{job.pk}",kind="world_size_mismatch"}}'] == 0

    # The reporter's answer to a refusal: each record alone. The plausible one is stored.
    assert post_reports(api, running, batch(job, [report(job, step=3)])).status_code == 202
    assert post_reports(api, running, batch(job, [absurd])).status_code == 422
    assert Job.objects.get(pk=job.pk).last_step == 3


@pytest.mark.django_db
def test_a_cursor_going_back_and_a_wrong_world_size_are_refused(running, api):  # noqa: F811
    job = running.job
    Job.objects.filter(pk=job.pk).update(recovery_policy={"max_steps": 400})
    assert post_reports(api, running, batch(job, [report(job, step=5)])).status_code == 202
    back = post_reports(api, running, batch(job, [report(job, step=6, data_cursor=8)]))
    assert back.status_code == 422 and "data_cursor_backwards" in back.json()["detail"]
    wide = post_reports(api, running, batch(job, [report(job, step=6, world_size=3)]))
    assert wide.status_code == 422 and "world_size_mismatch" in wide.json()["detail"]
    late = post_reports(api, running, batch(job, [report(job, step=401)]))
    assert late.status_code == 422 and "past the job's max_steps 400" in late.json()["detail"]
    assert Event.objects.filter(kind=EventKind.JOB_REPORTS_REFUSED, job=job).count() == 3
