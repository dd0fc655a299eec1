"""What the fleet benchmark reads about the Celery queues from outside: what a backlog is made of
(``queue_census``, from the messages Celery put in Redis) and which tasks a worker discarded unrun
(``discarded_tasks``, from the worker's log), and how the report words them (``_tasks``)."""

from __future__ import annotations

import uuid

import pytest
import redis
from django.conf import settings

from bench._fleet_measure import discarded_tasks, queue_census
from bench._fleet_report import _tasks
from controlplane.celery import app


@pytest.fixture
def redis_url():
    return settings.REDIS_URL or "redis://127.0.0.1:6379/5"


def test_the_census_counts_the_waiting_tasks_of_each_queue_by_name(redis_url):
    queues = (f"census-{uuid.uuid4().hex}", f"census-{uuid.uuid4().hex}")
    client = redis.Redis.from_url(redis_url)
    try:
        with app.connection_for_write(redis_url) as connection:
            sent = [("jobs.tasks.handle_exit", queues[0]), ("jobs.tasks.handle_exit", queues[0]),
                    ("jobs.tasks.handle_node_health", queues[0]), ("jobs.tasks.check_stragglers", queues[1])]
            for name, queue in sent:
                app.send_task(name, args=(1, 2), queue=queue, connection=connection)
        client.lpush(queues[1], b"not a celery message")
        census = queue_census(client, queues)
    finally:
        client.delete(*queues)
    assert census == {queues[0]: {"jobs.tasks.handle_exit": 2, "jobs.tasks.handle_node_health": 1},
                      queues[1]: {"jobs.tasks.check_stragglers": 1, "(unreadable)": 1}}
    assert queue_census(client, queues) == {}  # empty queues are left out


def test_discarded_tasks_are_counted_from_what_the_log_gained(tmp_path):
    log = tmp_path / "worker.log"
    before = "[2026-12-07 22:00:00,001: INFO/MainProcess] Discarding revoked task: jobs.tasks.sweep[0f1e]\n"
    log.write_text(before)
    with log.open("a") as f:  # Celery's own words (celery.worker.request: "Discarding revoked task: %s[%s]")
        f.write("[2026-12-07 22:00:01,002: INFO/MainProcess] Discarding revoked task: "
                "nodes.tasks.expire_heartbeats[9a2b-77]\n"
                "[2026-12-07 22:00:01,500: INFO/ForkPoolWorker-1] Task jobs.tasks.sweep[1c] succeeded in 0.01s: None\n"
                "[2026-12-07 22:00:02,003: INFO/MainProcess] Discarding revoked task: "
                "nodes.tasks.expire_heartbeats[c3d4]\n"
                "[2026-12-07 22:00:02,004: INFO/MainProcess] Discarding revoked task: jobs.tasks.expire_progress[e5]\n")
    assert discarded_tasks({log: len(before)}) == {"nodes.tasks.expire_heartbeats": 2, "jobs.tasks.expire_progress": 1}
    assert discarded_tasks({log: 0})["jobs.tasks.sweep"] == 1
    other = tmp_path / "sweeper.log"
    other.write_text(before)
    assert discarded_tasks({log: 0, other: 0})["jobs.tasks.sweep"] == 2  # both workers' logs
    assert discarded_tasks({tmp_path / "no-such.log": 0}) == {}


def test_the_report_names_the_most_by_short_name():
    assert _tasks({"celery": {"jobs.tasks.handle_exit": 3, "jobs.tasks.handle_node_health": 5},
                   "background": {"jobs.tasks.check_stragglers": 9, "jobs.tasks.roll_up": 1}}) == \
        "check_stragglers 9, handle_node_health 5, handle_exit 3"
    assert _tasks({"nodes.tasks.expire_heartbeats": 2}) == "expire_heartbeats 2"
    assert _tasks({}) == "none"
    assert _tasks(None) == "—"  # a run from before the figure


def test_waiting_for_a_cpu_is_read_per_thread_and_summed_by_role():
    import os
    import threading

    from bench._fleet_measure import run_queue_wait, schedstat

    before = schedstat([os.getpid()])
    assert (os.getpid(), os.getpid()) in before  # the main thread is a task of its own
    done = threading.Event()
    worker = threading.Thread(target=lambda: (sum(range(200_000)), done.wait(5)))
    worker.start()
    after = schedstat([os.getpid()])
    done.set()
    worker.join()
    assert len(after) > len(before) and all(after[key][2] >= before[key][2] for key in before if key in after)

    pid_a, pid_b = 101, 202  # made-up threads: the arithmetic
    before = {(pid_a, 1): (0, 1_000_000, 10), (pid_b, 2): (0, 0, 0)}
    after = {(pid_a, 1): (0, 5_000_000, 12), (pid_a, 3): (0, 2_000_000, 2), (pid_b, 2): (0, 0, 0),
             (303, 4): (0, 1_000_000_000, 100)}
    assert run_queue_wait(before, after, {pid_a: "ws", pid_b: "web0"}, window=2.0) == {
        "ws": {"ms_per_wakeup": 1.5, "waited_s_per_s": 0.003},  # (4 + 2) ms over 2 + 2 wake-ups
        "web0": {"ms_per_wakeup": None, "waited_s_per_s": 0.0},  # never woken in the window
        "postgres": {"ms_per_wakeup": 10.0, "waited_s_per_s": 0.5},  # a pid of no role: a database backend
    }


def test_a_sweeps_longest_pause_is_read_from_the_times_it_succeeded(tmp_path, settings):
    import json

    from bench._fleet_measure import DETECTING_SWEEPS, sweep_gaps

    assert set(DETECTING_SWEEPS) <= set(settings.SWEEP_TASKS)

    def line(at: str, task: str, message: str) -> str:  # the control plane's JSON log lines
        return json.dumps({"time": f"2026-12-07T22:00:{at}+00:00", "level": "info", "logger": "celery.app.trace",
                           "message": message, "task": task}) + "\n"

    log, sweeper = tmp_path / "worker.log", tmp_path / "sweeper.log"
    log.write_text(line("00.000", "nodes.tasks.expire_heartbeats", "Task x[1] succeeded in 0.01s: None")
                   + "worker: Warm shutdown (MainProcess)\n"  # not JSON: skipped
                   + line("02.500", "nodes.tasks.expire_heartbeats", "Discarding revoked task: x[3]")
                   + line("09.000", "nodes.tasks.expire_heartbeats", "Task x[4] succeeded in 0.02s: None")
                   + line("10.000", "jobs.tasks.handle_exit", "Task y[5] succeeded in 0.5s: None"))
    sweeper.write_text(line("01.000", "nodes.tasks.expire_heartbeats", "Task x[2] succeeded in 0.01s: None"))
    assert sweep_gaps({log: 0})["nodes.tasks.expire_heartbeats"]["max_gap_s"] == 9.0  # the worker's alone
    gaps = sweep_gaps({log: 0, sweeper: 0})  # whichever worker ran it
    assert gaps["nodes.tasks.expire_heartbeats"] == {"runs": 3, "max_gap_s": 8.0,
                                                     "max_gap_ended": "2026-12-07T22:00:09+00:00"}
    # Never ran: the whole span of the log is its pause.
    assert gaps["jobs.tasks.expire_progress"] == {"runs": 0, "max_gap_s": 10.0,
                                                  "max_gap_ended": "2026-12-07T22:00:10+00:00"}


def test_a_thread_id_is_not_read_as_a_process():
    """``/proc/<tid>`` answers for a thread with its whole process's figures: a backend's pid that came
    back as a web process's thread counted that process's CPU from 0 (12.5 cores on a 2-core machine)."""
    import os
    import threading

    from bench._fleet_measure import cpu_seconds, schedstat

    done = threading.Event()
    thread = threading.Thread(target=done.wait, args=(5,))
    thread.start()
    try:
        assert os.path.exists(f"/proc/{thread.native_id}/stat")  # what made the mistake possible
        assert cpu_seconds([thread.native_id]) == {} and schedstat([thread.native_id]) == {}
        assert list(cpu_seconds([os.getpid(), thread.native_id])) == [os.getpid()]
    finally:
        done.set()
        thread.join()
