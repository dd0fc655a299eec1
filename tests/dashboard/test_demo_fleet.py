"""``make demo --fleet N``: simulated nodes to look at, which never take the demo's job."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from dashboard import demo_fleet

pytestmark = pytest.mark.django_db


def test_a_simulated_fleet_is_racks_of_spares_with_some_degraded_and_one_lemon(signed_in, cast):
    from nodes.models import GPU, Node, NodeGpuSample

    nodes = demo_fleet.seed(40)
    assert demo_fleet.seed(40) == nodes  # a second demo reuses them
    simulated = Node.objects.filter(labels__simulated="demo")
    assert simulated.count() == 40 and GPU.objects.filter(node__in=simulated).count() == 320
    assert all(n.is_spare and n.heartbeat_deadline is None and "no agent" in n.health_reason for n in simulated)
    assert simulated.filter(health="degraded").count() == 6
    (lemon,) = simulated.filter(lemon_count__gt=0)
    assert lemon.schedulability == "drained"
    assert sorted(set(simulated.values_list("labels__rack", flat=True))) == ["r00", "r01", "r02"]

    now = timezone.now()
    demo_fleet.tick(nodes, now)
    demo_fleet.tick(nodes, now + timedelta(seconds=10))
    assert NodeGpuSample.objects.filter(node__in=simulated).count() == 80
    hot = GPU.objects.get(node=simulated.filter(health="degraded").first(), index=3).last_sample["temperature_c"]
    assert hot >= 78
    body = signed_in(cast.viewer).get(f"/nodes/{nodes[0].pk}/").content.decode()
    assert '"gpus": 8' in body and "no agent" in body


def test_the_demo_job_is_placed_on_the_real_node_not_a_simulated_one(cast):
    from jobs import services
    from jobs.models import Generation
    from nodes.models import Node

    demo_fleet.seed(16)
    Node.objects.exclude(labels__simulated="demo").exclude(pk=cast.node1.pk).update(health="unreachable")
    Node.objects.filter(pk=cast.node1.pk).update(hostname="zz-real")  # last by name: only "spares last" keeps it first
    job = services.launch_job({"name": "demo-like", "entrypoint": "examples/train.py", "nnodes": 1,
                               "nproc_per_node": 2, "accelerator": "cpu"}, actor="system:demo")
    services.start_job(job, actor="system:demo")
    assert list(Generation.objects.get(job=job, number=1).nodes.all()) == [cast.node1]
