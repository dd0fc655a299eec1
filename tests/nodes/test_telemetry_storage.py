"""Telemetry storage: hourly partitions made ahead, retention by the partition, minute rollups.

Partition tests need PostgreSQL and skip elsewhere; the rollup and retention behaviour is the
same on SQLite (the embedded demo), where retention deletes rows in bulk.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from jobs import efficiency
from nodes import tasks
from nodes.models import NodeGpuMinute, NodeGpuSample
from nodes.services import partitions, retention, rollup
from tests.nodes.conftest import sample

NOW = datetime(2026, 6, 15, 13, 37, 30, tzinfo=UTC)
postgresql_only = pytest.mark.skipif(connection.vendor != "postgresql", reason="partitions are PostgreSQL's")


def at(minutes: float) -> float:
    """Epoch seconds ``minutes`` after NOW (negative: before)."""
    return (NOW + timedelta(minutes=minutes)).timestamp()


def raw_partitions() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                       "WHERE i.inhparent = 'nodes_nodegpusample'::regclass ORDER BY 1")
        return [name for (name,) in cursor.fetchall()]


def prune() -> bool:
    """The hourly task, as in its own transaction: the test's inserts still have their deferred
    foreign-key checks pending, and PostgreSQL drops no table with pending trigger events."""
    if partitions.partitioned():
        with connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    return tasks.prune_telemetry()


def partition_of(node, when: float) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableoid::regclass::text FROM nodes_nodegpusample WHERE node_id = %s AND time = %s",
                       [node.pk, datetime.fromtimestamp(when, UTC)])
        return cursor.fetchone()[0]


@pytest.fixture
def frozen(time_machine):
    time_machine.move_to(NOW, tick=False)


@postgresql_only
@pytest.mark.django_db
def test_partitions_are_made_from_the_retention_cutoff_to_six_hours_ahead_once(frozen):
    assert retention.prepare_partitions() == (48 + 1 + 6) + (90 + 1 + 2)
    names = raw_partitions()
    assert "nodes_nodegpusample_default" in names
    assert {"nodes_nodegpusample_p2026061313", "nodes_nodegpusample_p2026061513",
            "nodes_nodegpusample_p2026061519"} <= set(names)
    assert "nodes_nodegpusample_p2026061520" not in names
    assert retention.prepare_partitions() == 0  # already there


@postgresql_only
@pytest.mark.django_db
def test_a_sample_without_a_partition_lands_in_the_default_one_and_moves_when_its_hour_is_made(cast, post, frozen):
    retention.prepare_partitions()
    ahead = at(24 * 60)  # a clock a day fast: past the partitions made ahead
    assert post("telemetry", {"samples": [sample(cast.node1, 0, ahead)]}).json() == {"accepted": 1, "duplicates": 0}
    assert partition_of(cast.node1, ahead) == "nodes_nodegpusample_default"
    retention.prepare_partitions(now=NOW + timedelta(days=1))
    assert partition_of(cast.node1, ahead) == "nodes_nodegpusample_p2026061613"


@pytest.mark.django_db
def test_a_sample_older_than_the_raw_retention_is_accepted_but_not_stored(cast, post, frozen):
    body = {"samples": [sample(cast.node1, 0, at(-49 * 60)), sample(cast.node1, 0, at(-47 * 60))]}
    assert post("telemetry", body).json() == {"accepted": 2, "duplicates": 0}
    assert [row.time for row in NodeGpuSample.objects.all()] == [NOW - timedelta(hours=47)]


@postgresql_only
@pytest.mark.django_db
def test_retention_drops_whole_partitions_and_deletes_no_row(cast, post, frozen, settings):
    retention.prepare_partitions(now=NOW - timedelta(hours=3))
    post("telemetry", {"samples": [sample(cast.node1, gpu, at(minutes)) for gpu in (0, 1)
                                   for minutes in (-150, -90, -30, 0)]})
    before = raw_partitions()
    assert "nodes_nodegpusample_p2026061511" in before
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "TELEMETRY_RAW_RETENTION_HOURS": 1}
    deleted_before = rows_deleted()
    assert prune() is True
    # Retention's own: making a partition moves the default partition's rows of its hour (a DELETE
    # there), and a row committed by an earlier test of the suite was once moved so (CI, 2026-12-04).
    assert rows_deleted() == deleted_before
    assert len(before) - len(raw_partitions()) == 14 + 24 + 12  # 06-13 10:00 to 06-15 11:00
    # Every hour wholly older than 12:37:30 went; the 12:00 one holds the cutoff and stays.
    assert min(name for name in raw_partitions() if not name.endswith("default")) == "nodes_nodegpusample_p2026061512"
    kept = sorted(row.time for row in NodeGpuSample.objects.all())
    assert kept == [NOW + timedelta(minutes=m) for m in (-90, -30, 0)]
    assert prune() is False


def rows_deleted() -> int:
    """Rows deleted from the raw samples' tables in this transaction so far (a dropped partition's
    count leaves with it: dropping deletes no row)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(sum(n_tup_del), 0) FROM pg_stat_xact_user_tables "
                       "WHERE relname LIKE 'nodes_nodegpusample%%'")
        return int(cursor.fetchone()[0])


@pytest.mark.django_db
def test_retention_also_removes_old_rollups(cast, frozen):
    for days in (91, 89):
        NodeGpuMinute.objects.create(node=cast.node1, minute=NOW.replace(second=0) - timedelta(days=days), gpus=1,
                                     samples=[6])
    retention.prepare_partitions(now=NOW - timedelta(days=92))
    prune()
    assert [m.minute.date() for m in NodeGpuMinute.objects.all()] == [(NOW - timedelta(days=89)).date()]


def known_minute(cast, post) -> None:
    """Six samples of GPUs 0 and 1 in the minute 13:35, GPU 1 only in the second half; one in 13:36."""
    samples = [sample(cast.node1, 0, at(-2.5) + 10 * i, temperature_c=50.0 + i, utilization_pct=10.0 * i,
                      power_w=300.0, memory_used=i * 2**30, xid_total=1 if i == 5 else 0) for i in range(6)]
    samples += [sample(cast.node1, 1, at(-2.5) + 10 * i, temperature_c=70.0, utilization_pct=100.0) for i in (3, 4, 5)]
    samples.append(sample(cast.node1, 0, at(-1.5), temperature_c=90.0))
    post("telemetry", {"samples": samples})


def rollups() -> list[dict]:
    return list(NodeGpuMinute.objects.order_by("node", "minute").values())


@pytest.mark.django_db
def test_a_minute_rolls_up_to_min_mean_max_per_gpu_and_again_to_the_same_rows(cast, post, frozen):
    known_minute(cast, post)
    assert tasks.roll_up_telemetry() == 2
    first, second = rollups()
    assert (first["minute"], first["gpus"], first["samples"]) == (datetime(2026, 6, 15, 13, 35, tzinfo=UTC), 0b11,
                                                                  [6, 3])
    assert (first["temperature_min"], first["temperature_mean"], first["temperature_max"]) == ([50, 70], [52.5, 70],
                                                                                               [55, 70])
    assert (first["utilization_min"], first["utilization_mean"], first["utilization_max"]) == ([0, 100], [25, 100],
                                                                                               [50, 100])
    assert (first["memory_used_mib_min"][0], first["memory_used_mib_max"][0], first["power_mean"][0]) == (0, 5120, 300)
    assert (first["xid_errors"], first["ecc_uncorrected_errors"]) == ([1, 0], None)  # GPU 1: 0 beside GPU 0's 1
    assert (second["gpus"], second["samples"], second["temperature_max"], second["xid_errors"]) == (1, [1], [90], None)
    assert tasks.roll_up_telemetry() == 0  # the same rows: nothing rewritten (no dead row versions)
    assert rollups() == [first, second]


@pytest.mark.django_db
def test_a_gpu_silent_for_a_minute_keeps_its_place_in_the_rollup(cast, post, frozen):
    post("telemetry", {"samples": [sample(cast.node1, gpu, at(-2.5), temperature_c=40.0 + gpu) for gpu in (0, 2)]})
    rollup.roll_up_recent()
    minute = NodeGpuMinute.objects.get()
    assert (minute.gpus, minute.samples, minute.temperature_max) == (0b101, [1, None, 1], [40, None, 42])


@pytest.mark.django_db
def test_error_counts_are_stored_as_their_rise_since_the_sample_before(cast, post, frozen):
    """Counted from the GPU's latest reading across batches; a count that fell was reset; a GPU's
    first sample, and a replay older than the latest reading, rise by 0."""
    for minutes, xids in ((-4, 3), (-3, 5), (-2, 1), (-3.5, 9)):
        post("telemetry", {"samples": [sample(cast.node1, 0, at(minutes), xid_total=xids)]})
    rises = {row.time: row.xid_errors for row in NodeGpuSample.objects.all()}
    assert [rises[NOW + timedelta(minutes=m)] for m in (-4, -3.5, -3, -2)] == [None, None, [2], [1]]


@postgresql_only
@pytest.mark.django_db
def test_the_portable_rollup_writes_what_the_postgresql_one_does(cast, post, frozen):
    known_minute(cast, post)
    rollup._roll_up_sql(NOW - timedelta(hours=1), NOW, None)
    sql = rollups()
    NodeGpuMinute.objects.all().delete()
    rollup._roll_up_portable(NOW - timedelta(hours=1), NOW, None)
    assert rollups() == sql


@pytest.mark.django_db
def test_a_batch_later_than_the_lookback_rolls_up_its_own_minutes(cast, post, frozen):
    post("telemetry", {"samples": [sample(cast.node1, 0, at(-60) + 10 * i, utilization_pct=40.0) for i in range(3)]})
    minute = NodeGpuMinute.objects.get(node=cast.node1)
    assert (minute.minute, minute.samples, minute.utilization_mean) == (NOW.replace(second=0) - timedelta(hours=1),
                                                                        [3], [40.0])


@pytest.mark.django_db
def test_utilisation_reads_raw_samples_within_their_retention_and_rollups_beyond(cast, post, frozen, settings):
    post("telemetry", {"samples": [sample(cast.node1, gpu, at(-1), utilization_pct=pct)
                                   for gpu, pct in ((0, 20.0), (1, 40.0))]})
    since = NOW - timedelta(minutes=5)
    assert rollup.mean_utilization([cast.node1.pk], since, raw_since=since - timedelta(hours=1)) == 30.0
    for days, samples, means in ((3, [3, 1], [90, 50]), (2, [1], [10])):
        NodeGpuMinute.objects.create(node=cast.node1, minute=NOW - timedelta(days=days), gpus=2 ** len(samples) - 1,
                                     samples=samples, utilization_mean=means)
    four_days = rollup.mean_utilization([cast.node1.pk], NOW - timedelta(days=4), raw_since=NOW - timedelta(hours=48))
    assert four_days == (90 * 3 + 50 + 10) / 5
    settings.NIGHTWATCH = {**settings.NIGHTWATCH,
                           "EFFICIENCY": {**settings.NIGHTWATCH["EFFICIENCY"], "UTILIZATION_WINDOW_S": 300}}
    assert efficiency.gpu_utilization(None, [cast.node1.pk]) == 30.0


@pytest.mark.django_db
def test_sqlite_and_postgresql_keep_the_same_recent_rows_after_pruning(cast, post, frozen, settings):
    """The retention contract both databases share: everything newer than the cutoff stays."""
    retention.prepare_partitions(now=NOW - timedelta(hours=3))
    post("telemetry", {"samples": [sample(cast.node1, 0, at(minutes)) for minutes in (-200, -30)]})
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "TELEMETRY_RAW_RETENTION_HOURS": 2}
    prune()
    assert [row.time for row in NodeGpuSample.objects.all()] == [NOW - timedelta(minutes=30)]
    assert partitions.partitioned() == (connection.vendor == "postgresql")
