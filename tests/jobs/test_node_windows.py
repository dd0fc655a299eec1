"""Node windows (rank timings per node and window): hourly partitions on PostgreSQL, dropped whole
past their retention; a window already past it is not stored; without partitions, a bulk delete."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from jobs import ingest, windows
from jobs.models import NodeWindow
from nodes.services import partitions
from tests.dashboard.test_queries import _started

pytestmark = pytest.mark.django_db
NOW = datetime(2026, 6, 15, 13, 37, 30, tzinfo=UTC)


@pytest.fixture
def frozen(time_machine):
    time_machine.move_to(NOW, tick=False)


def window_partitions() -> list[str]:
    """The partitions of NOW's day (the migration also made one for the real "now")."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                       "WHERE i.inhparent = 'jobs_nodewindow'::regclass AND c.relname LIKE %s ORDER BY 1",
                       [f"jobs_nodewindow_p{NOW:%Y%m%d}%"])
        return [name for (name,) in cursor.fetchall()]


def report(job, hours_ago: list[float]) -> None:
    """Rank 0's windows, one per exchange ``hours_ago`` (each its own last step), through the ingest."""
    from agents.protocol import hooks as wire

    batch = wire.ReportBatch(job=str(job.pk), generation=job.generation, windows=[
        wire.NodeWindow(job=str(job.pk), generation=job.generation, node=0, first_step=10 * i + 1,
                        last_step=10 * i + 10, ranks=8, step_median_s=0.1, step_max_s=0.2, slowest_rank=3,
                        slowest_s=0.15, time=(NOW - timedelta(hours=h)).timestamp())
        for i, h in enumerate(hours_ago)])
    ingest.record_reports(job, batch, actor="node:gpu-01")


def maintain() -> windows.Maintained:
    """The hourly task, as in its own transaction: PostgreSQL drops no table with the test's
    deferred foreign-key checks still pending."""
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    return windows.maintain()


def test_partitions_are_made_ahead_and_dropped_whole_past_the_retention(cast, frozen, settings):
    assert connection.vendor == "postgresql"
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "NODE_WINDOW_RETENTION_HOURS": 3}
    job = _started(cast.job)
    done = maintain()
    # From the hour holding the cutoff (10:37:30) to six hours past now's.
    assert window_partitions()[0] == "jobs_nodewindow_p2026061510"
    assert window_partitions()[-1] == "jobs_nodewindow_p2026061519" and done.created >= 9
    report(job, [2.5, 1.5, 0.5, 0.0, 4.0])  # the last one is past the retention: not stored
    assert sorted(NodeWindow.objects.values_list("last_step", flat=True)) == [10, 20, 30, 40]

    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "NODE_WINDOW_RETENTION_HOURS": 1}
    deleted_before = rows_deleted()
    done = maintain()
    # Every hour wholly older than 12:37:30 went, rows and all, without a row deleted.
    assert done.dropped == 2 and window_partitions()[0] == "jobs_nodewindow_p2026061512"
    assert sorted(NodeWindow.objects.values_list("last_step", flat=True)) == [20, 30, 40]
    assert rows_deleted() == deleted_before


def rows_deleted() -> int:
    """Rows deleted from the windows' tables in this transaction, as PostgreSQL counts them (the count
    can start above 0: a test before this one in the same connection may have deleted some)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(sum(n_tup_del), 0) FROM pg_stat_xact_user_tables "
                       "WHERE relname LIKE 'jobs_nodewindow%%'")
        return int(cursor.fetchone()[0])


def test_a_replayed_window_is_stored_once(cast, frozen):
    job = _started(cast.job)
    report(job, [0.5, 0.0])
    report(job, [0.5, 0.0])
    assert NodeWindow.objects.count() == 2


def test_without_partitions_old_windows_are_deleted_in_one_query(cast, frozen, monkeypatch, settings,
                                                                 django_assert_max_num_queries):
    job = _started(cast.job)
    report(job, [40.0, 30.0, 0.5])
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "NODE_WINDOW_RETENTION_HOURS": 24}
    monkeypatch.setattr(partitions, "partitioned", lambda: False)  # as on SQLite
    with django_assert_max_num_queries(1):
        assert windows.maintain().deleted == 2
    assert list(NodeWindow.objects.values_list("last_step", flat=True)) == [30]


def test_the_skew_view_reads_the_newest_windows_of_a_long_job(cast, django_assert_max_num_queries):
    """A day of 10-step windows of 16 nodes: the view still reads four bounded queries."""
    from dashboard.queries import SKEW_WINDOWS, rank_skew

    job = _started(cast.job)
    now = time.time()
    NodeWindow.objects.bulk_create([
        NodeWindow(job=job, generation=job.generation, node=node, first_step=1, last_step=10, ranks=8,
                   step_median_s=0.1, step_max_s=0.2, slowest_rank=8 * node, slowest_s=0.1,
                   reported_at=datetime.fromtimestamp(now - 8640 + 1, UTC)) for node in range(16)])
    # The rest of the day's 138,240 rows in one statement: as many ORM inserts took a minute in CI.
    with connection.cursor() as cursor:
        cursor.execute("""
            INSERT INTO jobs_nodewindow (job_id, generation, node, first_step, last_step, ranks,
                step_median_s, step_max_s, slowest_rank, slowest_s, slowest_phases, phases, reported_at, received_at)
            SELECT job_id, generation, node, step - 9, step, ranks, step_median_s, step_max_s, slowest_rank,
                   slowest_s, slowest_phases, phases, reported_at + (step - 10) / 10 * interval '1 second', received_at
            FROM jobs_nodewindow, generate_series(20, 86400, 10) AS step
            WHERE job_id = %s""", [job.pk])
    assert NodeWindow.objects.filter(job=job).count() == 8640 * 16
    with django_assert_max_num_queries(4):
        skew = rank_skew(job)
    assert skew["steps"] == list(range(86_400 - 10 * (SKEW_WINDOWS - 1), 86_401, 10))


def test_phase_times_are_stored_as_a_real_array_and_read_back_as_written(cast, frozen):
    from agents.protocol import hooks as wire

    job = _started(cast.job)
    phases = {"input": 0.0123, "compute": 0.4123457, "optimizer": 0.1}  # no checkpoint phase reported
    batch = wire.ReportBatch(job=str(job.pk), generation=job.generation, windows=[
        wire.NodeWindow(job=str(job.pk), generation=job.generation, node=0, first_step=1, last_step=10, ranks=8,
                        step_median_s=0.52, step_max_s=0.6, slowest_rank=3, slowest_s=0.55, slowest_phases=phases,
                        phases=phases, time=NOW.timestamp())])
    ingest.record_reports(job, batch, actor="node:gpu-01")
    window = NodeWindow.objects.get()
    assert window.phases == window.slowest_phases == phases
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_typeof(phases)::text, phases::text FROM jobs_nodewindow")
        assert cursor.fetchone() == ("real[]", "{0.0123,0.4123457,0.1,NULL}")


def test_the_migration_turns_stored_json_phases_into_arrays_and_back(cast):
    from django.db.migrations.executor import MigrationExecutor

    def migrate(target) -> None:
        executor = MigrationExecutor(connection)
        executor.migrate(target or executor.loader.graph.leaf_nodes())

    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # no ALTER TABLE with deferred checks pending
    migrate([("jobs", "0011_training_logs")])
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO jobs_nodewindow (job_id, generation, node, first_step, last_step, ranks, step_median_s, "
                "step_max_s, slowest_rank, slowest_s, slowest_phases, phases, reported_at, received_at) VALUES "
                "(%s, 1, 0, 1, 10, 8, 0.5, 0.6, 3, 0.55, '{\"compute\": 0.5, \"input\": 0.01}', "
                "'{\"compute\": 0.45}', now(), now())", [cast.job.pk])
        migrate([("jobs", "0012_nodewindow_phase_arrays")])
        with connection.cursor() as cursor:
            cursor.execute("SELECT phases::text, slowest_phases::text FROM jobs_nodewindow")
            assert cursor.fetchone() == ("{NULL,0.45,NULL,NULL}", "{0.01,0.5,NULL,NULL}")
        assert NodeWindow.objects.get().slowest_phases == {"input": 0.01, "compute": 0.5}
        migrate([("jobs", "0011_training_logs")])
        with connection.cursor() as cursor:
            cursor.execute("SELECT phases, slowest_phases FROM jobs_nodewindow")
            restored = [json.loads(text) for text in cursor.fetchone()]
            assert restored == [{"compute": 0.45}, {"input": 0.01, "compute": 0.5}]
    finally:
        migrate(None)


@pytest.mark.django_db(transaction=True)
def test_a_step_is_committed_before_the_node_windows_sent_with_it_are_stored(cast):
    """Rank 0 sends a window per node (512 at 512 nodes) with the step of each exchange. The step is
    what the dashboard's relay and the progress sweep read, from other connections: it is committed
    first, and does not wait for the windows' insert (held here by a lock another connection takes)."""
    from agents.protocol import hooks as wire
    from jobs.models import StepMetric
    from tests.db import InThread, other_connection

    job = _started(cast.job)
    now = time.time()
    batch = wire.ReportBatch(job=str(job.pk), generation=job.generation, windows=[
        wire.NodeWindow(job=str(job.pk), generation=job.generation, node=node, first_step=1, last_step=10, ranks=8,
                        step_median_s=0.1, step_max_s=0.2, slowest_rank=8 * node, slowest_s=0.15, time=now)
        for node in range(4)], reports=[
        wire.StepReport(job=str(job.pk), generation=job.generation, rank=0, step=10, loss=2.0, grad_norm=1.0,
                        world_size=2, data_cursor=20, samples=1, phases={"compute": 0.1}, time=now)])
    locker = other_connection()
    ingesting = InThread(lambda: ingest.record_reports(job, batch, actor="node:gpu-01"))
    try:
        locker.execute("LOCK TABLE jobs_nodewindow IN EXCLUSIVE MODE")  # held until the rollback below
        ingesting.start()
        deadline = time.monotonic() + 10
        while not StepMetric.objects.filter(job=job, step=10).exists():
            assert not ingesting.outcome, f"the ingest ended first: {ingesting.outcome}"
            assert time.monotonic() < deadline, "the step waited for its windows' insert"
            time.sleep(0.02)
        assert ingesting.thread.is_alive() and not NodeWindow.objects.filter(job=job).exists()
    finally:
        locker.rollback()
        locker.close()
    assert ingesting.join(timeout=30).accepted == 1
    assert NodeWindow.objects.filter(job=job).count() == 4
