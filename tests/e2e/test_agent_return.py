"""An agent that dies with its ranks and is back within seconds (issue 24, item 8), end to end.

The node agent and the generation's torchrun and ranks are SIGKILLed together; with a 3 s
heartbeat timeout the node is declared unreachable (a partition: pause and escalate) before the
agent restarts 5 s after the kill. The restarted agent finds the generation gone and reports it;
that is a crash: the job is restarted from its checkpoint by the policy, with no on-call approval,
and the incident's fault time is the node's last sign of life, not the detection.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from tests.e2e.cluster import rank_pids, wait_for
from tests.e2e.test_recovery import job_row, launch, wait_for_verified

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_an_agent_back_within_seconds_after_dying_with_its_ranks_is_a_crash_not_a_partition(cluster, tokens,
                                                                                             tmp_path):
    from jobs.models import Incident
    from nodes.models import Node

    agent = cluster.start_agent("node-a", bootstrap_token=tokens["bootstrap"]())
    wait_for(lambda: Node.objects.filter(health="healthy").exists(), timeout=60, what="a healthy node")
    job_id = launch(cluster, tokens, tmp_path, extra_args=["--steps", "70"])
    wait_for_verified(job_id, 10)
    ranks = wait_for(lambda: (found := rank_pids(job_id, 1, cluster.tmp)) and len(found) == 2 and found,
                     timeout=30, what="both ranks of generation 1")
    torchrun = parent_of(ranks[0])

    killed_at = timezone.now()
    agent.kill(signal.SIGKILL)  # the agent and, with it, everything it ran
    for pid in (torchrun, *ranks.values()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # The stalled job may be declared hung first; the lost node then makes that incident a partition.
    partition = wait_for(lambda: Incident.objects.filter(job_id=job_id).exclude(kind="hang").first(), timeout=30,
                         what="the lost node's incident")
    assert partition.kind == "partition"  # what the silence alone says
    time.sleep(max(0.0, 5.0 - (timezone.now() - killed_at).total_seconds()))  # the agent restarts 5 s later
    cluster.start_agent("node-a")

    wait_for(lambda: job_row(job_id).generation >= 2, timeout=60, what="a relaunch without an approval")
    incident = Incident.objects.get(pk=partition.pk)
    assert (incident.kind, incident.decision) == ("crash", "restart"), incident.classification
    assert incident.evidence["reclassified_from"] == "partition"
    assert incident.fault_at <= killed_at + timedelta(seconds=0.1)  # the last heartbeat before the kill
    assert incident.detected_at - incident.fault_at >= timedelta(seconds=2)  # detection came a timeout later
    wait_for(lambda: job_row(job_id).state == "completed", timeout=120, what="the job to complete")
    assert Incident.objects.filter(job_id=job_id).count() == 1
