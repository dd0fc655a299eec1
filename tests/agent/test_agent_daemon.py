"""The agent daemon against a real HTTP control plane on loopback that can go down."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agents.agent.config import ConfigError, load_config
from agents.protocol.agent import Command, DrainAck, DrainPayload, HealthCheckPayload, LaunchPayload, ProbePeer, compact
from tests.waiting import wait_for

POLL_S = 0.05  # the agent and the supervisor answer in milliseconds: poll often


def command(kind: str, payload: Any, *, id: str, key: str | None = None, job: str | None = None,  # noqa: A002
            generation: int | None = None) -> Command:
    return Command(id=id, kind=kind, idempotency_key=key or f"key-{id}", job=job, generation=generation,
                   payload=compact(payload))


def test_registers_stores_its_token_and_reports(control_plane: Any, agent_config: Callable[..., Any],
                                                start_agent: Callable[..., Any]) -> None:
    config = agent_config(labels={"rack": "r1"})
    running = start_agent(config)
    wait_for(lambda: len(control_plane.heartbeats) >= 3, timeout=20, what="three heartbeats", interval=POLL_S)
    wait_for(lambda: len(control_plane.samples) >= 4, timeout=20, what="telemetry from both GPUs", interval=POLL_S)

    [registration] = control_plane.registrations
    assert registration.hostname == "test-node" and registration.labels == {"rack": "r1"}
    assert [g.index for g in registration.gpus] == [0, 1] and registration.gpu_telemetry
    assert registration.probe_port and registration.probe_port > 0

    token_file = config.work_dir / "node-token.json"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert control_plane.node_token in token_file.read_text()

    seqs = [h.seq for h in control_plane.heartbeats]
    assert seqs == sorted(seqs) and control_plane.heartbeats[0].gpu_telemetry
    assert {s["gpu"] for s in control_plane.samples} == {0, 1}
    assert control_plane.samples[0]["temperature_c"] == 45.0
    [(started, detail)] = control_plane.events_of("agent_started")
    assert detail.gpu_telemetry and detail.agent_version
    assert running.stop() == 0

    # A restart reuses the stored token: no second registration (the bootstrap token is one-time).
    again = start_agent(config)
    wait_for(lambda: len(control_plane.events_of("agent_started")) == 2,
             timeout=20, what="the restarted agent", interval=POLL_S)
    assert len(control_plane.registrations) == 1
    assert again.stop() == 0


def test_a_control_plane_older_than_pacing_gets_heartbeats_it_can_parse(control_plane: Any,
                                                                         agent_config: Callable[..., Any],
                                                                         start_agent: Callable[..., Any]) -> None:
    control_plane.knows_interval = False
    running = start_agent(agent_config())
    wait_for(lambda: len(control_plane.heartbeats) >= 3, timeout=20, what="three heartbeats", interval=POLL_S)
    assert all(h.interval_s is None for h in control_plane.heartbeats)
    assert running.agent.heartbeat_interval_s == 0.2  # registration's, for good
    assert running.stop() == 0


def test_the_interval_a_heartbeat_answer_asks_for_is_followed(control_plane: Any, agent_config: Callable[..., Any],
                                                              start_agent: Callable[..., Any]) -> None:
    running = start_agent(agent_config())
    wait_for(lambda: control_plane.heartbeats, timeout=20, what="a heartbeat", interval=POLL_S)
    assert control_plane.heartbeats[0].interval_s == 0.2  # says what it follows: registration's interval
    control_plane.paced_interval_s = 0.6
    wait_for(lambda: running.agent.heartbeat_interval_s == 0.6, timeout=5, what="the paced interval", interval=POLL_S)
    wait_for(lambda: len([h for h in control_plane.heartbeats if h.interval_s == 0.6]) >= 3, timeout=10,
             what="three paced heartbeats", interval=POLL_S)
    paced = [h.time for h in control_plane.heartbeats if h.interval_s == 0.6]
    assert min(b - a for a, b in zip(paced, paced[1:], strict=False)) >= 0.55
    assert running.stop() == 0


def test_a_registration_answer_lost_to_a_timeout_is_retried_as_the_same_attempt(
        control_plane: Any, agent_config: Callable[..., Any], start_agent: Callable[..., Any]) -> None:
    control_plane.register_delays = [1.5]  # longer than the agent's 1 s request timeout
    config = agent_config()
    start_agent(config)
    wait_for(lambda: control_plane.heartbeats, timeout=20, what="the agent registered", interval=POLL_S)
    first, retry = control_plane.registrations[:2]
    assert first.attempt and retry.attempt == first.attempt  # the control plane can tell it is a retry
    assert not (config.work_dir / "registration-attempt").exists()  # kept only until the token is


def test_a_refused_bootstrap_token_stops_the_agent(agent_config: Callable[..., Any],
                                                   start_agent: Callable[..., Any]) -> None:
    config = agent_config(bootstrap_token="not-the-one")
    running = start_agent(config)
    running.thread.join(timeout=20)
    assert running.exit_status == 2  # systemd's RestartPreventExitStatus: retrying cannot help
    assert not config.token_path.exists()


def test_nothing_is_lost_while_the_control_plane_is_down(control_plane: Any, agent_config: Callable[..., Any],
                                                         start_agent: Callable[..., Any]) -> None:
    running = start_agent(agent_config())
    agent = running.agent
    wait_for(lambda: control_plane.samples, timeout=20, what="first telemetry", interval=POLL_S)
    control_plane.down()
    outage_start = agent.samples_taken
    wait_for(lambda: agent.samples_taken >= outage_start + 30 and len(agent.outbox) >= 30,
             timeout=20, what="samples to pile up in the spool", interval=POLL_S)
    # Events raised during the outage must survive it too.
    agent.outbox.add_event("drain_ack", DrainAck(reason="during the outage"))
    control_plane.up()
    wait_for(lambda: len(agent.outbox) == 0 and len(control_plane.heartbeats) > 0,
             timeout=30, what="the spool to drain", interval=POLL_S)
    dropped = agent.outbox.spool.dropped
    running.stop()

    samples = {(s["gpu"], s["time"]) for s in control_plane.samples}
    assert len(samples) == len(control_plane.samples)  # in order, and none twice
    assert len(samples) == agent.samples_taken
    assert len(control_plane.events) == agent.outbox.events_created
    assert dropped == {}
    times = [s["time"] for s in control_plane.samples if s["gpu"] == 0]
    assert times == sorted(times)  # replayed in order


def test_past_the_bound_old_telemetry_goes_first_and_events_stay(control_plane: Any,
                                                                 agent_config: Callable[..., Any],
                                                                 scenario_file: Callable[[str], Path],
                                                                 start_agent: Callable[..., Any]) -> None:
    running = start_agent(agent_config(spool_max_records=100, scenario=scenario_file("gpus: 8")))
    agent = running.agent
    wait_for(lambda: control_plane.samples, timeout=20, what="first telemetry", interval=POLL_S)
    control_plane.down()
    for i in range(30):
        agent.outbox.add_event("drain_ack", DrainAck(reason=f"event {i}"))
    wait_for(lambda: agent.outbox.spool.dropped.get("telemetry", 0) > 50,
             timeout=20, what="the spool to overflow", interval=POLL_S)
    control_plane.up()

    def reported() -> int:
        return sum(detail.count for _, detail in control_plane.events_of("telemetry_dropped"))

    # Reporting a drop appends an event, which may itself push one more sample out: wait until
    # the reports have caught up with the count.
    wait_for(lambda: len(agent.outbox) == 0 and reported() == agent.outbox.spool.dropped["telemetry"],
             timeout=30, what="every drop to be reported and the spool to drain", interval=POLL_S)
    running.stop()

    reasons = {detail.reason for _, detail in control_plane.events_of("drain_ack")}
    assert {f"event {i}" for i in range(30)} <= reasons  # events are never dropped
    assert len(control_plane.samples) + reported() == agent.samples_taken  # every sample: sent or counted
    times = [s["time"] for s in control_plane.samples if s["gpu"] == 0]
    assert times == sorted(times)  # what survived is the newest telemetry, still in order


def test_a_command_runs_once_however_often_it_arrives(control_plane: Any, agent_config: Callable[..., Any],
                                                      start_agent: Callable[..., Any]) -> None:
    running = start_agent(agent_config())
    drain = command("drain", DrainPayload(reason="maintenance"), id="c1", key="drain-once")
    control_plane.send(drain)
    control_plane.send(drain)  # duplicated in the queue, and re-sent until acked
    wait_for(lambda: any(a.command_id == "c1" for a in control_plane.acks),
             timeout=20, what="the drain ack", interval=POLL_S)
    # The same idempotency key under another command id (the server retried creating it).
    control_plane.send(command("drain", DrainPayload(reason="maintenance"), id="c2", key="drain-once"))
    wait_for(lambda: any(a.command_id == "c2" for a in control_plane.acks),
             timeout=20, what="the second ack", interval=POLL_S)
    wait_for(lambda: control_plane.heartbeats[-1].draining,
             timeout=5, what="a heartbeat that says draining", interval=POLL_S)
    agent = running.agent
    running.stop()

    assert agent.commands is not None and agent.commands.executed["drain"] == 1
    assert len(control_plane.events_of("drain_ack")) == 1
    assert {a.status for a in control_plane.acks} == {"done"}


def test_events_and_acks_go_to_the_urgent_url_and_to_the_control_plane_while_it_is_down(
        control_plane: Any, urgent_plane: Any, agent_config: Callable[..., Any],
        start_agent: Callable[..., Any]) -> None:
    """``urgent_url``: the events and acks go to processes of their own (compose's ``urgent``),
    everything else to ``control_plane_url``; when those processes do not answer, the control plane's
    URL takes the events and acks instead of their waiting for them."""
    running = start_agent(agent_config(urgent_url=urgent_plane.url))
    control_plane.send(command("drain", DrainPayload(reason="maintenance"), id="c1"))
    wait_for(lambda: urgent_plane.acks, timeout=20, what="the drain ack at the urgent URL", interval=POLL_S)
    with control_plane.lock:
        control_plane.pending.clear()  # acked where the real control plane shares its database
    wait_for(lambda: urgent_plane.events_of("drain_ack") and control_plane.samples,
             timeout=20, what="the drain_ack event and telemetry", interval=POLL_S)
    assert urgent_plane.events_of("agent_started") and not control_plane.events and not control_plane.acks
    assert not urgent_plane.samples and not urgent_plane.heartbeats and not urgent_plane.registrations

    urgent_plane.down()
    control_plane.send(command("drain", DrainPayload(reason="maintenance"), id="c2"))
    wait_for(lambda: any(a.command_id == "c2" for a in control_plane.acks), timeout=20,
             what="the second ack, at the control plane", interval=POLL_S)
    # (c1 may be acked there again too: a heartbeat can re-deliver it before the test cleared it.)
    assert {a.command_id for a in urgent_plane.acks} == {"c1"}
    assert running.stop() == 0


@pytest.mark.parametrize("command_wait", [True, False])
def test_a_command_is_taken_as_it_is_queued_not_with_the_next_heartbeat(
        control_plane: Any, agent_config: Callable[..., Any], start_agent: Callable[..., Any],
        command_wait: bool) -> None:
    """Heartbeats 30 s apart (a paced fleet): with the command wait a drain is acked within a
    second of being queued; without it, it waits for the next heartbeat."""
    control_plane.heartbeat_interval_s = 30.0
    running = start_agent(agent_config(command_wait=command_wait))
    wait_for(lambda: control_plane.heartbeats, timeout=20, what="the first heartbeat", interval=POLL_S)
    if command_wait:
        wait_for(lambda: control_plane.command_waits, timeout=5, what="the agent's command wait", interval=POLL_S)
    queued = time.monotonic()
    control_plane.send(command("drain", DrainPayload(reason="maintenance"), id="c1"))
    if command_wait:
        wait_for(lambda: control_plane.acks, timeout=5, what="the drain ack", interval=POLL_S)
        assert time.monotonic() - queued < 1.0
        assert len(control_plane.heartbeats) >= 2  # taken by a heartbeat made at once
    else:
        time.sleep(2.0)  # the claim is that nothing happens: there is no event to wait for
        assert not control_plane.acks and len(control_plane.heartbeats) == 1
    assert running.stop() == 0


def test_a_refused_heartbeat_that_commands_wait_for_is_tried_again_within_seconds(
        control_plane: Any, agent_config: Callable[..., Any], start_agent: Callable[..., Any]) -> None:
    """Heartbeats 30 s apart, and the two the command wait asks for are refused (503, Retry-After
    1): the drain still arrives within seconds (a jittered backoff from 1 s), not an interval later."""
    control_plane.heartbeat_interval_s = 30.0
    running = start_agent(agent_config(command_wait=True))
    wait_for(lambda: control_plane.heartbeats, timeout=20, what="the first heartbeat", interval=POLL_S)
    wait_for(lambda: control_plane.command_waits, timeout=5, what="the agent's command wait", interval=POLL_S)
    with control_plane.lock:
        control_plane.refuse_heartbeats = 2
    queued = time.monotonic()
    control_plane.send(command("drain", DrainPayload(reason="maintenance"), id="c1"))
    wait_for(lambda: control_plane.acks, timeout=15, what="the drain ack", interval=POLL_S)
    took = time.monotonic() - queued
    first, second = control_plane.refused_heartbeats
    assert first - queued < 1.0  # the wake-up's own heartbeat, refused
    assert second - first >= 1.0  # the server's Retry-After, at least
    assert took < 10.0, f"the drain took {took:.1f} s (the interval is 30 s)"  # 1-1.5 s, then 2-3 s, plus load
    assert running.stop() == 0


def test_heartbeats_are_due_a_little_early_by_a_random_amount() -> None:
    """Agents that heartbeated together drift apart: each next turn is the interval less up to 10 %,
    drawn each time; a refused heartbeat nobody waits for keeps that schedule."""
    import random

    from agents.agent.wake import HEARTBEAT_JITTER, next_heartbeat_in

    rng = random.Random(7)
    turns = [next_heartbeat_in(20.0, rng=rng) for _ in range(200)]
    assert all(20.0 * (1 - HEARTBEAT_JITTER) <= t <= 20.0 for t in turns)
    assert max(turns) - min(turns) > 1.5  # spread over most of the 2 s allowed
    assert 18.0 <= next_heartbeat_in(20.0, owed=False, refusals=3, retry_after=1.0, rng=rng) <= 20.0
    owed = [next_heartbeat_in(20.0, owed=True, refusals=n, retry_after=1.0, rng=rng) for n in (1, 2, 3, 4, 5, 6)]
    assert 1.0 <= owed[0] <= 1.5 and 2.0 <= owed[1] <= 3.0 and 4.0 <= owed[2] <= 6.0  # doubling from 1 s
    assert owed[-1] == 20.0  # never later than the interval
    assert next_heartbeat_in(20.0, owed=True, refusals=1, retry_after=5.0, rng=rng) >= 5.0  # the server's wait


def test_a_failing_node_refuses_to_launch_and_says_why(control_plane: Any, agent_config: Callable[..., Any],
                                                       scenario_file: Callable[[str], Path],
                                                       start_agent: Callable[..., Any], train_script: Path) -> None:
    hot = scenario_file("gpus: 2\nevents: [{at: 0, gpu: 1, temperature: 92}]\n")
    running = start_agent(agent_config(scenario=hot))
    payload = LaunchPayload(script="train.py", workdir=str(train_script.parent),
                            nnodes=1, nproc_per_node=2, node_rank=0,
                            rdzv_endpoint="127.0.0.1:29999", rdzv_id="j-1")
    control_plane.send(command("launch", payload, id="l1", job="j", generation=1))
    [ack] = wait_for(lambda: control_plane.acks, timeout=20, what="the launch ack", interval=POLL_S)
    assert ack.status == "refused" and "temperature 92 °C" in ack.detail
    [(event, report)] = wait_for(lambda: control_plane.events_of("launch_refused"),
                                 timeout=10, what="launch_refused", interval=POLL_S)
    assert not report.ok and any(c.name == "temperature" and c.gpu == 1 and not c.ok for c in report.checks)
    assert running.agent.supervisor.running() == [] and control_plane.events_of("launched") == []


def test_a_launch_whose_peer_cannot_be_reached_at_the_expected_bandwidth_is_refused(
        control_plane: Any, agent_config: Callable[..., Any], start_agent: Callable[..., Any],
        train_script: Path) -> None:
    """The pre-launch pairwise probe: a peer of the job that does not answer fails the check."""
    import socket

    with socket.socket() as s:  # a port with nobody listening: the peer's probe server is gone
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    running = start_agent(agent_config())
    wait_for(lambda: control_plane.registrations, timeout=20, what="registration", interval=POLL_S)
    alive_port = control_plane.registrations[0].probe_port
    payload = LaunchPayload(script="train.py", workdir=str(train_script.parent),
                            nnodes=2, nproc_per_node=1, node_rank=0,
                            rdzv_endpoint="127.0.0.1:29999", rdzv_id="j-2", require_gpu=False,
                            probe_peers=[
                                ProbePeer(node="good", address="127.0.0.1", port=alive_port, expected_mbps=1.0),
                                ProbePeer(node="bad", address="127.0.0.1", port=dead_port, expected_mbps=1.0)],
                            probe_bytes=2**20, probe_seconds=2)
    control_plane.send(command("launch", payload, id="l2", job="j", generation=1))
    [ack] = wait_for(lambda: control_plane.acks, timeout=30, what="the launch ack", interval=POLL_S)
    assert ack.status == "refused" and "bad" in ack.detail
    [(event, report)] = wait_for(lambda: control_plane.events_of("launch_refused"),
                                 timeout=10, what="launch_refused", interval=POLL_S)
    assert {b.peer: b.ok for b in report.bandwidth} == {"good": True, "bad": False}
    assert running.agent.supervisor.running() == []


def test_samples_share_a_request_per_batch_and_an_event_takes_them_along(
        control_plane: Any, agent_config: Callable[..., Any], scenario_file: Callable[[str], Path],
        start_agent: Callable[..., Any]) -> None:
    # Two GPUs sampled every 50 ms, batched for 1 s: each request carries many samples (the first
    # goes at once with the agent_started event).
    running = start_agent(agent_config(telemetry_batch_s=1.0))
    wait_for(lambda: len(control_plane.telemetry_posts) >= 4, timeout=20, what="four telemetry requests",
             interval=POLL_S)
    assert min(control_plane.telemetry_posts[1:4]) >= 10, control_plane.telemetry_posts
    assert running.stop() == 0

    # Batched for 30 s, an Xid event goes at once and the samples taken before it go right after it,
    # in the same flush (events before telemetry: agents/agent/outbox.py), not 30 s later.
    control_plane.samples.clear()
    control_plane.telemetry_posts.clear()
    start_agent(agent_config(telemetry_batch_s=30.0, scenario=scenario_file(
        "gpus: 2\nevents: [{at: 500ms, gpu: 1, xid: 13}]\n")))
    [(xid, _)] = wait_for(lambda: control_plane.events_of("xid"), timeout=10, what="the xid event",
                          interval=POLL_S)
    wait_for(lambda: any(s["time"] >= xid.time - 0.2 for s in control_plane.samples), timeout=5,
             what="the samples of the 0.2 s before the event, sent along with it", interval=POLL_S)


def test_an_xid_does_not_wait_out_the_retry_after_of_refused_telemetry(
        control_plane: Any, agent_config: Callable[..., Any], scenario_file: Callable[[str], Path],
        start_agent: Callable[..., Any]) -> None:
    # A shedding control plane refuses telemetry and asks for 30 s (a paced fleet's heartbeat interval):
    # the Xid 2 s later goes on its own lane at once, and telemetry waits out what it was asked.
    control_plane.telemetry_retry_after = 30
    running = start_agent(agent_config(telemetry_batch_s=0.2, scenario=scenario_file(
        "gpus: 2\nevents: [{at: 2s, gpu: 1, xid: 13}]\n")))
    wait_for(lambda: control_plane.telemetry_refusals >= 1, timeout=10, what="a refused telemetry batch",
             interval=POLL_S)
    [(xid, _)] = wait_for(lambda: control_plane.events_of("xid"), timeout=10, what="the xid event", interval=POLL_S)
    assert control_plane.event_arrivals[xid.key] - xid.time < 1.0
    assert control_plane.telemetry_refusals == 1, "refused telemetry waits out its Retry-After"
    assert control_plane.samples == []
    assert running.stop() == 0


def test_xid_is_reported_at_once_and_fails_the_health_check(control_plane: Any, agent_config: Callable[..., Any],
                                                            scenario_file: Callable[[str], Path],
                                                            start_agent: Callable[..., Any]) -> None:
    scenario = scenario_file("gpus: 2\nevents: [{at: 200ms, gpu: 1, xid: 79}]\n")
    running = start_agent(agent_config(scenario=scenario))
    [(event, xid)] = wait_for(lambda: control_plane.events_of("xid"), timeout=20, what="the xid event", interval=POLL_S)
    assert (xid.gpu, xid.code) == (1, 79)
    # No rank of this node is replaced in process any more: a crash here ends its generation.
    assert "Xid 79" in (running.agent.supervisor._held or "")
    wait_for(lambda: any(s["gpu"] == 1 and s["recent_xid_codes"] == [79] for s in control_plane.samples),
             timeout=10, what="a sample carrying the Xid", interval=POLL_S)
    port = control_plane.registrations[0].probe_port
    control_plane.send(command("health_check", HealthCheckPayload(
        peers=[ProbePeer(node="self", address="127.0.0.1", port=port, expected_mbps=1.0)],
        probe_bytes=4 * 2**20, probe_seconds=2), id="h1"))
    [(_, report)] = wait_for(lambda: control_plane.events_of("health_check"),
                             timeout=20, what="the health report", interval=POLL_S)
    assert not report.ok and "critical Xid 79" in report.reason
    assert [b.ok for b in report.bandwidth] == [True]


def test_a_sample_that_fails_the_health_check_holds_in_process_restarts(
        control_plane: Any, agent_config: Callable[..., Any], scenario_file: Callable[[str], Path],
        start_agent: Callable[..., Any]) -> None:
    scenario = scenario_file("gpus: 2\nevents: [{at: 300ms, gpu: 0, ecc_uncorrected_volatile: 2}]\n")
    running = start_agent(agent_config(scenario=scenario))
    wait_for(lambda: control_plane.samples, timeout=20, what="a first sample", interval=POLL_S)
    held = wait_for(lambda: running.agent.supervisor._held, timeout=20, what="replacements held", interval=POLL_S)
    assert held.startswith("health check failed") and "GPU 0" in held


def test_launch_then_stale_ack_stops_the_generation(control_plane: Any, agent_config: Callable[..., Any],
                                                    start_agent: Callable[..., Any],
                                                    train_script: Path, tmp_path: Path,
                                                    free_port: Callable[[], int], rank_info: Callable[..., Any],
                                                    pid_alive: Callable[[int], bool]) -> None:
    """A launch acked 409 (the job moved on meanwhile) must not keep running: fencing."""
    running = start_agent(agent_config())
    out = tmp_path / "out"
    out.mkdir()
    payload = LaunchPayload(script="train.py", workdir=str(train_script.parent),
                            args=[str(out), "loop"], nnodes=1, nproc_per_node=2,
                            node_rank=0, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="j-2", require_gpu=False)
    control_plane.ack_answers["l2"] = 503  # "try again later": the agent keeps the ack spooled
    control_plane.send(command("launch", payload, id="l2", job="j", generation=2))
    wait_for(lambda: control_plane.events_of("launched"), timeout=30, what="the launched event", interval=POLL_S)
    wait_for(lambda: rank_info(out, 0) and rank_info(out, 1),
             timeout=60, what="both ranks and their children", interval=POLL_S)
    control_plane.ack_answers["l2"] = 409
    [(event, report)] = wait_for(lambda: control_plane.events_of("stopped"),
                                 timeout=60, what="the stale generation's stop", interval=POLL_S)
    assert (event.job, event.generation) == ("j", 2) and report.requested_stop
    assert running.agent.supervisor.running() == []
    for rank in (0, 1):
        info = rank_info(out, rank)
        assert not [pid for pid in [info["pid"], *info["children"]] if pid_alive(pid)]


def test_the_agent_runs_as_a_real_process(control_plane: Any, agent_config: Callable[..., Any], tmp_path: Path,
                                          scenario_file: Callable[[str], Path]) -> None:
    config_file = tmp_path / "agent.yaml"
    config_file.write_text(f"""
control_plane_url: {control_plane.url}
work_dir: {tmp_path / 'work'}
telemetry_source: scripted
scenario: {scenario_file("gpus: 1")}
heartbeat_interval_s: 0.2
telemetry_interval_s: 0.1
telemetry_batch_s: 0.3
probe_port: 0
""")
    token = tmp_path / "bootstrap-token"
    token.write_text(control_plane.bootstrap_token + "\n")
    env = {**os.environ, "NIGHTWATCH_AGENT_BOOTSTRAP_TOKEN_FILE": str(token)}
    proc = subprocess.Popen([sys.executable, "-m", "agents.agent", "--config", str(config_file),
                             "--probe-host", "127.0.0.1"], env=env, cwd=Path(__file__).parents[2])
    try:
        wait_for(lambda: control_plane.samples and control_plane.heartbeats,
                 timeout=30, what="the agent process to report", interval=POLL_S)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert control_plane.registrations[0].bootstrap_token == control_plane.bootstrap_token


# --- configuration -------------------------------------------------------------------------------

def test_config_layers_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("control_plane_url: http://a\nheartbeat_interval_s: 5\nlabels: {rack: r1}\nprobe_port: 1\n")
    config = load_config(["--config", str(path), "--probe-port", "3"],
                         {"NIGHTWATCH_AGENT_HEARTBEAT_INTERVAL_S": "7", "NIGHTWATCH_AGENT_PROBE_PORT": "2"})
    assert (config.control_plane_url, config.heartbeat_interval_s, config.probe_port) == ("http://a", 7.0, 3)
    assert config.labels == {"rack": "r1"} and config.token_path == config.work_dir / "node-token.json"


def test_the_node_memory_for_snapshots_reaches_the_ranks_environment(tmp_path: Path) -> None:
    """An agent's ``snapshot_dir`` is the node memory its ranks keep snapshots in; the agent's own
    ``NIGHTWATCH_*`` environment never reaches them (a variable of the agent's is not the job's)."""
    from agents.supervisor import Supervisor

    config = load_config(["--control-plane-url", "http://a", "--snapshot-dir", str(tmp_path / "shm")], {})
    payload = LaunchPayload(script="examples/train.py", nnodes=1, nproc_per_node=1, node_rank=0,
                            rdzv_endpoint="127.0.0.1:29999", rdzv_id="j-1", snapshot_every=1)
    for snapshot_dir, expected in ((config.snapshot_dir, str(tmp_path / "shm")), (None, None)):
        supervisor = Supervisor(tmp_path / "agent", on_exit=lambda *exit: None, warm_launcher=False,
                                snapshot_dir=snapshot_dir)
        try:
            env = supervisor._environment("j", 1, payload, {}, tmp_path)
        finally:
            supervisor.shutdown(grace_s=1.0)
        assert env.get("NIGHTWATCH_SNAPSHOT_DIR") == expected and env["NIGHTWATCH_SNAPSHOT_EVERY"] == "1"


def test_the_example_deployment_config_loads() -> None:
    example = Path(__file__).parents[2] / "deploy" / "agent.yaml"
    config = load_config(["--config", str(example)], {})
    assert config.telemetry_source == "nvml" and config.thresholds.max_temperature_c == 85


@pytest.mark.parametrize(("text", "message"), [
    ("heartbeat_interval_s: 5\n", "control_plane_url is required"),
    ("control_plane_url: http://a\nheartbeat: 5\n", "unknown setting 'heartbeat'"),
    ("control_plane_url: http://a\nheartbeat_interval_s: soon\n", "heartbeat_interval_s"),
    ("control_plane_url: http://a\ntelemetry_source: scripted\n", "needs a scenario file"),
    ("control_plane_url: http://a\ntelemetry_source: dcgm\n", "telemetry_source must be one of"),
    ("control_plane_url: http://a\nhealth: {max_temp: 90}\n", "unknown threshold 'max_temp'"),
    ("control_plane_url: http://a\nsnapshot_dir: shm/nw\n", "snapshot_dir must be an absolute path"),
    ("control_plane_url: http://a\nurgent_url: nightwatch-urgent:8002\n", "urgent_url must be an http:// or"),
    ("control_plane_url: ftp://a\n", "control_plane_url must be an http:// or https:// URL, got 'ftp://a'"),
])
def test_config_mistakes_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", str(path)], {})


def test_an_injected_launch_is_acked_with_the_reason_and_runs_nothing(
        control_plane: Any, agent_config: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    running = start_agent(agent_config())
    payload = LaunchPayload(script="--no-python", args=["sh", "-c", f"touch {marker}"], nnodes=1, nproc_per_node=1,
                            node_rank=0, rdzv_endpoint="127.0.0.1:29999", rdzv_id="j-3", require_gpu=False)
    control_plane.send(command("launch", payload, id="l3", job="j", generation=1))
    [ack] = wait_for(lambda: control_plane.acks, timeout=20, what="the launch ack", interval=POLL_S)
    assert ack.status == "failed" and "invalid launch command: script: must be a relative path" in ack.detail
    assert running.agent.supervisor.running() == [] and control_plane.events_of("launched") == []
    assert not marker.exists()


def failing_generation(control_plane: Any, train_script: Path, tmp_path: Path, port: int, mode: str,
                       generation: int) -> tuple[Any, Any, Any, Any]:
    """Launch generation ``generation`` of job "j" whose rank 1 fails by ``mode``; the ``rank_gone``
    notice and the exit report, each as (event, detail), once the report has arrived."""
    out = tmp_path / f"out-{generation}"
    out.mkdir()
    payload = LaunchPayload(script="train.py", workdir=str(train_script.parent), args=[str(out), mode],
                            nnodes=1, nproc_per_node=2, node_rank=0, rdzv_endpoint=f"127.0.0.1:{port}",
                            rdzv_id=f"j-{generation}", require_gpu=False)
    control_plane.send(command("launch", payload, id=f"l{generation}", job="j", generation=generation))
    [(exited, report)] = wait_for(lambda: control_plane.events_of("exited"), timeout=90,
                                  what=f"the exit report of the rank that failed by {mode}", interval=POLL_S)
    [(notice, gone)] = control_plane.events_of("rank_gone")
    assert (notice.job, notice.generation) == ("j", generation) and notice.time <= exited.time
    return notice, gone, exited, report


def test_a_rank_gone_is_told_at_once_before_the_exit_report(control_plane: Any, agent_config: Callable[..., Any],
                                                            start_agent: Callable[..., Any], train_script: Path,
                                                            tmp_path: Path, free_port: Callable[[], int]) -> None:
    """Issue 20: the control plane hears that a rank died before torchrun has closed the rest of the
    group, so that it waits for the exit report instead of calling the silence a hang."""
    start_agent(agent_config())
    _, gone, _, report = failing_generation(control_plane, train_script, tmp_path, free_port(), "kill", 3)
    # The first sign: the dead worker, or rank 0's collective failing on it, whichever came first.
    assert report.rank_exited_at is not None and gone.at <= report.rank_exited_at
    kinds = [event.kind for event, _ in control_plane.events.values()]
    assert kinds.index("rank_gone") < kinds.index("exited")  # it was sent first, not with the report


def test_a_ranks_uncaught_exception_is_told_at_once_with_its_line(control_plane: Any, agent_config: Callable[..., Any],
                                                                  start_agent: Callable[..., Any], train_script: Path,
                                                                  tmp_path: Path, free_port: Callable[[], int]) -> None:
    """A raising rank can take seconds to exit (its atexit handlers, its threads): the notice goes
    when its exception is printed, not when it is gone."""
    start_agent(agent_config())
    _, gone, _, report = failing_generation(control_plane, train_script, tmp_path, free_port(), "raise", 4)
    assert gone.error_line == report.error_line == "ValueError: boom at step 40"
    assert report.rank_exited_at is not None and gone.at <= report.rank_exited_at
