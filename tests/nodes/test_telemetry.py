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
from nodes.models import GPU, GpuSample, Node, NodeCommand
from nodes.services import ingest
from tests.nodes.conftest import batch_of, sample


@pytest.mark.django_db
def test_a_batch_is_stored_once_and_a_replay_is_counted_as_duplicates(cast, post):
    body = batch_of(cast.node1, gpus=4, per_gpu=5)
    first = post("telemetry", body)
    assert first.status_code == 202, first.content
    assert first.json() == {"accepted": 20, "duplicates": 0}
    again = post("telemetry", body)
    assert again.json() == {"accepted": 0, "duplicates": 20}
    assert GpuSample.objects.filter(node=cast.node1).count() == 20
    row = GpuSample.objects.filter(node=cast.node1, gpu=3).order_by("time").last()
    assert (row.temperature_c, row.memory_free, row.recent_xid_codes, row.reachable) == (55.0, 78 * 2**30, [], True)
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
    assert GpuSample.objects.filter(node=cast.node1, gpu=0).count() == 3


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


def test_every_wire_field_of_a_sample_has_a_column():
    wire = {f.name for f in dataclasses.fields(WireSample)} - {"node"}
    columns = {f.name for f in GpuSample._meta.get_fields()}
    assert wire <= columns, f"add columns (and a migration) for {sorted(wire - columns)}"


@pytest.mark.django_db
def test_the_portable_insert_stores_exactly_what_the_postgresql_one_does(cast):
    """SQLite (embedded mode) takes the bulk_create path: same rows, same duplicate count."""
    # Many fractional times: a rounding difference between the paths would show in the key.
    body = batch_of(cast.node1, gpus=2, per_gpu=300, start=time.time() + 0.1234567, recent_xid_codes=[13, 31],
                    xid_recent=2)
    body["samples"] = [{**s, "time": s["time"] + i * 0.0000013} for i, s in enumerate(body["samples"])]
    samples = parse(TelemetryBatch, body).samples
    columns = {name: [getattr(s, name) for s in samples] for name in ingest.SAMPLE_FIELDS}
    fast = ingest._insert_unnest(cast.node1, columns) if ingest.connection.vendor == "postgresql" else None
    rows = list(GpuSample.objects.filter(node=cast.node1).order_by("gpu", "time").values())
    GpuSample.objects.filter(node=cast.node1).delete()
    assert ingest._insert_orm(cast.node1, samples) == 600
    assert ingest._insert_orm(cast.node1, samples) == 0
    if fast is not None:
        assert fast == 600
        assert list(GpuSample.objects.filter(node=cast.node1).order_by("gpu", "time").values()) == rows


@pytest.mark.django_db
def test_old_samples_are_pruned_per_gpu_and_recent_ones_kept(cast, post, settings):
    from nodes import tasks

    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "TELEMETRY_RETENTION_DAYS": 7}
    now = time.time()
    post("telemetry", {"samples": [sample(cast.node1, gpu, at) for gpu in (0, 1)
                                   for at in (now - 8 * 86400, now - 6 * 86400, now)]})
    assert tasks.prune_telemetry() == 2
    assert sorted(GpuSample.objects.values_list("gpu", flat=True)) == [0, 0, 1, 1]
    assert tasks.prune_telemetry() == 0


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
