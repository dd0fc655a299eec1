"""A network partition end to end (issue 5, scenario 9): two nodes in network namespaces, a real
2-node torchrun (gloo) between them, and the link of one node cut — from the control plane and
from the other node at once.

The cut-off node's rank is still alive (a gloo collective waits for its peer until the process
group's timeout), so restarting the job elsewhere would run two generations side by side: a split
brain. Nightwatch must pause and escalate instead, refuse an approval while that node has not
confirmed its ranks stopped, and resume with exactly one new generation once the link is back, the
node has stopped its ranks, and on-call approves.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, api, wait_for
from tests.e2e.netns import IFNAME, NetnsUnavailable, Network
from tests.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STEPS = 60
QUIESCE_TIMEOUT_S = 12
#: How long the test keeps watching the paused job, link still down, for a generation 2.
HOLD_S = 8
JOB_IDS_FROM = 700_000


@pytest.fixture
def network():
    """A bridge for the control plane and two namespaces, node-a and node-b (see tests/e2e/netns.py)."""
    net = Network()
    try:
        net.up()
    except NetnsUnavailable as exc:
        net.close()
        pytest.skip(str(exc))
    try:
        net.add_host("a", "node-a")
        net.add_host("b", "node-b")
        yield net
    finally:
        net.close()  # every process left in the namespaces is SIGKILLed; links, namespaces and route go


@pytest.fixture
def netns_cluster(transactional_db, tmp_path, request, network):
    """The control plane and worker in the root namespace, serving on the bridge address."""
    from django.db import connection

    from jobs.models import Job
    from tests.e2e.conftest import REDIS_DB

    if connection.vendor != "postgresql":
        pytest.fail("end-to-end tests need PostgreSQL and Redis: run them through `make test`")
    with connection.cursor() as cursor:
        # Job ids far from those of other test sessions on this machine: their tests find ranks by
        # NIGHTWATCH_JOB in the environment (rank_pids) and must never find, or kill, ours.
        cursor.execute("SELECT setval(pg_get_serial_sequence(%s, 'id'), %s)", [Job._meta.db_table, JOB_IDS_FROM])
    c = Cluster(tmp_path, database_name=connection.settings_dict["NAME"], redis_db=REDIS_DB,
                host=network.gateway, settings={"NIGHTWATCH_QUIESCE_TIMEOUT_S": str(QUIESCE_TIMEOUT_S),
                          # node-b is back ~20 s after the verdict, and its cut-off rank may have died of
                          # the cut by then: within the default 60 s that is a crash to restart
                          # (tests/e2e/test_agent_return.py); this test is about the partition.
                          "NIGHTWATCH_AGENT_RETURN_WINDOW_S": "5"})
    try:
        c.start_web()
        c.start_worker()
        yield c
    finally:
        for host in network.hosts:  # a cut-off agent must not hang on its last flush
            with contextlib.suppress(RuntimeError):
                network.restore(host)
        c.close()
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            print(timeline())
            print(c.dump_logs())
            for log in sorted(tmp_path.glob("agents/*/supervisor/jobs/*/generation-*/torchrun.log")):
                print(f"===== {log.relative_to(tmp_path)} =====\n{log.read_text(errors='replace')[-3000:]}")


def job_row(job_id):
    from jobs.models import Job

    return Job.objects.get(pk=job_id)


def timeline(job_id: int | None = None) -> str:
    """The recorded history, for a failure message: every event and incident, in order."""
    from django.db.models import Q

    from jobs.models import Event, Incident

    events = Event.objects.select_related("node").order_by("created_at", "pk")
    if job_id is not None:  # the job's events and the nodes' (health, commands, drains)
        events = events.filter(Q(job_id=job_id) | Q(job__isnull=True) | Q(node__isnull=False))
    lines = [f"{e.created_at:%H:%M:%S.%f} {e.kind:<16} {e.actor:<28} {e.node.hostname if e.node else '':<7} "
             f"g{e.generation if e.generation is not None else '-'} {e.old_state}->{e.new_state} {e.reason[:160]}"
             for e in events]
    for i in Incident.objects.select_related("generation").order_by("detected_at"):
        lines.append(f"incident {i.pk} {i.kind}/{i.decision}/{i.state} gen={getattr(i.generation, 'number', None)} "
                     f"detected={i.detected_at:%H:%M:%S.%f} quiesced={i.quiesced_at} relaunched={i.relaunched_at} "
                     f"first_step={i.first_step_at} evidence={i.evidence}")
    return "\n".join(lines)


def ranks_on(network: Network, host: str, job_id: int, generation: int) -> dict[int, int]:
    """The job's ranks of ``generation`` that run in ``host``'s namespace, by global rank.

    Only the namespace's processes are looked at: another test session on this machine may run a
    job with the same id and generation (``rank_pids`` would find its ranks too).
    """
    wanted = (f"NIGHTWATCH_JOB={job_id}".encode(), f"NIGHTWATCH_GENERATION={generation}".encode())
    found: dict[int, int] = {}
    for pid in network.pids(host):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [e for e in environ if e.startswith(b"RANK=")]
        if all(w in environ for w in wanted) and ranks and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in environ):
            found[int(ranks[0].split(b"=")[1])] = pid
    return found


def test_a_partitioned_node_pauses_and_escalates_and_resumes_once_after_approval(netns_cluster, tokens, network,
                                                                                 tmp_path):
    """node-b's link goes down mid-training: unreachable → partition → escalate → paused, approval
    refused while node-b's rank may still run; link back → node-b stops it and confirms → approved →
    generation 2, the only one, resumes from the last verified checkpoint and completes."""
    from checkpoints.models import Checkpoint
    from jobs.models import Generation, Incident
    from nodes.models import Node, NodeCommand

    cluster = netns_cluster

    a, b = network.hosts["a"], network.hosts["b"]
    for host in (a, b):
        cluster.start_agent(host.hostname, bootstrap_token=tokens["bootstrap"](), address=host.address,
                            wrap=host.exec_prefix())
    wait_for(lambda: Node.objects.filter(health="healthy").count() == 2, timeout=60, what="two healthy nodes")

    body = {"name": "partitioned", "entrypoint": "examples/train.py", "nnodes": 2, "nproc_per_node": 1,
            "accelerator": "cpu", "rdzv_port": free_port(), "nccl_profile": {"GLOO_SOCKET_IFNAME": IFNAME},
            "args": ["--steps", str(STEPS), "--ckpt-every", "5", "--dataset-size", "256", "--check-every", "5",
                     "--min-step-time", "0.25"],
            "checkpoint_policy": {"dir": str(tmp_path / "checkpoints" / "ckpt")},
            "recovery_policy": {"backoff_seconds": 0}}
    status, job = api(cluster, tokens["operator"], "POST", "/api/v1/jobs", body)
    assert status == 201, job
    job_id = job["id"]

    # Training across the two namespaces, with a verified checkpoint to resume from later.
    wait_for(lambda: Checkpoint.objects.filter(job_id=job_id, state="verified", step__gte=5).exists(), timeout=120,
             what="a verified checkpoint of generation 1")
    wait_for(lambda: (job_row(job_id).last_step or 0) >= 12, timeout=60, what="step 12")
    assert set(Generation.objects.get(job_id=job_id, number=1).nodes.values_list("hostname", flat=True)) == {
        "node-a", "node-b"}
    cut_off = ranks_on(network, "b", job_id, 1)
    assert cut_off and ranks_on(network, "a", job_id, 1), "one rank in each namespace"

    network.cut("b")
    cut_at = time.monotonic()

    def one_generation() -> None:
        """Checked at every poll while the link is down: nothing ever launches generation 2."""
        generations = list(Generation.objects.filter(job_id=job_id).values_list("number", flat=True))
        assert generations == [1] and job_row(job_id).generation == 1, (
            f"a new generation while node-b is cut off: {generations}\n{timeline(job_id)}")

    def watching(condition):
        def check():
            one_generation()
            return condition()
        return check

    wait_for(watching(lambda: Node.objects.get(hostname="node-b").health == "unreachable"), timeout=30,
             what="node-b to turn unreachable")
    # The hang sweep may speak first (the stalled collectives), and the lost node then re-classifies
    # that incident: either way there is one, a partition by the time node-b is known lost.
    def classified():
        incident = Incident.objects.filter(job_id=job_id).first()
        return incident if incident is not None and incident.kind != "hang" else None

    incident = wait_for(watching(classified), timeout=30, what="a partition incident")
    assert (incident.kind, incident.decision) == ("partition", "escalate"), timeline(job_id)
    assert incident.evidence["signal"] == "node_unreachable" and incident.evidence["nodes"] == ["node-b"]
    assert Incident.objects.filter(job_id=job_id).count() == 1, timeline(job_id)

    # node-a confirms its ranks stopped; node-b cannot, so at the quiesce deadline the job pauses.
    wait_for(watching(lambda: job_row(job_id).state == "paused"), timeout=QUIESCE_TIMEOUT_S + 30,
             what="the job to pause")
    job = job_row(job_id)
    assert "node-b" in job.pause_reason and "node-a" not in job.pause_reason, job.pause_reason
    assert "escalating" in job.pause_reason
    assert Generation.objects.get(job_id=job_id, number=1).stopped_nodes == ["node-a"], timeline(job_id)
    assert not ranks_on(network, "a", job_id, 1), "node-a's rank outlived its confirmed stop"
    # Still training, as far as it knows (its torchrun gives up on the rendezvous store only after
    # 60 s, gloo after 30 min): a restart now would run beside it.
    assert ranks_on(network, "b", job_id, 1) == cut_off, "the cut-off rank should still be alive"
    hold_until = time.monotonic() + HOLD_S
    wait_for(watching(lambda: time.monotonic() > hold_until and job_row(job_id).state == "paused"),
             timeout=HOLD_S + 5, what="the job to stay paused")

    status, refused = api(cluster, tokens["oncall"], "POST", f"/api/v1/jobs/{job_id}/approve",
                          {"reason": "looks fine from here"})
    assert status == 409 and refused["status"] == 409, refused
    assert "node-b" in refused["detail"] and "split brain" in refused["detail"]
    one_generation()
    assert job_row(job_id).state == "paused"
    assert Node.objects.get(hostname="node-b").health == "unreachable", "the link came back too early"
    assert time.monotonic() - cut_at >= QUIESCE_TIMEOUT_S + HOLD_S

    # The link returns: node-b's agent answers again, gets the stop, stops its rank and acknowledges.
    network.restore("b")
    wait_for(lambda: Node.objects.get(hostname="node-b").health == "healthy", timeout=60,
             what="node-b to be back and healthy")
    stop = wait_for(lambda: NodeCommand.objects.filter(node__hostname="node-b", kind="stop", job_id=job_id,
                                                        generation=1, state="acked").first(),
                    timeout=60, what="node-b to acknowledge the stop of generation 1")
    wait_for(lambda: "node-b" in Generation.objects.get(job_id=job_id, number=1).stopped_nodes, timeout=30,
             what="node-b's confirmation that generation 1 stopped")
    assert stop.detail in ("stopped", "not running on this node"), stop.detail  # (its rank may have died first)
    assert not ranks_on(network, "b", job_id, 1), "node-b's cut-off rank outlived its acknowledged stop"
    assert job_row(job_id).state == "paused" and job_row(job_id).generation == 1, "resumed without an approval"

    status, approved = api(cluster, tokens["oncall"], "POST", f"/api/v1/jobs/{job_id}/approve",
                           {"reason": "link repaired; node-b stopped its ranks"})
    assert status == 200, approved
    wait_for(lambda: Generation.objects.filter(job_id=job_id, number=2, first_step_at__isnull=False).exists(),
             timeout=120, what="generation 2 to train its first step")
    wait_for(lambda: job_row(job_id).state == "completed", timeout=120, what="the job to complete")

    assert list(Generation.objects.filter(job_id=job_id).order_by("number").values_list("number", flat=True)) == [
        1, 2], timeline(job_id)
    second = Generation.objects.get(job_id=job_id, number=2)
    assert set(second.nodes.values_list("hostname", flat=True)) == {"node-a", "node-b"}
    assert second.resumed_from is not None and second.resumed_from.state == "verified"
    incident.refresh_from_db()
    assert incident.state == "resolved" and incident.relaunched_at and incident.first_step_at, timeline(job_id)
    assert Incident.objects.filter(job_id=job_id).count() == 1, timeline(job_id)
    assert job_row(job_id).last_step == STEPS
