"""The job page's training output panel and its Resize action (issue 21)."""

from __future__ import annotations

import pytest

from tests.dashboard.conftest import pause_for_breaker

pytestmark = pytest.mark.django_db


def test_the_job_page_shows_the_training_output_tail_escaped(signed_in, cast):
    from jobs.models import LogLine, LogStream

    job = pause_for_breaker(cast.job)
    body = signed_in(cast.viewer).get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="job-logs"' in body and "No training output yet" in body
    stream = LogStream.objects.create(job=job, generation=1, hostname="gpu-01", next_line=2)
    LogLine.objects.create(job=job, generation=1, stream=stream, line=0, text="step 1 loss 2.5")
    LogLine.objects.create(job=job, generation=1, stream=stream, line=1, text="<script>alert(1)</script>")
    body = signed_in(cast.viewer).get(f"/jobs/{job.pk}/").content.decode()
    assert "=== generation 1 on gpu-01 ===" in body and "step 1 loss 2.5" in body
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body and "<script>alert(1)" not in body  # node text is hostile
    assert f"nightwatch logs {job.pk} --follow" in body


def test_resize_is_an_operator_action_validated_and_audited(signed_in, cast):
    from jobs.models import Event, Job

    job = pause_for_breaker(cast.job)
    operator, viewer = signed_in(cast.operator), signed_in(cast.viewer)
    assert 'id="resize"' in operator.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="resize"' not in viewer.get(f"/jobs/{job.pk}/").content.decode()
    url = f"/jobs/{job.pk}/resize"
    assert viewer.post(url, {"reason": "r", "nnodes": "1", "nproc_per_node": "1"}).status_code == 403
    bad = operator.post(url, {"reason": "r", "nnodes": "0", "nproc_per_node": "1"})
    assert bad.status_code == 400 and bad.json()["detail"] == "nnodes: a whole number from 1 to 4096."
    same = operator.post(url, {"reason": "r", "nnodes": str(job.nnodes), "nproc_per_node": str(job.nproc_per_node)})
    assert same.status_code == 400 and "already runs on" in same.json()["detail"]
    never = operator.post(url, {"reason": "r", "nnodes": "9", "nproc_per_node": "1"})
    assert never.status_code == 422 and "nnodes" in never.json()["detail"]
    done = operator.post(url, {"reason": "one rank", "nnodes": "1", "nproc_per_node": "1"})
    assert done.status_code == 200 and "the next resume takes it" in done.json()["message"]
    assert Job.objects.get(pk=job.pk).resize_to == {"nnodes": 1, "nproc_per_node": 1}
    event = Event.objects.get(job=job, kind="job.resize")
    assert event.actor == "user:otto" and "one rank" in event.reason
