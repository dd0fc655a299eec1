"""A pending job's page says why it waits for nodes (issue 24, item 7)."""

from __future__ import annotations


def test_a_pending_jobs_page_says_why_it_waits(signed_in, cast):
    from jobs.models import Job
    from nodes.models import Node

    Node.objects.filter(pk=cast.node1.pk).update(schedulability="drained")
    job = Job.objects.create(name="wide", entrypoint="t.py", nnodes=2, created_by="test")
    page = signed_in(cast.viewer).get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="waiting-banner"' in page
    assert "not enough healthy nodes: have 1, need 2 (of 2 registered: 1 drained or draining)" in page
    Job.objects.filter(pk=job.pk).update(state="running")
    assert 'id="waiting-banner"' not in signed_in(cast.viewer).get(f"/jobs/{job.pk}/").content.decode()
