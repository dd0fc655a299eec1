"""Which queue each task goes to, read from the Celery app's own router, and that every way the
system runs has a worker on each queue (default, ``sweeps``, ``checkpoints``, ``background``).

Checkpoint verification once sat in front of ``jobs.tasks.handle_exit`` on the only queue, and a
crash was recorded as a hang (docs/benchmarks/chaos.md, finding 3): checkpoint-side tasks must go
to the ``checkpoints`` queue, failure handling must stay on the default one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from controlplane.celery import app

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINTS_QUEUE = "checkpoints"
BACKGROUND_QUEUE = "background"
SWEEPS_QUEUE = "sweeps"
#: what a failure, a missed heartbeat or a stuck recovery is handled by
FAILURE_HANDLING = ["jobs.tasks.handle_exit", "jobs.tasks.handle_node_health", "jobs.tasks.handle_flags",
                    "jobs.tasks.handle_launch_refused", "jobs.tasks.confirm_stopped", "jobs.tasks.advance_job"]
#: what finds a missed heartbeat, a missed progress deadline or a recovery left half-done
SWEEPS = ["jobs.tasks.expire_progress", "jobs.tasks.sweep", "nodes.tasks.expire_heartbeats"]


@pytest.fixture(scope="module")
def tasks() -> set[str]:
    app.loader.import_default_modules()  # what a worker does at start: autodiscover every app's tasks
    return {name for name in app.tasks if not name.startswith("celery.")}


def queue_of(task_name: str) -> str:
    return app.amqp.router.route({}, task_name)["queue"].name


def test_every_checkpoint_task_goes_to_the_checkpoints_queue(tasks):
    checkpoint_tasks = sorted(name for name in tasks if name.startswith("checkpoints.tasks."))
    assert "checkpoints.tasks.verify_checkpoint" in checkpoint_tasks
    assert "checkpoints.tasks.retention_sweep" in checkpoint_tasks
    assert {name: queue_of(name) for name in checkpoint_tasks} == dict.fromkeys(checkpoint_tasks, CHECKPOINTS_QUEUE)


def test_failure_handling_stays_on_the_default_queue(tasks):
    default = app.conf.task_default_queue
    assert default != CHECKPOINTS_QUEUE
    assert set(FAILURE_HANDLING) <= tasks, sorted(set(FAILURE_HANDLING) - tasks)
    assert {name: queue_of(name) for name in FAILURE_HANDLING} == dict.fromkeys(FAILURE_HANDLING, default)
    # Nothing but checkpoint-side work, the background's judgement and upkeep, and the sweeps leaves it.
    elsewhere = sorted(name for name in tasks if queue_of(name) != default)
    assert all(name.startswith("checkpoints.tasks.") or queue_of(name) in (BACKGROUND_QUEUE, SWEEPS_QUEUE)
               for name in elsewhere), elsewhere


def test_the_sweeps_have_a_queue_of_their_own(tasks, settings):
    """Beat sends them every 0.25-2 s, to expire a few periods later: behind a backlog of exits, acks
    and recoveries on the default queue they expired unrun, and a dead node was marked 46 s past its
    deadline (bench.fleet run S). Only they go there, so none of them waits behind other work."""
    assert set(SWEEPS) <= tasks and set(settings.SWEEP_TASKS) == set(SWEEPS)
    assert {name for name in tasks if queue_of(name) == SWEEPS_QUEUE} == set(SWEEPS)
    scheduled = {entry["task"]: entry for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert all(scheduled[name]["options"]["expires"] for name in SWEEPS)  # why a backlog loses them


def test_judgement_and_upkeep_go_to_the_background_queue(tasks, settings):
    """The 512-node job's straggler check, the alerts sweep and the telemetry roll-up took seconds
    each at 1,024 nodes, and a rank's exit report waited behind them: they have a queue of their
    own. Every name routed there is a real task (a typo would leave it on the default queue)."""
    assert set(settings.BACKGROUND_TASKS) <= tasks, sorted(set(settings.BACKGROUND_TASKS) - tasks)
    for name in ("jobs.tasks.check_stragglers", "alerts.tasks.sweep", "nodes.tasks.roll_up_telemetry"):
        assert queue_of(name) == BACKGROUND_QUEUE
    assert not set(settings.BACKGROUND_TASKS) & set(FAILURE_HANDLING)
    # Alerts are delivered, and incidents and events judged, right away.
    for name in ("alerts.tasks.deliver", "alerts.tasks.evaluate_incident", "alerts.tasks.evaluate_event"):
        assert queue_of(name) == app.conf.task_default_queue


def test_a_delayed_verification_lands_in_the_checkpoints_queue_of_the_broker(settings):
    """The real publish path (``.delay`` to Redis), not only the router: the message is in the
    ``checkpoints`` list and not in the default one. The checkpoint id does not exist, so a worker
    that took the message anyway would return quietly."""
    import redis

    from checkpoints.tasks import verify_checkpoint

    if not settings.REDIS_URL:
        pytest.fail("this test reads the broker's queues: run it with REDIS_URL (as `make test` does)")
    client = redis.Redis.from_url(settings.REDIS_URL)

    def mine(queue: str) -> list[bytes]:
        return [raw for raw in client.lrange(queue, 0, -1) if json.loads(raw)["headers"]["id"] == sent.id]

    sent = verify_checkpoint.delay(10**9)
    try:
        assert len(mine(CHECKPOINTS_QUEUE)) == 1
        assert mine(app.conf.task_default_queue) == []
    finally:
        for queue in (CHECKPOINTS_QUEUE, app.conf.task_default_queue):
            for raw in mine(queue):
                client.lrem(queue, 1, raw)


def test_the_compose_file_runs_a_worker_on_each_queue():
    """One worker for failure handling (the default queue and the sweeps), one for the sweeps alone
    (they never wait behind a recovery's backlog), one for checkpoints, one for the background: none
    of them consumes another's queue, and every queue a task goes to has one."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    argvs = {name: " ".join(service["command"]).split("exec ", 1)[1].split() for name, service in services.items()
             if "celery -A controlplane worker" in " ".join(service.get("command") or [])}
    # Failure handling runs on the declared queues: a worker started as before the sweeps had a queue
    # (no -Q) still runs them.
    assert "-Q" not in argvs["worker"]
    consumed = {name: _queues(argv) for name, argv in argvs.items()}
    assert sorted(consumed.values()) == sorted([[BACKGROUND_QUEUE], [CHECKPOINTS_QUEUE], [SWEEPS_QUEUE],
                                                [app.conf.task_default_queue, SWEEPS_QUEUE]]), consumed
    assert consumed["sweeper"] == [SWEEPS_QUEUE]
    routed = {route["queue"] for route in app.conf.task_routes.values()}
    assert routed | {app.conf.task_default_queue} == {q for queues in consumed.values() for q in queues}


def test_the_demo_consumes_every_queue():
    """The embedded demo runs its own workers (dashboard/management/commands/demo.py): each queue
    a task can be routed to has one, or that queue's tasks would wait there forever."""
    from dashboard.management.commands import demo

    consumed = {queue for argv in demo.WORKERS.values() for queue in _queues(argv)}
    routed = {route["queue"] for route in app.conf.task_routes.values()}
    assert {app.conf.task_default_queue, *routed} <= consumed, (consumed, routed)
    assert _queues(demo.WORKERS["worker"]) == [app.conf.task_default_queue, SWEEPS_QUEUE]  # failure handling


def _queues(argv: list[str]) -> list[str]:
    """The queues a ``celery worker`` command line consumes (the declared ones without ``-Q``)."""
    if "-Q" not in argv:
        return [queue.name for queue in app.conf.task_queues]
    return argv[argv.index("-Q") + 1].split(",")


def test_beat_sends_the_tasks_that_make_room_ahead_as_it_starts(tasks, settings):
    """Beat's first run of an interval task comes an interval after it starts: the partition makers
    run at its start too, or a fresh deployment's first hour of node windows lands in the default
    partition. The real signal and publish path: the messages are in the broker's background queue."""
    import redis
    from celery import signals

    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert set(settings.BEAT_AT_START) == {"nodes.tasks.prepare_telemetry_partitions",
                                           "jobs.tasks.maintain_node_windows"}
    assert set(settings.BEAT_AT_START) <= tasks & scheduled
    if not settings.REDIS_URL:
        pytest.fail("this test reads the broker's queues: run it with REDIS_URL (as `make test` does)")
    client = redis.Redis.from_url(settings.REDIS_URL)
    queue = BACKGROUND_QUEUE  # upkeep (settings.BACKGROUND_TASKS)
    before = set(client.lrange(queue, 0, -1))
    signals.beat_init.send(sender=None)
    sent = [raw for raw in client.lrange(queue, 0, -1) if raw not in before]
    try:
        assert sorted(json.loads(raw)["headers"]["task"] for raw in sent) == sorted(settings.BEAT_AT_START)
    finally:
        for raw in sent:
            client.lrem(queue, 1, raw)
