"""Telemetry ingest: bulk insert, deduplication, latest sample per GPU, health and the drain policy."""

from __future__ import annotations

import dataclasses
import time

import pytest
from django.test import TestCase

from agents.protocol import parse
from agents.protocol.agent import GpuSample as WireSample
from agents.protocol.agent import TelemetryBatch
from jobs.models import Event
from nodes import services, signals
from nodes.choices import CommandKind, Health, Schedulability
from nodes.models import GPU, Node, NodeCommand, NodeGpuSample
from nodes.services import ingest
from tests.nodes.conftest import batch_of, sample


def stored(node, gpu=None) -> list[tuple[int, float]]:
    """The (gpu, time) of every raw GPU sample of ``node`` (of one ``gpu``), in order."""
    return sorted((g, row.time.timestamp()) for row in NodeGpuSample.objects.filter(node=node)
                  for g in range(row.gpus.bit_length()) if row.gpus >> g & 1 and gpu in (None, g))


@pytest.mark.django_db
def test_a_batch_is_stored_once_and_a_replay_is_counted_as_duplicates(cast, post):
    body = batch_of(cast.node1, gpus=4, per_gpu=5)
    first = post("telemetry", body)
    assert first.status_code == 202, first.content
    assert first.json() == {"accepted": 20, "duplicates": 0}
    again = post("telemetry", body)
    assert again.json() == {"accepted": 0, "duplicates": 20}
    assert len(stored(cast.node1)) == 20
    assert NodeGpuSample.objects.filter(node=cast.node1).count() == 5  # a row per moment, a value per GPU
    row = NodeGpuSample.objects.filter(node=cast.node1).order_by("time").last()
    assert (row.gpus, row.temperature_c, row.memory_used_mib, row.xid_errors) == (0b1111, [55] * 4, [2048] * 4, None)
    assert abs(row.time.timestamp() - body["samples"][-1]["time"]) < 1e-5


@pytest.mark.django_db
def test_every_gpu_keeps_its_newest_sample_and_an_old_replay_does_not_turn_the_clock_back(cast, post):
    now = time.time()
    post("telemetry", {"samples": [sample(cast.node1, 0, now - 2, temperature_c=50.0),
                                   sample(cast.node1, 0, now, temperature_c=61.0),
                                   sample(cast.node1, 1, now - 1, temperature_c=70.0)]})
    gpus = {g.index: g for g in GPU.objects.filter(node=cast.node1)}
    assert (gpus[0].last_sample["temperature_c"], gpus[1].last_sample["temperature_c"]) == (61.0, 70.0)
    assert gpus[0].health == gpus[1].health == Health.HEALTHY
    post("telemetry", {"samples": [sample(cast.node1, 0, now - 60, temperature_c=40.0)]})  # spooled, replayed late
    assert GPU.objects.get(node=cast.node1, index=0).last_sample["temperature_c"] == 61.0
    assert len(stored(cast.node1, gpu=0)) == 3


@pytest.mark.django_db
def test_an_unknown_node_becomes_healthy_on_good_telemetry(cast, post):
    Node.objects.filter(pk=cast.node1.pk).update(health=Health.UNKNOWN)
    post("telemetry", batch_of(cast.node1, gpus=2, per_gpu=1))
    event = Event.objects.get(kind="node.health", node=cast.node1)
    assert (event.old_state, event.new_state, event.reason) == ("unknown", "healthy", "every GPU within limits")


@pytest.mark.django_db
def test_a_critical_xid_makes_the_node_unhealthy_and_the_policy_drains_it(cast, post):
    seen = []
    signals.node_health_changed.connect(lambda **kw: seen.append(kw), weak=False, dispatch_uid="t")
    try:
        with TestCase.captureOnCommitCallbacks(execute=True):
            post("telemetry", {"samples": [sample(cast.node1, 0), sample(cast.node1, 1, xid_total=1, xid_recent=1,
                                                                             recent_xid_codes=[79])]})
    finally:
        signals.node_health_changed.disconnect(dispatch_uid="t")
    node = Node.objects.get(pk=cast.node1.pk)
    assert node.health == Health.UNHEALTHY
    assert node.schedulability == Schedulability.DRAINED  # nothing runs on it
    assert "GPU 1: critical Xid 79" in node.drain_reason
    health = Event.objects.get(kind="node.health", node=node)
    assert health.evidence["gpus"] == {"0": "healthy", "1": "unhealthy"}
    drain = Event.objects.get(kind="node.drain", node=node)
    assert (drain.actor, drain.old_state, drain.new_state) == ("system:drain-policy", "active", "drained")
    assert NodeCommand.objects.get(node=node).kind == CommandKind.DRAIN
    assert GPU.objects.get(node=node, index=1).health == Health.UNHEALTHY
    assert [(kw["old"], kw["new"]) for kw in seen] == [("healthy", "unhealthy")]
    assert seen[0]["reasons"] == ["GPU 1: critical Xid 79 in the last 600 s"]


@pytest.mark.django_db
def test_with_the_policy_off_an_unhealthy_node_stays_schedulable_for_an_operator_to_decide(cast, post, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "AUTO_DRAIN_UNHEALTHY": False}
    post("telemetry", {"samples": [sample(cast.node1, 0, temperature_c=95.0)]})
    node = Node.objects.get(pk=cast.node1.pk)
    assert (node.health, node.schedulability) == (Health.UNHEALTHY, Schedulability.ACTIVE)


@pytest.mark.django_db
def test_health_follows_the_window_back_to_healthy_but_the_drain_stays(cast, post):
    now = time.time()
    post("telemetry", {"samples": [sample(cast.node1, 0, now - 10, ecc_uncorrected_recent=2)]})
    assert Node.objects.get(pk=cast.node1.pk).health == Health.UNHEALTHY
    post("telemetry", {"samples": [sample(cast.node1, 0, now, temperature_c=84.0)]})
    node = Node.objects.get(pk=cast.node1.pk)
    assert (node.health, node.schedulability) == (Health.DEGRADED, Schedulability.DRAINED)
    assert [e.new_state for e in Event.objects.filter(kind="node.health", node=node)] == ["unhealthy", "degraded"]


@pytest.mark.django_db
def test_thresholds_come_from_settings(cast, post, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "HEALTH": {"max_temperature_c": 95, "warn_temperature_c": 93}}
    post("telemetry", {"samples": [sample(cast.node1, 0, temperature_c=90.0)]})
    assert Node.objects.get(pk=cast.node1.pk).health == Health.HEALTHY


@pytest.mark.django_db
def test_free_memory_counts_while_the_agent_runs_nothing(cast, post):
    held = {"memory_used": 70 * 2**30, "memory_free": 10 * 2**30 - 1}
    Node.objects.filter(pk=cast.node1.pk).update(running=[{"job": "1", "generation": 1}])
    cast.node1.refresh_from_db()
    post("telemetry", {"samples": [sample(cast.node1, 0, **held)]})
    assert Node.objects.get(pk=cast.node1.pk).health == Health.HEALTHY  # our own job holds the memory
    Node.objects.filter(pk=cast.node1.pk).update(running=[])
    post("telemetry", {"samples": [sample(cast.node1, 0, time.time() + 1, **held)]})
    assert Node.objects.get(pk=cast.node1.pk).health == Health.DEGRADED


@pytest.mark.django_db
def test_telemetry_does_not_revive_an_unreachable_node(cast, post):
    services.set_health(cast.node1, Health.UNREACHABLE, reason="test")
    post("telemetry", {"samples": [sample(cast.node1, 0)]})
    assert Node.objects.get(pk=cast.node1.pk).health == Health.UNREACHABLE


@pytest.mark.django_db
def test_ingest_takes_a_small_constant_number_of_queries(cast, post, django_assert_max_num_queries):
    post("telemetry", batch_of(cast.node1, gpus=8, per_gpu=1))  # GPUs exist; the node is judged healthy
    start = time.time()
    # auth (token, last-use stamp), lock GPUs, insert, update GPUs; savepoints count in tests
    with django_assert_max_num_queries(7):
        response = post("telemetry", batch_of(cast.node1, gpus=8, per_gpu=32, start=start))
    assert response.json()["accepted"] == 256
    with django_assert_max_num_queries(7):
        response = post("telemetry", batch_of(cast.node1, gpus=8, per_gpu=128, start=start + 100))
    assert response.json()["accepted"] == 1024


def test_every_raw_column_is_made_of_wire_fields_and_stored():
    wire = {f.name for f in dataclasses.fields(WireSample)}
    assert {name for column in ingest.RAW_COLUMNS.values() for name in column.fields} <= wire
    per_gpu = {f.name for f in NodeGpuSample._meta.get_fields() if f.__class__.__name__ == "PerGpuField"}
    assert per_gpu == set(ingest.RAW_COLUMNS)


@pytest.mark.django_db
def test_the_portable_insert_stores_exactly_what_the_postgresql_one_does(cast):
    """SQLite (embedded mode) takes the ORM path: same rows, same duplicate count, same merges."""
    # Many fractional times: a rounding difference between the paths would show in the key.
    body = batch_of(cast.node1, gpus=3, per_gpu=300, start=time.time() + 0.1234567, memory_used=5 * 2**30 + 123)
    # Error counts rise by 1 (Xids) and 2 (NVLink) a sample: every row but the first holds the rises.
    body["samples"] = [{**s, "time": s["time"] + (i // 3) * 0.0000013, "xid_total": i // 3,
                        "nvlink_replay_errors": 2 * (i // 3)} for i, s in enumerate(body["samples"])]
    samples = parse(TelemetryBatch, body).samples
    first, rest = ([s for s in samples if s.gpu != 2], [s for s in samples if s.gpu == 2])  # a split batch

    def store(upsert) -> list[dict]:
        batches = [ingest.raw_rows(part, since=ingest._utc(0), before={})[0] for part in (first, rest, samples)]
        assert [ingest.new_samples(rows, upsert(cast.node1, rows)) for rows in batches] == [600, 300, 0]
        return list(NodeGpuSample.objects.filter(node=cast.node1).order_by("time").values())

    portable = store(ingest._upsert_orm)
    first_row, second_row = portable[:2]
    assert (first_row["gpus"], first_row["xid_errors"], first_row["nvlink_errors"], first_row["memory_used_mib"]) == (
        0b111, None, None, [5120] * 3)
    assert (second_row["xid_errors"], second_row["nvlink_errors"]) == ([1] * 3, [2] * 3)
    if ingest.connection.vendor == "postgresql":
        NodeGpuSample.objects.filter(node=cast.node1).delete()
        assert store(ingest._upsert_unnest) == portable


@pytest.mark.django_db
def test_a_gpu_that_stops_reporting_while_the_others_go_on_makes_the_node_unhealthy(cast, post):
    from datetime import timedelta

    from django.utils import timezone

    now = time.time()
    Node.objects.filter(pk=cast.node1.pk).update(registered_at=timezone.now() - timedelta(hours=1))
    cast.node1.refresh_from_db()
    post("telemetry", {"samples": [sample(cast.node1, g, now - 400) for g in (0, 1)]})
    assert Node.objects.get(pk=cast.node1.pk).health == Health.HEALTHY
    post("telemetry", {"samples": [sample(cast.node1, 0, now)]})
    node = Node.objects.get(pk=cast.node1.pk)
    assert (node.health, node.health_reason) == (Health.UNHEALTHY, "GPU 1 has sent no sample for 400 s")
    assert GPU.objects.get(node=node, index=1).health == Health.UNHEALTHY


@pytest.mark.django_db
def test_a_registered_gpu_that_never_reports_makes_the_node_unhealthy(cast, post):
    from datetime import timedelta

    from django.utils import timezone

    Node.objects.filter(pk=cast.node1.pk).update(registered_at=timezone.now() - timedelta(hours=1))
    GPU.objects.create(node=cast.node1, index=7)
    cast.node1.refresh_from_db()
    post("telemetry", {"samples": [sample(cast.node1, 0)]})
    node = Node.objects.get(pk=cast.node1.pk)
    assert (node.health, node.health_reason) == (Health.UNHEALTHY,
                                                 "GPU 7 has sent no sample since the agent registered")


@pytest.mark.django_db
def test_a_batch_split_between_gpus_or_a_replay_does_not_look_silent(cast, post):
    from django.utils import timezone

    Node.objects.filter(pk=cast.node1.pk).update(registered_at=timezone.now())
    cast.node1.refresh_from_db()
    now = time.time()
    post("telemetry", {"samples": [sample(cast.node1, g, now - 3600) for g in (0, 1, 2)]})  # replay, an hour old
    post("telemetry", {"samples": [sample(cast.node1, 0, now - 3599)]})
    post("telemetry", {"samples": [sample(cast.node1, g, now - 3599) for g in (1, 2)]})
    assert Node.objects.get(pk=cast.node1.pk).health == Health.HEALTHY
    assert not Event.objects.filter(kind="node.health", node=cast.node1).exists()
