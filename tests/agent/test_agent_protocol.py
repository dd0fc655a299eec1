"""The agent <-> control plane messages: what parses, what is refused, and why."""

from __future__ import annotations

from typing import Any

import pytest

from agents.protocol import ProtocolError, dump, parse
from agents.protocol.agent import (
    MAX_SAMPLES_PER_BATCH,
    AgentEvent,
    Command,
    EventBatch,
    ExitReport,
    GpuInfo,
    GpuSample,
    HealthCheck,
    HealthReport,
    Heartbeat,
    HeartbeatResponse,
    LaunchPayload,
    NcclProfileError,
    RankExit,
    Register,
    RunningGeneration,
    StopPayload,
    TelemetryBatch,
    compact,
    parse_command_payload,
    parse_event_details,
    snapshot_environment,
    validate_nccl_profile,
)

LAUNCH = {"script": "train.py", "nnodes": 2, "nproc_per_node": 8, "node_rank": 1,
          "rdzv_endpoint": "10.0.0.1:29400", "rdzv_id": "job-7-g3", "nccl_env": {"NCCL_DEBUG": "WARN"}}


@pytest.mark.parametrize("message", [
    Register(bootstrap_token="b", hostname="gpu-1", address="10.0.0.2", agent_version="0.1.0",
             labels={"rack": "r1"}, gpus=[GpuInfo(index=0, uuid="GPU-1", name="H100", memory_total=80 * 2**30)],
             gpu_telemetry=False, gpu_telemetry_reason="NVML did not initialise", probe_port=29510),
    Heartbeat(node_id="node-1", seq=3, time=1.7e9, running=[RunningGeneration(job="j", generation=2, pids=[10, 11])],
              spooled=5),
    HeartbeatResponse(commands=[Command(id="c1", kind="stop", idempotency_key="k1", job="j", generation=2,
                                        payload={"grace_s": 10})]),
    TelemetryBatch(samples=[GpuSample(node="node-1", gpu=1, time=1.7e9, temperature_c=92.5, xid_total=1,
                                      xid_recent=1, recent_xid_codes=[79], ecc_uncorrected_recent=0)]),
    EventBatch(events=[AgentEvent(key="k", kind="exited", time=1.7e9, job="j", generation=2, detail=compact(
        ExitReport(exit_code=1, ranks=[RankExit(rank=1, local_rank=1, signal=9, pid=42)], root_cause_rank=1,
                   signature="signal")))]),
], ids=lambda m: type(m).__name__)
def test_messages_survive_the_wire(message: Any) -> None:
    assert parse(type(message), dump(message)) == message


@pytest.mark.parametrize(("cls", "data", "field", "reason"), [
    (Heartbeat, {"node_id": "n", "seq": 1, "time": 1.0, "surprise": 1}, "surprise", "unknown field"),
    (Heartbeat, {"node_id": "n", "time": 1.0}, "seq", "required"),
    (Heartbeat, {"node_id": "n", "seq": "1", "time": 1.0}, "seq", "expected an integer"),
    (Heartbeat, {"node_id": "../etc", "seq": 1, "time": 1.0}, "node_id", "does not match"),
    (Heartbeat, {"node_id": "n", "seq": -1, "time": 1.0}, "seq", ">= 0"),
    (Command, {"id": "c", "kind": "reboot", "idempotency_key": "k"}, "kind", "must be one of"),
    (GpuSample, {"node": "n", "gpu": 0, "time": 1.0, "utilization_pct": 140}, "utilization_pct", "<= 100"),
    (GpuSample, {"node": "n", "gpu": 0, "time": 1.0, "memory_free": -5}, "memory_free", ">= 0"),
    (GpuSample, {"node": "n", "gpu": 64, "time": 1.0}, "gpu", "<= 63"),
    (AgentEvent, {"key": "k", "kind": "exited", "time": 1.0, "detail": "oops"}, "detail", "expected an object"),
    (LaunchPayload, {**LAUNCH, "snapshot_every": 0}, "snapshot_every", ">= 1"),
    (LaunchPayload, {**LAUNCH, "snapshot_every": 10_001}, "snapshot_every", "<= 10000"),
    (LaunchPayload, {**LAUNCH, "snapshot_every": True}, "snapshot_every", "expected an integer"),
    (LaunchPayload, {**LAUNCH, "branch_generation": -1}, "branch_generation", ">= 0"),
    (LaunchPayload, {**LAUNCH, "branch_generation": 2**31}, "branch_generation", "<= 2147483647"),
])
def test_malformed_messages_name_the_field(cls: type, data: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse(cls, data)
    assert caught.value.field == field
    assert reason in caught.value.reason


def test_a_launch_without_snapshot_fields_stays_as_it_was_and_exports_no_snapshot_variables() -> None:
    """What an agent that predates the fields is sent (``compact`` drops them) and what it sets."""
    plain = parse(LaunchPayload, LAUNCH)
    assert "snapshot_every" not in compact(plain) and "branch_generation" not in compact(plain)
    assert snapshot_environment(plain) == {}
    snapshots = parse(LaunchPayload, {**LAUNCH, "snapshot_every": 20, "branch_generation": 4})
    assert snapshot_environment(snapshots) == {"NIGHTWATCH_SNAPSHOT_EVERY": "20", "NIGHTWATCH_BRANCH_GENERATION": "4"}


def test_oversized_telemetry_batch_is_refused() -> None:
    sample = dump(GpuSample(node="n", gpu=0, time=1.0))
    with pytest.raises(ProtocolError, match=f"at most {MAX_SAMPLES_PER_BATCH} items"):
        parse(TelemetryBatch, {"samples": [sample] * (MAX_SAMPLES_PER_BATCH + 1)})


def test_command_payload_is_validated_by_kind() -> None:
    launch = Command(id="c", kind="launch", idempotency_key="k", job="j", generation=3, payload=LAUNCH)
    assert parse_command_payload(launch) == parse(LaunchPayload, LAUNCH)
    stop = Command(id="c", kind="stop", idempotency_key="k", job="j", generation=3, payload={})
    assert parse_command_payload(stop) == StopPayload()

    # The control plane may store payloads with dump() (null fields present): they parse the same.
    with_nulls = parse(HeartbeatResponse, {"commands": [dump(Command(
        id="c", kind="launch", idempotency_key="k", job="j", generation=3,
        payload=dump(parse(LaunchPayload, LAUNCH))))]}).commands[0]
    assert with_nulls.payload["hooks_url"] is None and parse_command_payload(with_nulls) == parse(LaunchPayload, LAUNCH)

    with pytest.raises(ProtocolError, match="needs a job and a generation"):
        parse_command_payload(Command(id="c", kind="stop", idempotency_key="k", payload={}))
    with pytest.raises(ProtocolError) as caught:
        parse_command_payload(Command(id="c", kind="launch", idempotency_key="k", job="j", generation=3,
                                      payload={**LAUNCH, "rdzv_endpoint": "no-port"}))
    assert caught.value.field == "payload.rdzv_endpoint"
    with pytest.raises(NcclProfileError, match="NCCL_DEBUG"):
        parse_command_payload(Command(id="c", kind="launch", idempotency_key="k", job="j", generation=3,
                                      payload={**LAUNCH, "nccl_env": {"NCCL_DEBUG": "LOUD"}}))


def test_event_details_are_validated_by_kind() -> None:
    good = AgentEvent(key="a", kind="health_check", time=1.0, detail=compact(HealthReport(
        ok=False, reason="hot", checks=[HealthCheck(name="temperature", gpu=1, ok=False, detail="hot", value=92)])))
    [(event, detail)] = parse_event_details(EventBatch(events=[good]))
    assert isinstance(detail, HealthReport) and detail.checks[0].value == 92

    wrong = AgentEvent(key="b", kind="exited", time=1.0, detail={"gpu": 0, "code": 79})  # an xid detail
    with pytest.raises(ProtocolError) as caught:
        parse_event_details(EventBatch(events=[good, wrong]))
    assert caught.value.field.startswith("events.1.detail")


# --- NCCL profiles -----------------------------------------------------------------------------

def test_a_typical_profile_passes_and_becomes_strings() -> None:
    profile = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_TIMEOUT": 1800,
               "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_SOCKET_IFNAME": "^lo,docker0",
               "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_IB_DISABLE": "0", "NCCL_P2P_DISABLE": "0",
               "GLOO_SOCKET_IFNAME": "eth0", "NCCL_ALGO": "Ring,Tree", "NCCL_TOPO_DUMP_FILE": "topo.xml"}
    assert validate_nccl_profile(profile) == {k: str(v) for k, v in profile.items()}


@pytest.mark.parametrize(("profile", "message"), [
    ({"NCCL_DEBG": "INFO"}, "NCCL_DEBG: unknown variable; did you mean NCCL_DEBUG?"),
    ({"NCCL_DEBUG": "LOUD"}, "NCCL_DEBUG: 'LOUD' must be one of VERSION, WARN, INFO, TRACE"),
    ({"NCCL_TIMEOUT": "0"}, "NCCL_TIMEOUT: '0' must be an integer from 1 to 86400"),
    ({"NCCL_TIMEOUT": "30m"}, "NCCL_TIMEOUT: '30m' must be an integer"),
    ({"TORCH_NCCL_BLOCKING_WAIT": "yes"}, "TORCH_NCCL_BLOCKING_WAIT: 'yes' must be one of 0, 1"),
    ({"NCCL_IB_DISABLE": True}, "NCCL_IB_DISABLE: expected a string such as '1', got True"),
    ({"NCCL_SOCKET_IFNAME": "eth0;reboot"}, "NCCL_SOCKET_IFNAME: 'eth0;reboot' must be a comma-separated list"),
    ({"GLOO_SOCKET_IFNAME": "^eth0"}, "GLOO_SOCKET_IFNAME: '^eth0' must be a comma-separated list of names"),
    ({"NCCL_PROTO": "LL,Fast"}, "NCCL_PROTO: 'LL,Fast' unknown 'Fast'"),
    # File variables are bare names, placed in the generation's log directory (nccl_environment).
    ({"NCCL_TOPO_DUMP_FILE": "/tmp/topo.xml"}, "must be a bare file name"),
    ({"NCCL_DEBUG_FILE": "../../etc/cron.d/x"}, "must be a bare file name"),
    ({"NCCL_DEBUG_FILE": "x\nNCCL_DEBUG=TRACE"}, "must not contain NUL or line breaks"),
    ({"NCCL_DEBUG_SUBSYS": "INIT\0"}, "must not contain NUL or line breaks"),
    # The agent sets these itself; a profile must not be able to override them.
    ({"NIGHTWATCH_GENERATION": "9"}, "NIGHTWATCH_GENERATION: unknown variable"),
    ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE: unknown variable"),
    ({"LD_PRELOAD": "/tmp/x.so"}, "LD_PRELOAD: unknown variable"),
])
def test_bad_profiles_are_refused_precisely(profile: dict[str, Any], message: str) -> None:
    with pytest.raises(NcclProfileError) as caught:
        validate_nccl_profile(profile)
    assert message in str(caught.value)
    assert caught.value.name == next(iter(profile))
