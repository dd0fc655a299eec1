"""The dashboard in a real browser (Debian's Chromium, headless, driven by Playwright) against a
real daphne and Celery worker on the test database.

The server runs the way the embedded demo does — the in-memory channel layer and the worker in a
separate process (filesystem broker) — so every change the worker commits (a breaker pause
after a spike run) reaches the browser only through the web process's relay: the path a naive
"group_send from the task" would break. One server and one browser serve the whole module;
screenshots of each page go to ``$NIGHTWATCH_ARTIFACTS`` (default ``var/artifacts/screenshots``).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.cluster import ROOT, Cluster
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
ARTIFACTS = Path(os.environ.get("NIGHTWATCH_ARTIFACTS", ROOT / "var" / "artifacts" / "screenshots"))
#: The issue's bar: a step report shows on the open chart within a second of its commit.
CHART_WITHIN_S = 1.0


class World:
    """The module's server, browser and cast."""

    def __init__(self, cluster: Cluster, browser, people: dict, nodes: dict, agent_tokens: dict):
        self.cluster, self.browser, self.people, self.nodes, self.agent_tokens = (
            cluster, browser, people, nodes, agent_tokens)
        self.signed_in: dict[str, dict] = {}
        #: what the pages' Content-Security-Policy blocked: the dashboard must work within it
        self.csp_violations: list[str] = []

    def page_as(self, who: str):
        """A new browser context signed in as ``who`` through the login page (once per person)."""
        options = {"viewport": {"width": 1400, "height": 1000}}
        if who in self.signed_in:
            return self._watched(self.browser.new_context(storage_state=self.signed_in[who], **options).new_page())
        page = self._watched(self.browser.new_context(**options).new_page())
        page.goto(f"{self.cluster.url}/")
        assert "/login/" in page.url
        page.fill("input[name=username]", who)
        page.fill("input[name=password]", f"{who}-password-1")
        page.click("form#login button[type=submit]")
        page.wait_for_url(f"{self.cluster.url}/")
        self.signed_in[who] = page.context.storage_state()
        return page

    def _watched(self, page):
        page.on("console", lambda message: self.csp_violations.append(message.text)
                if "Content Security Policy" in message.text else None)
        return page

    def report(self, job, steps, *, generation: int, node: str = "gpu-01", spike_at=(), skipped_at=()) -> float:
        """POST step reports of both ranks through the API, as the hooks do; returns when it answered.
        Like the hooks, each rank sends a ``spike`` event with the run of spikes it counted."""
        from agents.protocol import dump
        from agents.protocol import hooks as wire

        runs, run = {}, 0
        for step in steps:
            run = run + 1 if step in spike_at else 0
            runs[step] = run
        batch = wire.ReportBatch(job=str(job.pk), generation=generation, reports=[
            wire.StepReport(job=str(job.pk), generation=generation, rank=rank, step=step,
                            loss=(9.0 if step in spike_at else 3.0 - step * 0.02) + rank * 0.01,
                            grad_norm=1.2 + (step % 3) * 0.1, world_size=2, data_cursor=step * 16, samples=8,
                            phases={"input": 0.01, "compute": 0.08 * (1.6 if rank == 1 else 1.0), "optimizer": 0.02},
                            spike=step in spike_at, skipped=step in skipped_at, time=time.time())
            for step in steps for rank in (0, 1)], events=[
            wire.Event(job=str(job.pk), generation=generation, rank=rank, step=step, kind="spike",
                       key=f"0:{rank}:{step}:spike:0", message=f"loss spike at step {step}",
                       detail={"consecutive": runs[step]}, time=time.time())
            for step in steps if step in spike_at for rank in (0, 1)])
        request = urllib.request.Request(  # noqa: S310 - the test's own server
            f"{self.cluster.url}/api/v1/jobs/{job.pk}/reports", data=json.dumps(dump(batch)).encode(), method="POST",
            headers={"Authorization": f"Bearer {self.agent_tokens[node]}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
                assert response.status == 202
        except urllib.error.HTTPError as error:
            raise AssertionError(f"reports refused: {error.code} {error.read()[:2000]!r}") from None
        return time.monotonic()


@pytest.fixture
def world(transactional_db, tmp_path_factory):
    from django.db import connection
    from playwright.sync_api import sync_playwright

    if connection.vendor != "postgresql":
        pytest.fail("browser tests need PostgreSQL: run them through `make test`")
    people, nodes, tokens = _cast()
    cluster = Cluster(tmp_path_factory.mktemp("dashboard"), database_name=connection.settings_dict["NAME"],
                      redis_db=int(os.environ.get("NIGHTWATCH_E2E_REDIS_DB", "14")),
                      settings={"NIGHTWATCH_QUIESCE_TIMEOUT_S": "2"})
    # As in the embedded demo: the in-memory channel layer, the worker in its own process.
    cluster.env.pop("REDIS_URL")
    playwright = None
    try:
        cluster.start_web()
        cluster.start_worker()
        # Playwright's sync API keeps an event loop in this thread; the test's own ORM calls are
        # still plain synchronous code (the servers never see this variable).
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
        playwright = sync_playwright().start()
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        yield World(cluster, browser, people, nodes, tokens)
        browser.close()
    except BaseException:
        print(cluster.dump_logs())
        raise
    finally:
        if playwright is not None:
            playwright.stop()
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        cluster.close()
        # Playwright's sync API switches contexts under Django, whose connections live in context
        # variables: ORM calls made meanwhile may have opened connections no one can close from
        # here; they would keep the test database from being dropped.
        with connection.cursor() as cursor:
            cursor.execute("select pg_terminate_backend(pid) from pg_stat_activity "
                           "where datname = current_database() and pid <> pg_backend_pid()")


def test_the_dashboard_in_a_browser(world):
    """One server and one browser for every scenario (each is a few seconds; starting them is not)."""
    try:
        reports_spikes_breaker_approve_and_reconnect(world)
        a_viewer_sees_no_button_and_a_forged_post_is_refused(world)
        drain_from_the_nodes_page(world)
        rollback_from_the_lineage_tree_starts_a_new_branch(world)
        a_lineage_of_30_checkpoints_and_two_branches(world)
        a_job_of_4096_ranks_on_512_nodes(world)
        a_fleet_of_a_thousand_nodes(world)  # last: its nodes would take the other scenarios' jobs
        assert world.csp_violations == []
    except BaseException:
        print(world.cluster.dump_logs())
        raise


def _cast():
    from django.contrib.auth.models import Group, User
    from django.utils import timezone

    from core.models import ApiToken
    from nodes.models import GPU, Node

    people = {}
    for name, role in [("olga", "oncall"), ("otto", "operator"), ("vera", "viewer")]:
        people[name] = User.objects.create_user(name, password=f"{name}-password-1")
        people[name].groups.add(Group.objects.get(name=role))
    nodes, tokens = {}, {}
    now = timezone.now()
    for host in ("gpu-01", "gpu-02", "gpu-03", "gpu-04"):
        nodes[host] = Node.objects.create(hostname=host, address="127.0.0.1", health="healthy")
        _, tokens[host] = ApiToken.issue(name=f"agent {host}", scope="agent", node=nodes[host])
        for index in range(2):
            bad = host == "gpu-04" and index == 1
            GPU.objects.create(node=nodes[host], index=index, name="H100", health="unhealthy" if bad else "healthy",
                               last_sample_at=now, last_sample={"temperature_c": 91 if bad else 52,
                                                                "xid_recent": 1 if bad else 0,
                                                                "recent_xid_codes": [79] if bad else []})
    return people, nodes, tokens


def _job(name: str):
    """A job launched as the API launches it; the worker places its first generation."""
    from jobs import services
    from jobs.models import Job

    job = services.launch_job({"name": name, "entrypoint": "examples/train.py", "nnodes": 1, "nproc_per_node": 2,
                               "accelerator": "cpu", "recovery_policy": {"loss_spike_limit": 3, "max_restarts": 10}},
                              actor="user:otto")
    wait_for(lambda: Job.objects.get(pk=job.pk).generation == 1, timeout=30, what=f"{name} to be placed")
    job.refresh_from_db()
    return job


def _live(page):
    page.wait_for_selector("#live[data-state=live]", timeout=15_000)


def _confirm(page, reason: str, *, force: bool = False):
    page.wait_for_selector("dialog#confirm[open]")
    page.fill("#confirm-reason", reason)
    if force:
        page.check("#confirm-force")
    page.click("#confirm-ok")


def _shot(page, name: str):
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def reports_spikes_breaker_approve_and_reconnect(world):
    from jobs import services
    from jobs.models import Event, Job

    job = _job("llama-live")
    page = world.page_as("olga")
    page.goto(f"{world.cluster.url}/jobs/{job.pk}/")
    _live(page)

    # Reports posted through the API show on the open chart within a second of their commit.
    world.report(job, [1, 2], generation=1)
    # Functions, not bare expressions: Playwright eval()s an expression in the page, which the page's
    # CSP forbids (no 'unsafe-eval'); a function is compiled by the DevTools protocol instead.
    page.wait_for_function("() => window.nightwatch.points.has(2)", timeout=10_000)
    answered = world.report(job, [3, 4, 5], generation=1, spike_at={4}, skipped_at={5})
    page.wait_for_function("() => window.nightwatch.points.has(5)", timeout=10_000)
    assert time.monotonic() - answered <= CHART_WITHIN_S
    page.wait_for_selector('#markers li[data-kind=spike][data-step="4"]', timeout=5_000)
    page.wait_for_selector('#markers li[data-kind=skipped][data-step="5"]', timeout=5_000)
    assert page.locator("#chart canvas").count() >= 1
    _shot(page, "job-running")

    # A run of three spikes: the worker (another process) pauses the job; the banner appears.
    world.report(job, [6, 7, 8], generation=1, spike_at={6, 7, 8})
    page.wait_for_selector("#breaker-banner", timeout=30_000)
    assert Job.objects.get(pk=job.pk).state == "paused"
    _shot(page, "job-breaker-open")

    # The on-call approves. gpu-01 never confirmed its ranks stopped (no agent runs here), so the
    # first try is refused as a possible split brain; forcing it is the on-call's call.
    page.click("#approve-resume")
    _confirm(page, "spikes were a bad shard; resuming")
    page.wait_for_selector("#confirm-error:has-text('split brain')", timeout=10_000)
    _confirm(page, "gpu-01 is known to be down; resuming", force=True)
    page.wait_for_selector("#breaker-banner", state="detached", timeout=10_000)
    job.refresh_from_db()
    assert (job.state, job.generation) == ("initializing", 2)
    audit = Event.objects.get(job=job, kind="job.state", old_state="paused", new_state="recovering")
    assert audit.actor == "user:olga" and "gpu-01 is known to be down" in audit.reason
    world.report(job, [9], generation=2)  # the new generation's first step
    wait_for(lambda: Job.objects.get(pk=job.pk).state == "running", timeout=10, what="the job to run again")
    page.wait_for_selector("#job-state:has-text('running')", timeout=10_000)

    # The WebSocket drops; meanwhile the job moves on; the reconnect's snapshot shows it.
    snapshots = page.evaluate("window.nightwatch.snapshots")
    page.evaluate("window.nightwatch.holdReconnect = true; window.nightwatch.drop()")
    page.wait_for_selector("#live[data-state=reconnecting]")
    world.report(job, [10, 11, 12], generation=2)
    services.pause_job(Job.objects.get(pk=job.pk), actor="user:otto", reason="maintenance window")
    time.sleep(0.5)  # what the relay pushes now reaches no one: this page is disconnected
    assert page.locator("#job-state:has-text('quiescing')").count() == 0
    page.evaluate("window.nightwatch.holdReconnect = false")
    page.wait_for_function(f"() => window.nightwatch.snapshots > {snapshots}", timeout=15_000)
    page.wait_for_selector("#job-state:has-text('quiescing')", timeout=5_000)
    assert page.evaluate("window.nightwatch.points.has(12)")
    page.context.close()


def a_viewer_sees_no_button_and_a_forged_post_is_refused(world):
    from jobs.models import Job
    from tests.dashboard.conftest import pause_for_breaker

    job = pause_for_breaker(_job("viewer-view"), start=False)
    page = world.page_as("vera")
    for path, name in [("/", "overview-viewer"), ("/nodes/", "nodes-viewer"), (f"/jobs/{job.pk}/", "job-viewer")]:
        page.goto(f"{world.cluster.url}{path}")
        _live(page)
        assert page.locator("button.act").count() == 0, path
        _shot(page, name)
    assert page.locator("#breaker-banner").is_visible()  # the banner, without its button
    token = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    answer = page.request.post(f"{world.cluster.url}/jobs/{job.pk}/approve", form={"reason": "forged"},
                               headers={"X-CSRFToken": token, "Referer": f"{world.cluster.url}/"})
    assert answer.status == 403 and "approve" in answer.json()["detail"]
    assert Job.objects.get(pk=job.pk).state == "paused"
    page.context.close()


def drain_from_the_nodes_page(world):
    from jobs.models import Event
    from nodes.models import Node

    page = world.page_as("olga")
    page.goto(f"{world.cluster.url}/")
    _live(page)
    _shot(page, "overview")
    page.goto(f"{world.cluster.url}/nodes/")
    _live(page)
    row = page.locator('tr[data-node="gpu-04"]')
    row.locator("button.act:has-text('Drain')").click()
    _confirm(page, "fan failing")
    page.wait_for_selector('tr[data-node="gpu-04"][data-schedulability="drained"]', timeout=10_000)
    assert "Xid 79" in page.locator('tr[data-node="gpu-04"] .gpu.h-unhealthy').inner_text()
    node = Node.objects.get(hostname="gpu-04")
    assert (node.schedulability, node.drain_reason) == ("drained", "fan failing")
    assert Event.objects.filter(kind="node.drain", node=node, actor="user:olga").exists()
    _shot(page, "nodes")

    # The heat map opens the node's page: its drain in the timeline, its telemetry charted.
    from datetime import timedelta

    from django.utils import timezone

    from nodes.models import NodeGpuSample

    now = timezone.now()
    NodeGpuSample.objects.bulk_create([
        NodeGpuSample(node=node, time=now - timedelta(seconds=10 * i), gpus=0b11, temperature_c=[52, 91 - i % 3],
                      utilization_pct=[97, 0], memory_used_mib=[2048, 2048], power_w=[400, 90]) for i in range(30)])
    page.click('#gpu-heatmap a[data-node="gpu-04"]')
    page.wait_for_selector('#node-head[data-schedulability="drained"]', timeout=10_000)
    _live(page)
    page.wait_for_function("() => window.nightwatch.nodeCharts === 4", timeout=10_000)
    assert page.locator("#node-charts canvas").count() >= 4
    assert "fan failing" in page.locator("#node-activity").inner_text()
    _shot(page, "node")
    page.context.close()


def rollback_from_the_lineage_tree_starts_a_new_branch(world):
    from django.conf import settings
    from django.test import override_settings

    from checkpoints import services as checkpoint_services
    from checkpoints.paths import checkpoint_dir
    from jobs.checkpointing import commit_checkpoint
    from jobs.models import Event
    from tests.checkpoints.conftest import build_checkpoint, commit_for

    job = _job("rollback-me")
    checkpoints = {}
    # Checkpoints lie in the job's directory under the cluster's root, as the hooks would write them:
    # the control plane (here and in the server) refuses any other place.
    root = world.cluster.env["NIGHTWATCH_CHECKPOINT_ROOT"]
    with override_settings(NIGHTWATCH={**settings.NIGHTWATCH, "CHECKPOINT_ROOT": root}):
        for step in (2, 4):
            path = build_checkpoint(Path(checkpoint_dir(job)) / f"step-{step}", step=step, data_cursor=step * 8,
                                    config_hash="c0ffee")
            checkpoint, _ = commit_checkpoint(job, commit_for(job, path, generation=job.generation),
                                              actor="node:test")
            checkpoints[step] = checkpoint_services.verify(checkpoint)
    job = _pause(job)
    page = world.page_as("olga")
    page.goto(f"{world.cluster.url}/jobs/{job.pk}/")
    _live(page)
    node = page.locator(f'#lineage li[data-checkpoint="{checkpoints[2].pk}"]')
    assert "verified" in node.locator(".badge").first.inner_text()
    assert page.locator('#lineage li[data-depth="0"]').count() == 2  # a chain is a list, not a staircase
    # The commits and verifications are one folded timeline row until the toggle asks for them.
    fold, routine = page.locator("#timeline tr.fold"), page.locator("#timeline tr.routine").first
    assert fold.is_visible() and not routine.is_visible()
    page.check("#timeline-routine")
    assert routine.is_visible() and not fold.is_visible()
    _shot(page, "job-lineage")
    node.locator("button.act:has-text('roll back to here')").first.click()
    _confirm(page, "loss spike after step 2")
    # The dialog closes when the answer comes, after the relaunch the rollback makes in the request.
    page.wait_for_selector("dialog#confirm:not([open])", state="attached", timeout=30_000)
    assert not page.locator("#confirm-error").inner_text()
    job.refresh_from_db()
    assert job.branch_root_id == checkpoints[2].pk
    assert job.state == "initializing" and job.branch_since_generation == job.generation
    assert Event.objects.filter(job=job, kind="job.state", actor="user:olga", reason__contains="rollback").exists()
    page.wait_for_selector("#job-state:has-text('initializing')", timeout=10_000)
    page.context.close()


def a_lineage_of_30_checkpoints_and_two_branches(world):
    """30 checkpoints on the main line and two rollback branches: a list one lane deep at most,
    the branches above their forks, the older rows folded until asked for."""
    from jobs.models import Job
    from tests.dashboard.test_lineage_view import branched_lineage

    # Finished, so that the worker places nothing for it: its generations are made here.
    job = Job.objects.create(name="branchy", entrypoint="examples/train.py", created_by="user:otto",
                             state="completed", generation=3)
    branched_lineage(job)
    page = world.page_as("vera")
    page.goto(f"{world.cluster.url}/jobs/{job.pk}/")
    _live(page)
    depths = page.eval_on_selector_all("#lineage li, #lineage-older li",
                                       "els => els.map(e => Number(e.dataset.depth))")
    assert len(depths) == 35 and max(depths) == 1
    assert page.locator("#lineage li.fork").count() == 1 and not page.locator("#lineage-older").is_visible()
    page.click("details.lineage-older summary")
    assert page.locator("#lineage-older li.fork").count() == 1
    _shot(page, "job-lineage-branches")
    page.context.close()


def a_job_of_4096_ranks_on_512_nodes(world):
    """A 512-node job's timings (a window per node every 10 steps, rank 2403 slow): the skew view
    shows the 32 slowest nodes with the straggler's node first, and opens it window by window."""
    from datetime import UTC, datetime

    from jobs.models import NodeWindow

    job = _job("big-run")
    now = time.time()
    slow = {"input": 0.01, "compute": 0.9, "optimizer": 0.05, "checkpoint": 0.0}
    usual = {"input": 0.01, "compute": 0.45, "optimizer": 0.05, "checkpoint": 0.0}
    NodeWindow.objects.bulk_create([
        NodeWindow(job=job, generation=job.generation, node=node, first_step=last - 9, last_step=last, ranks=8,
                   step_median_s=0.51, step_max_s=0.96 if node == 300 else 0.55,
                   slowest_rank=2403 if node == 300 else node * 8, slowest_s=0.96 if node == 300 else 0.52,
                   slowest_phases=slow if node == 300 else usual, phases=usual,
                   reported_at=datetime.fromtimestamp(now - 200 + last, UTC))
        for last in range(10, 121, 10) for node in range(512)])
    page = world.page_as("vera")
    page.goto(f"{world.cluster.url}/jobs/{job.pk}/")
    _live(page)
    assert page.locator("#rank-skew tbody tr").count() == 32
    assert page.locator('#rank-skew tr.straggler[data-node="300"]').count() == 1
    assert "of 512 nodes" in page.locator("#rank-skew caption").inner_text()
    _shot(page, "job-4096-ranks")
    page.click('#rank-skew tr[data-node="300"] th a')
    page.wait_for_selector("#job-node-windows", timeout=10_000)
    assert page.locator("#job-node-windows td.rank").first.inner_text() == "2403"
    page.context.close()


def a_fleet_of_a_thousand_nodes(world):
    """1,020 more nodes × 8 GPUs: the heat map draws them all, search and a colouring narrow it,
    and a click opens the node's page."""
    from django.utils import timezone

    from nodes.models import GPU, Node

    now = timezone.now()
    nodes = Node.objects.bulk_create([
        Node(hostname=f"rack{i // 32:02d}-gpu{i % 32:02d}", address="127.0.0.1", health="healthy",
             labels={"rack": f"r{i // 32:02d}"}, last_heartbeat_at=now) for i in range(1020)])
    GPU.objects.bulk_create([GPU(node=node, index=g, health="healthy", last_sample_at=now,
                                 last_sample={"temperature_c": 40.0 + (node.pk + g) % 50})
                             for node in nodes for g in range(8)])
    page = world.page_as("olga")
    page.goto(f"{world.cluster.url}/nodes/")
    _live(page)
    assert page.locator("#gpu-heatmap a.hm-node").count() == 1024
    assert page.locator("#gpu-heatmap i").count() == 8 * 1020 + 8  # and the world's 4 nodes' 2 GPUs each
    # A node's change patches its block of the map in place; the map is not sent again.
    from nodes.services import set_health

    set_health(Node.objects.get(hostname="rack03-gpu04"), "unhealthy", reason="Xid 79 on GPU 2")
    page.wait_for_selector('#gpu-heatmap a.hm-node.n-unhealthy[data-node="rack03-gpu04"]', timeout=10_000)
    assert page.evaluate("window.nightwatch.cellsPatched") >= 1
    _shot(page, "fleet")
    page.fill('#node-filter input[name="q"]', "rack07-")
    page.click('#node-filter button[type="submit"]')
    page.wait_for_selector('#nodes-grid tr[data-node="rack07-gpu31"]', timeout=10_000)
    assert page.locator("#nodes-grid tbody tr").count() == 32 and page.locator("#gpu-heatmap a.hm-node").count() == 32
    page.click('a[data-colour="temperature"]')
    page.wait_for_selector("#gpu-heatmap.by-temperature", timeout=10_000)
    _live(page)
    _shot(page, "fleet-temperature")
    page.click('#gpu-heatmap a[data-node="rack07-gpu05"]')
    page.wait_for_selector('#node-head h2:has-text("rack07-gpu05")', timeout=10_000)
    assert page.locator("#node-gpus tbody tr").count() == 8
    page.context.close()


def _pause(job):
    """Pause ``job`` as an operator would, its ranks confirmed gone."""
    from jobs import state
    from jobs.models import Generation

    state.transition(job, "paused", actor="user:otto", reason="investigating a spike", pause_reason="investigating")
    Generation.objects.filter(job=job, number=job.generation).update(stopped_nodes=["gpu-01", "gpu-02", "gpu-03",
                                                                                     "gpu-04"])
    job.refresh_from_db()
    return job
