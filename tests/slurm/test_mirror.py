"""Node state mirroring against a real slurmctld: drains travel both ways, once, without ping-pong."""

from __future__ import annotations

import pytest

from tests.slurm.slurmcluster import NODE
from tests.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def mirror():
    from nodes.transports.slurm.mirror import mirror_nodes

    return mirror_nodes()


def node():
    from nodes.models import Node

    return Node.objects.get(hostname=NODE)


def test_slurm_nodes_appear_in_nightwatch_healthy_and_schedulable(slurm, db):
    from nodes.models import SlurmController

    assert mirror() >= 1
    row = node()
    assert (row.transport, row.health, row.schedulability, row.address) == ("slurm", "healthy", "active", "127.0.0.1")
    assert row.slurm.slurm_state == "idle" and row.slurm.agreed_drained is False
    assert SlurmController.objects.get().reachable
    assert mirror() == 0, "a second pass with nothing new changes nothing"


def test_a_drain_made_in_nightwatch_shows_in_sinfo_with_its_reason_and_an_undrain_resumes(slurm, db):
    from jobs.models import Event
    from nodes.services import drain_node, undrain_node

    mirror()
    assert drain_node(node(), actor="user:otto", reason="ECC errors on GPU 3")
    assert mirror() == 1
    state, reason = slurm.node_line()
    assert state == "drained" and reason == "nightwatch: ECC errors on GPU 3"
    for _ in range(2):  # Slurm now agrees; neither side is changed back
        assert mirror() == 0
    assert node().schedulability == "drained" and node().drain_reason == "ECC errors on GPU 3"
    assert Event.objects.filter(kind="node.drain", node=node()).count() == 1

    assert undrain_node(node(), actor="user:otto", reason="GPU replaced")
    assert mirror() >= 1
    wait_for(lambda: slurm.node_line()[0] == "idle", timeout=20, what="Slurm to resume the node")
    mirror()  # a resumed node may have shown "idle*" (not responding) for a moment
    assert mirror() == 0 and node().schedulability == "active" and node().health == "healthy"


def test_a_node_drained_with_scontrol_shows_as_drained_in_nightwatch_with_slurms_reason(slurm, db):
    from jobs.models import Event

    mirror()
    slurm.command("scontrol", "update", f"nodename={NODE}", "state=drain", "reason=bad DIMM in slot 4")
    assert mirror() == 1
    row = node()
    assert row.schedulability == "drained" and row.drain_reason == "Slurm: bad DIMM in slot 4"
    drain = Event.objects.get(kind="node.drain", node=row)
    assert drain.actor == "slurm:root" and "bad DIMM in slot 4" in drain.reason
    assert mirror() == 0
    assert slurm.node_line() == ("drained", "bad DIMM in slot 4"), "Nightwatch did not rewrite Slurm's reason"

    slurm.command("scontrol", "update", f"nodename={NODE}", "state=resume")
    assert mirror() >= 1  # the undrain (and perhaps a moment of "idle*")
    assert node().schedulability == "active"
    wait_for(lambda: slurm.node_line()[0] == "idle", timeout=20, what="Slurm to resume the node")
    mirror()
    assert mirror() == 0 and node().schedulability == "active" and slurm.node_line()[0] == "idle"
