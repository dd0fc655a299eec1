"""agents.hooks.reporter.Reporter against a real local HTTP server that can be taken down."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agents.hooks.reporter import DROPPABLE, Reporter
from agents.http import ControlPlaneClient
from agents.protocol import dump
from agents.protocol.hooks import CheckpointCommit, Event, StepReport
from agents.spool import Spool
from tests.waiting import wait_for

POLL_S = 0.02  # the reporter delivers in milliseconds: poll often


def step_report(step, *, rank=0, generation=1, loss=2.0):
    return StepReport(job="job-1", generation=generation, rank=rank, step=step, loss=loss, grad_norm=1.0,
                      world_size=2, data_cursor=step * 8, samples=4, phases={"compute": 0.01}, time=time.time())


def event(step, kind="guard_skip", generation=1):
    return Event(job="job-1", generation=generation, rank=0, step=step, kind=kind, key=f"0:0:{step}:{kind}:0",
                 message=f"{kind} at {step}", time=time.time())


def commit(step, generation=1):
    return CheckpointCommit(job="job-1", generation=generation, step=step, path=f"/ckpt/step-{step}", loss=2.0,
                            config_hash="abc", data_cursor=step * 8, world_size=2, size_bytes=1, blocking_s=0.01,
                            total_s=0.1)


@pytest.fixture
def make_reporter(tmp_path, control_plane):
    made = []

    def make(*, generation=1, url=None, max_records=10_000, spool_name="spool.sqlite3", rank=0, **options):
        spool = Spool(tmp_path / spool_name, max_records=max_records, droppable_kinds=DROPPABLE)
        client = ControlPlaneClient(url or control_plane.url, token="agent-token", timeout=1.0)
        reporter = Reporter(client, spool, job="job-1", generation=generation, rank=rank,
                            **{"flush_interval": 0.05, "max_backoff": 0.2, **options})
        made.append(reporter)
        return reporter

    yield make
    for reporter in made:
        reporter.close(timeout=1.0)


def delivered_steps(control_plane, generation=1):
    return sorted(step for (gen, _, step) in control_plane.reports if gen == generation)


def test_reports_events_and_commits_arrive_in_order_with_the_token(make_reporter, control_plane):
    reporter = make_reporter()
    for step in range(1, 6):
        reporter.report(step_report(step))
    reporter.event(event(3))
    reporter.commit(commit(5))
    wait_for(lambda: len(control_plane.reports) == 5 and control_plane.commits,
             timeout=10, what="delivery", interval=POLL_S)
    sent_steps = [r["step"] for batch in control_plane.received for r in batch["reports"]]
    assert sent_steps == [1, 2, 3, 4, 5]  # each sent once, in order
    assert [e["step"] for e in control_plane.events] == [3]
    assert control_plane.commits[0]["step"] == 5
    assert set(control_plane.tokens) == {"Bearer agent-token"}
    assert set(control_plane.progress) == {"1"}  # rank 0's reports move the job's progress
    wait_for(lambda: len(reporter.spool) == 0, timeout=10, what="acknowledgement", interval=POLL_S)


def test_another_rank_s_reports_say_they_cannot_move_the_job_s_progress(make_reporter, control_plane):
    reporter = make_reporter(rank=1)
    reporter.report(step_report(1, rank=1))
    wait_for(lambda: control_plane.progress, timeout=10, what="delivery", interval=POLL_S)
    assert set(control_plane.progress) == {"0"}


def test_an_outage_spools_everything_and_replays_it_in_order_exactly_once(make_reporter, control_plane):
    control_plane.down()
    reporter = make_reporter()
    for step in range(1, 51):
        reporter.report(step_report(step))
        if step % 10 == 0:
            reporter.event(event(step))
    reporter.commit(commit(50))
    wait_for(lambda: len(reporter.spool) == 56, timeout=10, what="everything spooled while down", interval=POLL_S)
    assert control_plane.received == []

    control_plane.up()  # same port: the reporter's backoff finds it again
    wait_for(lambda: len(reporter.spool) == 0, timeout=10, what="replay after the outage", interval=POLL_S)
    sent_steps = [r["step"] for batch in control_plane.received for r in batch["reports"]]
    assert sent_steps == list(range(1, 51))  # in order, none twice
    assert [e["step"] for e in control_plane.events] == [10, 20, 30, 40, 50]
    assert [c["step"] for c in control_plane.commits] == [50]


def test_a_batch_with_nothing_behind_it_says_how_old_its_newest_step_is(make_reporter, control_plane):
    """Steps held back by an outage go out with the age of the newest (the control plane dates the
    job's progress from it, ``jobs.progress.progress_anchor``) only in the batch that leaves nothing
    behind: the first batch here has a checkpoint commit and newer steps waiting."""
    control_plane.down()
    reporter = make_reporter()
    trained_at = time.time()
    for step in range(1, 11):
        reporter.report(step_report(step))
    reporter.commit(commit(10))
    for step in range(11, 14):
        reporter.report(step_report(step))
    wait_for(lambda: len(reporter.spool) == 14, timeout=10, what="everything spooled while down", interval=POLL_S)
    time.sleep(0.3)  # the held steps age (the outage)
    control_plane.up()
    wait_for(lambda: len(reporter.spool) == 0, timeout=10, what="replay after the outage", interval=POLL_S)
    first, last = control_plane.received
    assert [r["step"] for r in first["reports"]] == list(range(1, 11)) and "newest_step_age_s" not in first
    assert [r["step"] for r in last["reports"]] == [11, 12, 13]
    assert 0.3 <= last["newest_step_age_s"] <= time.time() - trained_at


def test_the_newest_step_s_age_is_said_only_of_everything_undelivered():
    from agents.hooks.reporter import newest_step_age

    batch = {"reports": [{"step": 1, "time": 100.0}, {"step": 2, "time": 101.0}], "events": [], "windows": []}
    assert newest_step_age(batch, everything=True, now=104.5) == 3.5
    assert newest_step_age(batch, everything=False, now=104.5) is None
    assert newest_step_age(batch, everything=True, now=100.0) == 0.0  # a clock stepped back: never negative
    assert newest_step_age({**batch, "reports": []}, everything=True, now=104.5) is None  # events only


def test_an_overloaded_server_is_given_the_time_it_asks_for_and_loses_nothing(make_reporter, control_plane):
    """A 503 with Retry-After (admission control) is waited out, past the reporter's own backoff cap
    (0.2 s here), with jitter; then everything arrives once, in order."""
    control_plane.shed, control_plane.retry_after_s = 2, 1
    reporter = make_reporter()
    for step in range(1, 11):
        reporter.report(step_report(step))
    wait_for(lambda: delivered_steps(control_plane) == list(range(1, 11)), timeout=15,
             what="delivery after two 503s", interval=POLL_S)
    times = [t for t, _ in control_plane.report_posts]
    statuses = [status for _, status in control_plane.report_posts]
    assert statuses[:3] == [503, 503, 202]
    for refused, retried in ((times[0], times[1]), (times[1], times[2])):
        assert 1.0 <= retried - refused < 1.5 + 0.5  # Retry-After plus at most 50% jitter (and slack)
    sent_steps = [r["step"] for batch in control_plane.received for r in batch["reports"]]
    assert sent_steps == list(range(1, 11))


def test_records_delivered_but_not_acknowledged_before_a_crash_are_deduplicated(
        tmp_path, make_reporter, control_plane):
    # A first process delivered steps 1-3; a crash lost its acknowledgement, so a new process
    # finds them still in the spool and sends them again, along with new step 4.
    first = make_reporter(spool_name="crashy.sqlite3")
    for step in (1, 2, 3):
        first.report(step_report(step))
    wait_for(lambda: len(control_plane.reports) == 3, timeout=10, what="first delivery", interval=POLL_S)
    first.close()
    replayed = Spool(tmp_path / "crashy.sqlite3", max_records=100, droppable_kinds=DROPPABLE)
    for step in (1, 2, 3):
        replayed.append("report", dump(step_report(step)), key=f"report:1:0:{step}")
    replayed.close()
    second = make_reporter(spool_name="crashy.sqlite3")
    second.report(step_report(4))
    wait_for(lambda: len(second.spool) == 0 and len(control_plane.reports) == 4,
             timeout=10, what="replay", interval=POLL_S)
    assert delivered_steps(control_plane) == [1, 2, 3, 4]
    assert sum(len(b["reports"]) for b in control_plane.received) == 7  # 3 re-sent, stored once


def test_a_full_spool_drops_old_step_reports_but_never_events_or_commits(make_reporter, control_plane):
    control_plane.down()
    reporter = make_reporter(max_records=10)
    for step in range(1, 31):
        reporter.report(step_report(step))
    for step in (5, 15, 25):
        reporter.event(event(step))
    reporter.commit(commit(30))
    wait_for(lambda: reporter.spool.dropped.get("report") == 24, timeout=10, what="drops", interval=POLL_S)
    control_plane.up()
    wait_for(lambda: len(reporter.spool) == 0, timeout=10, what="replay", interval=POLL_S)
    assert delivered_steps(control_plane) == list(range(25, 31))  # the newest reports survive
    assert [e["step"] for e in control_plane.events] == [5, 15, 25]
    assert [c["step"] for c in control_plane.commits] == [30]


def test_a_stale_generation_stops_delivery_and_raises_the_flag(make_reporter, control_plane):
    control_plane.generation = 2
    reporter = make_reporter(generation=1)
    reporter.report(step_report(1))
    wait_for(lambda: reporter.stale, timeout=10, what="stale flag", interval=POLL_S)
    reporter.report(step_report(2))
    spool_path = reporter.spool.path
    reporter.close()  # its last flush must not send anything for a fenced-off generation either
    assert control_plane.reports == {} and len(control_plane.received) == 0
    assert len(Spool(spool_path, max_records=10)) == 2


def test_leftovers_of_an_older_generation_are_let_go_and_the_current_ones_delivered(
        tmp_path, make_reporter, control_plane):
    old = Spool(tmp_path / "shared.sqlite3", max_records=100, droppable_kinds=DROPPABLE)
    old.append("report", dump(step_report(7, generation=1)), key="report:1:0:7")
    old.close()
    control_plane.generation = 2
    reporter = make_reporter(generation=2, spool_name="shared.sqlite3")
    reporter.report(step_report(1, generation=2))
    wait_for(lambda: len(reporter.spool) == 0, timeout=10, what="delivery", interval=POLL_S)
    assert not reporter.stale
    assert list(control_plane.reports) == [(2, 0, 1)]


def test_control_answers_become_flags_and_checkpoint_now_fires_once_per_request(make_reporter, control_plane):
    control_plane.control = {"checkpoint_now": True, "checkpoint_interval_steps": 40}
    reporter = make_reporter(poll_control=True, control_interval=0.05)
    wait_for(lambda: reporter.checkpoint_interval == 40, timeout=10, what="control poll", interval=POLL_S)
    assert reporter.take_checkpoint_request()
    polls = len(control_plane.tokens)
    wait_for(lambda: len(control_plane.tokens) >= polls + 2, timeout=10, what="more polls", interval=POLL_S)
    assert not reporter.take_checkpoint_request()  # the flag stayed up on the server: the same request
    control_plane.control = {"checkpoint_now": False, "pause": True}
    wait_for(lambda: reporter.pause_requested, timeout=10, what="pause", interval=POLL_S)
    control_plane.control = {"checkpoint_now": True}
    wait_for(reporter.take_checkpoint_request, timeout=10, what="a second request", interval=POLL_S)


def test_a_message_the_server_refuses_is_let_go_instead_of_blocking_the_queue(
        tmp_path, make_reporter, control_plane):
    # As if written by a hooks version the server no longer understands.
    spool = Spool(tmp_path / "old.sqlite3", max_records=100, droppable_kinds=DROPPABLE)
    spool.append("report", {"job": "job-1", "generation": 1, "step": 1, "nonsense": True})
    for step in (2, 3):  # right behind it, so the first attempt sends all three in one batch
        spool.append("report", dump(step_report(step)))
    spool.close()
    reporter = make_reporter(spool_name="old.sqlite3")
    wait_for(lambda: len(reporter.spool) == 0, timeout=10, what="the queue to drain", interval=POLL_S)
    assert sorted(control_plane.reports) == [(1, 0, 2), (1, 0, 3)]  # the good records were not lost
    assert control_plane.bad_requests and "nonsense" in control_plane.bad_requests[0]


def test_the_training_thread_never_waits_for_a_hung_server(make_reporter):
    hang = threading.Event()

    class Hung(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            hang.wait(10)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hung)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        reporter = make_reporter(url=f"http://127.0.0.1:{server.server_address[1]}")
        for step in range(1, 2001):  # would hang here if report() touched the network
            reporter.report(step_report(step))
        assert reporter.dropped_in_memory == 0
    finally:
        hang.set()
        server.shutdown()
        server.server_close()


def test_an_implausible_report_refused_with_422_is_dropped_and_its_batch_mates_delivered(
        make_reporter, control_plane, monkeypatch):
    """Issue 24, item 6: the server refuses a whole batch holding an implausible step (422, nothing
    stored); the reporter then sends the batch's records one at a time, so only the bad one is lost."""
    accept = control_plane.accept_reports

    def plausible_only(body):
        if any(report["step"] > 10_000 for report in body["reports"]):
            return 422, {"status": 422, "detail": "step_far_ahead", "errors": [{"field": "reports.0.step"}]}
        return accept(body)

    monkeypatch.setattr(control_plane, "accept_reports", plausible_only)
    reporter = make_reporter()
    for step in (1, 2, 100_154, 3, 4):
        reporter.report(step_report(step))
    wait_for(lambda: delivered_steps(control_plane) == [1, 2, 3, 4] and len(reporter.spool) == 0, timeout=10,
             what="the plausible reports delivered", interval=POLL_S)
