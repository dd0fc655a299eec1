"""The dashboard's pages and actions through Django's test client: sign-in, what each role sees,
CSRF, permissions, the services the actions call and the audit rows they leave."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.dashboard.conftest import pause_for_breaker

pytestmark = pytest.mark.django_db


def test_pages_need_a_session(client):
    for url in ("/", "/nodes/", "/jobs/1/"):
        response = client.get(url)
        assert response.status_code == 302
        assert response.url.startswith("/login/?next=")


def test_sign_in_with_the_login_page(client, cast):
    assert client.get("/login/").status_code == 200
    response = client.post("/login/", {"username": "vera", "password": "vera-password-1"})
    assert response.status_code == 302 and response.url == "/"
    page = client.get("/")
    assert page.status_code == 200
    assert cast.job.name in page.content.decode()
    assert client.post("/login/", {"username": "vera", "password": "wrong-password"}).status_code == 200


def test_every_page_renders_for_a_viewer_without_any_button(signed_in, cast):
    job = pause_for_breaker(cast.job)
    viewer = signed_in(cast.viewer)
    for url in ("/", "/nodes/", f"/jobs/{job.pk}/"):
        body = viewer.get(url).content.decode()
        assert 'class="act' not in body, url
    assert "circuit breaker open" in viewer.get(f"/jobs/{job.pk}/").content.decode()


def test_the_job_page_shows_mfu_and_cost(signed_in, cast, settings, time_machine):
    """Cost so far and the part of it wasted to badput, from the efficiency watch (issue 10)."""
    from django.utils import timezone

    from jobs import efficiency
    from jobs.models import Job
    from nodes.models import GPU

    GPU.objects.create(node=cast.node1, index=0, uuid="GPU-0", name="NVIDIA H100 80GB HBM3")  # a known peak
    job = pause_for_breaker(cast.job)
    time_machine.move_to(timezone.now(), tick=False)  # the cost grows with wall time: one instant
    figures = efficiency.snapshot(job)
    body = signed_in(cast.viewer).get(f"/jobs/{job.pk}/").content.decode()
    currency = settings.NIGHTWATCH["EFFICIENCY"]["CURRENCY"]
    assert figures["gpu_peak_known"]
    assert f'<dd id="job-cost">{figures["cost"]["total"]:.2f} {currency}' in body
    assert '<dd id="job-mfu">' in body
    # A CPU job (issue 21): an MFU against a nominal CPU peak, or a GPU-hour cost, means nothing.
    Job.objects.filter(pk=job.pk).update(accelerator="cpu")
    body = signed_in(cast.viewer).get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="job-mfu"' not in body and 'id="job-cost"' not in body and 'id="job-step"' in body


def test_buttons_follow_the_role(signed_in, cast):
    job = pause_for_breaker(cast.job)
    operator_page = signed_in(cast.operator).get(f"/jobs/{job.pk}/").content.decode()
    oncall_page = signed_in(cast.oncall).get(f"/jobs/{job.pk}/").content.decode()
    assert "breaker-banner" in operator_page and "approve-resume" not in operator_page
    assert 'id="approve-resume"' in oncall_page
    assert ">Drain</button>" in signed_in(cast.operator).get("/nodes/").content.decode()


def test_a_viewer_forging_actions_gets_403_and_changes_nothing(signed_in, cast):
    from jobs.models import Event, Job
    from nodes.models import Node

    job = pause_for_breaker(cast.job)
    viewer = signed_in(cast.viewer)
    events = Event.objects.count()
    for url, data in [(f"/jobs/{job.pk}/approve", {}), (f"/jobs/{job.pk}/pause", {}),
                      (f"/jobs/{job.pk}/checkpoint", {}), (f"/jobs/{job.pk}/rollback", {"checkpoint": "1"}),
                      (f"/nodes/{cast.node1.pk}/drain", {})]:
        response = viewer.post(url, {"reason": "forged", **data})
        assert response.status_code == 403, url
        assert response["Content-Type"] == "application/problem+json"
    assert Event.objects.count() == events
    assert Job.objects.get(pk=job.pk).state == "paused"
    assert Node.objects.get(pk=cast.node1.pk).schedulability == "active"
    # An operator may drain but not approve a resume.
    assert signed_in(cast.operator).post(f"/jobs/{job.pk}/approve", {"reason": "x"}).status_code == 403


def test_actions_refuse_without_the_csrf_token(signed_in, cast):
    from nodes.models import Node

    operator = signed_in(cast.operator, csrf=True)
    response = operator.post(f"/nodes/{cast.node1.pk}/drain", {"reason": "bad fan"})
    assert response.status_code == 403
    assert Node.objects.get(pk=cast.node1.pk).schedulability == "active"
    token = operator.get("/nodes/").cookies["csrftoken"].value
    response = operator.post(f"/nodes/{cast.node1.pk}/drain", {"reason": "bad fan"}, HTTP_X_CSRFTOKEN=token)
    assert response.status_code == 200, response.content


def test_drain_and_undrain_call_the_fleet_service_and_are_audited(signed_in, cast):
    from jobs.models import Event
    from nodes.models import Node

    operator = signed_in(cast.operator)
    assert operator.post(f"/nodes/{cast.node1.pk}/drain", {"reason": "bad fan"}).json()["ok"]
    node = Node.objects.get(pk=cast.node1.pk)
    assert node.schedulability == "drained" and node.drain_reason == "bad fan"
    audit = Event.objects.get(kind="node.drain", node=node)
    assert (audit.actor, audit.reason, audit.new_state) == ("user:otto", "bad fan", "drained")
    again = operator.post(f"/nodes/{cast.node1.pk}/drain", {"reason": "twice"})
    assert again.status_code == 409 and "already drained" in again.json()["detail"]
    assert operator.post(f"/nodes/{cast.node1.pk}/undrain", {"reason": "fan replaced"}).status_code == 200
    assert Node.objects.get(pk=cast.node1.pk).schedulability == "active"
    assert Event.objects.filter(kind="node.undrain", node=node, actor="user:otto").exists()


def test_an_action_needs_a_reason(signed_in, cast):
    response = signed_in(cast.operator).post(f"/nodes/{cast.node1.pk}/drain", {"reason": "  "})
    assert response.status_code == 400 and "reason" in response.json()["detail"]
    assert signed_in(cast.operator).get(f"/nodes/{cast.node1.pk}/drain").status_code == 405


def test_oncall_approves_a_resume(signed_in, cast):
    from jobs.models import Event, Job

    job = pause_for_breaker(cast.job)
    response = signed_in(cast.oncall).post(f"/jobs/{job.pk}/approve", {"reason": "flaky switch replaced"})
    assert response.status_code == 200, response.content
    job = Job.objects.get(pk=job.pk)
    assert (job.state, job.generation) == ("initializing", 2)
    assert job.breaker_reset_at is not None
    audit = Event.objects.get(kind="job.state", job=job, old_state="paused")
    assert audit.actor == "user:olga" and "flaky switch replaced" in audit.reason
    # Approving again is a conflict, answered with the state machine's words.
    again = signed_in(cast.oncall).post(f"/jobs/{job.pk}/approve", {"reason": "again"})
    assert again.status_code == 409 and "only a paused job can be resumed" in again.json()["detail"]


def test_checkpoint_now_asks_the_running_generation_and_is_audited(signed_in, cast):
    from core.models import Event
    from jobs import state
    from jobs.models import Job

    operator = signed_in(cast.operator)
    state.transition(cast.job, "initializing", actor="t")
    state.transition(cast.job, "running", actor="t")
    assert ">Checkpoint now</button>" in operator.get(f"/jobs/{cast.job.pk}/").content.decode()
    response = operator.post(f"/jobs/{cast.job.pk}/checkpoint", {"reason": "before the switch upgrade"})
    assert response.status_code == 200, response.content
    assert Job.objects.get(pk=cast.job.pk).checkpoint_requested_at is not None
    audit = Event.objects.get(kind="job.checkpoint_request", job=cast.job)
    assert (audit.actor, audit.reason) == ("user:otto", "checkpoint requested: before the switch upgrade")
    paused = pause_for_breaker(cast.job, start=False)
    refused = operator.post(f"/jobs/{paused.pk}/checkpoint", {"reason": "too late"})
    assert refused.status_code == 409 and "only a running job" in refused.json()["detail"]


def test_rollback_names_a_checkpoint_of_the_job(signed_in, cast):
    job = pause_for_breaker(cast.job)
    response = signed_in(cast.operator).post(f"/jobs/{job.pk}/rollback", {"reason": "spike", "checkpoint": "999"})
    assert response.status_code == 400 and "no checkpoint" in response.json()["detail"]


def test_the_nodes_grid_shows_each_gpus_health_and_recent_faults(signed_in, cast):
    from django.utils import timezone

    from nodes.models import GPU

    GPU.objects.create(node=cast.node1, index=0, health="healthy", last_sample_at=timezone.now(),
                       last_sample={"temperature_c": 48.0, "xid_recent": 0})
    GPU.objects.create(node=cast.node1, index=1, health="unhealthy", last_sample_at=timezone.now(),
                       last_sample={"temperature_c": 93.0, "xid_recent": 2, "recent_xid_codes": [48, 79],
                                    "ecc_uncorrected_recent": 3})
    # The GPU's name is the agent's word (registration): hostile text is shown, never run. One
    # silent for minutes is drawn stale, one that never said its temperature with a dash.
    GPU.objects.create(node=cast.node1, index=2, health="healthy", name='<img src=x onerror="alert(1)">',
                       last_sample_at=timezone.now() - timedelta(minutes=5), last_sample={"xid_recent": 0})
    body = signed_in(cast.viewer).get("/nodes/").content.decode()
    assert "48°C" in body and "93°C" in body
    assert "Xid 48,79" in body and "ECC 3" in body
    assert 'class="gpu h-unhealthy" data-gpu="1"' in body and 'class="gpu h-healthy" data-gpu="0"' in body
    assert ('<div class="gpu h-healthy stale" data-gpu="2" title="&lt;img src=x onerror=&quot;alert(1)&quot;&gt; 2: '
            'healthy"><b>2</b><span>–</span></div>') in body
    assert "<img src=x" not in body
