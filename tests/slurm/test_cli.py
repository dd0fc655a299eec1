"""The Slurm adapter: parsed answers from a real controller, and errors that say what went wrong."""

from __future__ import annotations

import pytest

from nodes.transports.slurm.cli import Slurm, SlurmRefused, SlurmUnavailable
from tests.slurm.slurmcluster import NODE, PARTITION

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def test_nodes_are_parsed_from_sinfo_json(slurm):
    [node] = Slurm().nodes(PARTITION)
    assert (node.name, node.address, node.partitions) == (NODE, "127.0.0.1", (PARTITION,))
    assert not node.drained and not node.unreachable
    assert Slurm().nodes("no-such-partition") == []


def test_a_refusal_is_told_apart_from_an_outage(slurm):
    with pytest.raises(SlurmRefused, match=r"scontrol failed \(exit 1\): Invalid input: state=bogus"):
        Slurm().run("scontrol", ["update", f"nodename={NODE}", "state=bogus"])
    with pytest.raises(SlurmRefused, match="sbatch failed"):
        Slurm().submit("#!/bin/bash\ntrue\n", ["--partition=no-such-partition"], env={})


def test_missing_commands_and_timeouts_are_outages():
    with pytest.raises(SlurmUnavailable, match="not installed"):
        Slurm(bin_dir="/nonexistent").nodes()
    with pytest.raises(ValueError, match="not a single Slurm node name"):
        Slurm().drain("a,b", "two nodes at once")
