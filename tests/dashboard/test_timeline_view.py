"""The job timeline: state changes and actions as entries, each run of routine checkpoint activity
folded into one, the folded rows kept for the page's toggle."""

from __future__ import annotations

import pytest

from core.events import EventKind, record_event

pytestmark = pytest.mark.django_db


def test_routine_checkpoint_activity_folds_between_state_changes_and_actions(signed_in, cast):
    from dashboard.queries import timeline

    job = cast.job

    def checkpoint(step):
        record_event(EventKind.CHECKPOINT_COMMIT, actor="node:gpu-01", job=job, reason=f"step {step} committed",
                     evidence={"checkpoint": step, "step": step})
        record_event(EventKind.CHECKPOINT_VERIFY, actor="system:verifier", job=job, reason="verified",
                     old_state="committed", new_state="verified", evidence={"checkpoint": step, "step": step})

    record_event(EventKind.JOB_STATE, actor="user:otto", job=job, old_state="pending", new_state="running")
    for step in (10, 20, 30):
        checkpoint(step)
    record_event(EventKind.CHECKPOINT_PIN, actor="user:olga", job=job, reason="keep for eval",
                 evidence={"checkpoint": 20, "step": 20})
    for step in (40, 50):
        checkpoint(step)

    entries = timeline(job)["entries"]
    kinds = [e["event"].kind if e["event"] else f"fold {len(e['folded'])} {e['steps']}" for e in entries]
    assert kinds == ["fold 4 (40, 50)", "checkpoint.pin", "fold 6 (10, 30)", "job.state"]

    body = signed_in(cast.viewer).get(f"/jobs/{job.pk}/").content.decode()
    assert body.count('<tr class="fold"') == 2 and body.count('<tr class="routine"') == 10
    assert "4 events, steps 40–50" in body and 'id="timeline-routine"' in body


def test_older_entries_are_a_page_away(signed_in, cast, settings):
    from dashboard import queries

    job = cast.job
    for step in range(1, 151):
        record_event(EventKind.JOB_CHECKPOINT_REQUEST, actor="user:otto", job=job, reason=f"request {step}")
    first = queries.timeline(job)
    assert len(first["entries"]) == queries.TIMELINE_EVENTS and first["older"] is not None
    second = queries.timeline(job, before=first["older"])
    third = queries.timeline(job, before=second["older"])
    reasons = [e["event"].reason for page in (first, second, third) for e in page["entries"]]
    assert reasons == [f"request {step}" for step in range(150, 0, -1)] and third["older"] is None
    client = signed_in(cast.viewer)
    body = client.get(f"/jobs/{job.pk}/").content.decode()
    assert f'href="/jobs/{job.pk}/timeline/?before={first["older"]}"' in body
    page = client.get(f"/jobs/{job.pk}/timeline/?before={first['older']}").content.decode()
    assert "request 90<" in page and "request 91<" not in page and 'id="timeline-older"' in page
    assert client.get(f"/jobs/{job.pk}/timeline/?before=nonsense").status_code == 200
