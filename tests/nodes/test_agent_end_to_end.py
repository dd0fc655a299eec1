"""The real node agent (``agents.agent``, scripted GPUs) against the real control plane over HTTP.

The agent runs on a thread of this process and talks to Django's live test server, so every
message crosses the wire exactly as in production and is parsed by the server's views.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from agents.agent.config import AgentConfig
from agents.agent.daemon import Agent
from core.models import ApiToken
from jobs.models import Event
from nodes import services
from nodes.choices import CommandState, Health, Schedulability
from nodes.models import AgentEventRecord, Node, NodeCommand, NodeGpuSample
from nodes.services import fleet
from tests.waiting import wait_for

POLL_S = 0.05  # the timing asserts below allow a fraction of a second: poll often

pytestmark = pytest.mark.e2e

SCENARIO = """
gpus: 2
baseline: {temperature: 45, utilization: 95, memory_used: 2GiB}
events:
  - {at: 2s, gpu: 1, xid: 79}
"""


@pytest.fixture
def fast_heartbeats(settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "HEARTBEAT_INTERVAL_S": 0.25, "HEARTBEAT_MISSES": 3}
    return 0.25


@pytest.fixture
def running_agent(live_server, transactional_db, tmp_path: Path, fast_heartbeats):
    """Starts an agent with a fresh bootstrap token; yields ``(agent, thread)``; stops it at the end."""
    _, bootstrap = ApiToken.issue(name="e2e bootstrap", scope="bootstrap", single_use=True)
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(SCENARIO)
    config = AgentConfig(control_plane_url=live_server.url, work_dir=tmp_path / "agent", hostname="e2e-node",
                         address="127.0.0.1", bootstrap_token=bootstrap, telemetry_interval_s=0.1,
                         telemetry_batch_s=0.3,
                         telemetry_source="scripted", scenario=scenario, probe_port=0, probe_host="127.0.0.1",
                         stop_grace_s=2.0, request_timeout_s=2.0)
    agent = Agent(config)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    yield agent, thread
    agent.stop()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the agent did not stop"


@pytest.fixture
def paced(settings):
    """Heartbeat pacing at 4 a second: with 4 nodes to hear from, the agent is asked for 1 s."""
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "MAX_HEARTBEATS_PER_S": 4.0}


def test_the_agent_beats_at_the_interval_the_control_plane_asks_for(paced, running_agent):
    agent, _ = running_agent
    Node.objects.bulk_create([Node(hostname=f"quiet-{i}", address=f"10.0.3.{i}", health="healthy",
                                   heartbeat_deadline=timezone.now() + timedelta(hours=1)) for i in range(3)])
    fleet.forget_fleet_count()
    wait_for(lambda: agent.heartbeat_interval_s == 1.0, timeout=15, what="the paced interval", interval=POLL_S)
    node = node_state()
    assert node.heartbeat_deadline - node.last_heartbeat_at == timedelta(seconds=3 * 1.0)
    # The gaps between the heartbeats the agent sends: 0.25 s unpaced, 1 s paced. The median, since
    # one beat can be late behind a slow request of the loop (the scenario's Xid and its drain).
    sent: list[float] = []
    beat = agent._heartbeat
    agent._heartbeat = lambda creds: (sent.append(time.monotonic()), beat(creds))[1]
    wait_for(lambda: len(sent) >= 5, timeout=20, what="five heartbeats", interval=POLL_S)
    gaps = sorted(b - a for a, b in zip(sent, sent[1:], strict=False))
    assert 0.9 <= gaps[len(gaps) // 2] <= 1.3, gaps
    assert node_state().last_heartbeat_seq > node.last_heartbeat_seq
    assert node_state().health != Health.UNREACHABLE  # (the scenario's Xid makes it unhealthy)


def node_state():
    node = Node.objects.filter(hostname="e2e-node").first()
    return node


def test_a_scripted_xid_makes_the_node_unhealthy_and_drains_it_within_two_heartbeats(running_agent):
    node = wait_for(lambda: (n := node_state()) and n.health == Health.HEALTHY and n,
                    timeout=15, what="a healthy node", interval=POLL_S)
    assert NodeGpuSample.objects.filter(node=node).exists()
    assert AgentEventRecord.objects.filter(node=node, kind="agent_started").exists()

    xid = wait_for(lambda: AgentEventRecord.objects.filter(node=node, kind="xid").first(),
                   timeout=15, what="the Xid event", interval=POLL_S)
    seen_at = xid.time  # when the agent saw it
    unhealthy = wait_for(lambda: Event.objects.filter(kind="node.health", node=node, new_state="unhealthy").first(),
                         timeout=5, what="the node turning unhealthy", interval=POLL_S)
    drained = wait_for(lambda: Event.objects.filter(kind="node.drain", node=node).first(),
                       timeout=5, what="the drain", interval=POLL_S)
    assert (unhealthy.created_at - seen_at).total_seconds() <= 2 * 0.25 + 0.25
    assert (drained.created_at - seen_at).total_seconds() <= 2 * 0.25 + 0.25
    node.refresh_from_db()
    assert node.schedulability == Schedulability.DRAINED
    assert "critical Xid 79" in node.health_reason
    # The agent picks the drain up with its next heartbeats, runs it once and says so.
    command = wait_for(lambda: NodeCommand.objects.filter(node=node, kind="drain", state=CommandState.ACKED).first(),
                       timeout=10, what="the drain acknowledged", interval=POLL_S)
    assert command.delivery_count >= 1
    wait_for(lambda: AgentEventRecord.objects.filter(node=node, kind="drain_ack").exists(),
             timeout=10, what="the drain_ack", interval=POLL_S)
    wait_for(lambda: Node.objects.get(pk=node.pk).agent_draining,
             timeout=10, what="the agent reporting that it drains", interval=POLL_S)


def test_an_agent_that_stops_heartbeating_makes_its_node_unreachable(running_agent):
    agent, thread = running_agent
    node = wait_for(lambda: (n := node_state()) and n.last_heartbeat_at and n,
                    timeout=15, what="the first heartbeat", interval=POLL_S)
    assert services.expire_one_heartbeat() is False
    agent.stop()
    thread.join(timeout=30)
    started = time.monotonic()
    wait_for(lambda: services.expire_one_heartbeat() or Node.objects.get(pk=node.pk).health == Health.UNREACHABLE,
             timeout=5, what="the node marked unreachable", interval=POLL_S)
    node.refresh_from_db()
    assert node.health == Health.UNREACHABLE
    assert time.monotonic() - started <= 3 * 0.25 + 1.0
