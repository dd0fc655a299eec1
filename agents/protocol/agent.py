"""Messages between the node agent and the control plane.

All bodies are JSON objects validated with ``agents.protocol.parse`` on both ends. Every node
endpoint authenticates with ``Authorization: Bearer <node token>`` (the token returned by
registration); registration itself carries the one-time bootstrap token in its body.

=====  ==================================================  =================  =========================
verb   path                                                body               answer
=====  ==================================================  =================  =========================
POST   /api/v1/agents/register                             Register           201 RegisterResponse
POST   /api/v1/nodes/{node_id}/heartbeat                   Heartbeat          200 HeartbeatResponse
POST   /api/v1/nodes/{node_id}/telemetry                   TelemetryBatch     202
POST   /api/v1/nodes/{node_id}/events                      EventBatch         202
POST   /api/v1/nodes/{node_id}/commands/{command_id}/ack   CommandAck         200; 409 stale generation
=====  ==================================================  =================  =========================

Delivery is at-least-once in both directions, so both sides deduplicate:

- the agent replays spooled telemetry and events after an outage, in order; every ``AgentEvent``
  carries a unique ``key`` and the server ignores a key it has already stored (and still answers
  202). Samples are keyed by ``(node, gpu, time)``.
- the server re-sends a command in every heartbeat answer until it is acknowledged; the agent
  executes an ``idempotency_key`` once and acknowledges it again on every re-delivery.
- a command or ack for a generation older than the job's current one is answered 409; the agent
  then stops whatever it still runs of that generation (the generation is the fencing token).

``AgentEvent.detail`` and ``Command.payload`` depend on ``kind``; ``parse_event_details`` and
``parse_command_payload`` validate them with the classes in ``EVENT_DETAILS`` and
``COMMAND_PAYLOADS``; ``compact()`` encodes them without their null fields (``dump`` works too).

Old and new ends keep working together. ``parse`` refuses a field it does not know, so a field
added to a message defaults to None, meaning "as before", and the sender leaves it out while it is
None (``compact``, the form commands are stored in, drops it): an old agent still takes every
launch that does not use the new field, and a new agent reads a missing one as "as before". A
launch that does use one (``snapshot_every``) is refused by an old agent, naming the field: the job
asked for something that node cannot do. An event kind added for the agent to send (``rank_gone``)
is refused by an old server as malformed; the agent's outbox then splits the batch and drops that
one record (``agents.agent.outbox``), so the rest of the batch (the exit report) still arrives and
the old server works as before, without the notice.

Times are Unix epoch seconds (UTC), memory is in bytes.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agents.protocol.base import MAX_TIME, ProtocolError, dump, field, parse

REGISTER_PATH = "/api/v1/agents/register"
HEARTBEAT_PATH = "/api/v1/nodes/{node_id}/heartbeat"
TELEMETRY_PATH = "/api/v1/nodes/{node_id}/telemetry"
EVENTS_PATH = "/api/v1/nodes/{node_id}/events"
ACK_PATH = "/api/v1/nodes/{node_id}/commands/{command_id}/ack"
#: The agent's long poll (GET, ``?timeout=S``): answered CommandWaitResponse as soon as a command
#: waits for the node, or when the timeout passes (``nodes.services.wake``).
COMMAND_WAIT_PATH = "/api/v1/nodes/{node_id}/commands/wait"

#: Identifiers that end up in URL paths and file names: no slashes, no spaces, no dot-dot.
ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}"
MAX_GPUS = 64
MAX_SAMPLES_PER_BATCH = 1024
MAX_EVENTS_PER_BATCH = 256
MAX_COMMANDS_PER_HEARTBEAT = 64
MAX_LOG_TAIL_LINES = 80
MAX_LOG_LINE = 500
MAX_SCRIPT = 500
MAX_MODULE = 200
#: A job's ``checkpoint_policy.snapshot_every`` and the launch's: beyond this a snapshot is as rare
#: as a disk checkpoint, which is cheaper to keep.
MAX_SNAPSHOT_EVERY = 10_000
#: A job's ``restart_policy.inprocess_restarts`` and the launch's: per rank slot and generation.
MAX_INPROCESS_RESTARTS = 100
#: The variable that carries it to the ranks (read by ``agents.hooks.inprocess`` and the warm client).
INPROCESS_RESTARTS_ENV = "NIGHTWATCH_INPROCESS_RESTARTS"

COMMAND_KINDS = ("launch", "stop", "drain", "health_check")
ACK_STATUSES = ("done", "refused", "failed")
EVENT_KINDS = ("agent_started", "launched", "launch_refused", "exited", "stopped", "health_check",
               "drain_ack", "telemetry_dropped", "xid", "rank_gone")
#: Why a generation ended, as read from exit codes and the log (``None``: clean exit).
EXIT_SIGNATURES = ("oom", "nccl_timeout", "nccl_watchdog", "cuda_error", "xid", "paused",
                   "stale_generation", "resume_refused", "traceback", "signal", "unknown")
#: The job's own pre-flight checks (``agents.preflight``): a failure is the job's, not the node's.
JOB_CHECKS = ("entrypoint", "checkpoint_dir")
HEALTH_CHECKS = ("gpu_reachable", "temperature", "ecc", "xid", "nvlink", "memory_free", "row_remap", *JOB_CHECKS)


# --- registration -----------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuInfo:
    index: int = field(min=0, max=MAX_GPUS - 1)
    uuid: str = field(max_len=96)
    name: str = field(max_len=128)
    memory_total: int = field(min=0)


@dataclass(frozen=True)
class Register:
    bootstrap_token: str = field(max_len=256)
    hostname: str = field(max_len=253)
    #: Where peers reach this node (bandwidth probe, rendezvous): a host name or an IP address.
    address: str = field(max_len=253)
    agent_version: str = field(max_len=32)
    labels: dict[str, str] = field(default_factory=dict, max_len=32)
    gpus: list[GpuInfo] = field(default_factory=list, max_len=MAX_GPUS)
    gpu_telemetry: bool = True
    #: Set when ``gpu_telemetry`` is false: the reason, shown to operators as is.
    gpu_telemetry_reason: str | None = field(default=None, max_len=500)
    probe_port: int | None = field(default=None, min=1, max=65535)
    #: A random id the agent keeps until it holds its node token. A retry whose answer was lost
    #: (a timeout) presents the used bootstrap token with the same id and gets its node back.
    attempt: str | None = field(default=None, pattern=r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class RegisterResponse:
    node_id: str = field(pattern=ID_PATTERN)
    node_token: str = field(max_len=256)
    heartbeat_interval_s: float = field(min=0.05, max=3600)


# --- heartbeat and commands -------------------------------------------------------------------

@dataclass(frozen=True)
class RunningGeneration:
    job: str = field(pattern=ID_PATTERN)
    generation: int = field(min=0)
    #: torchrun and every process below it, so the server can show what "running" means.
    pids: list[int] = field(default_factory=list, max_len=4096)
    started_at: float = field(default=0.0, min=0, max=MAX_TIME)


@dataclass(frozen=True)
class Heartbeat:
    node_id: str = field(pattern=ID_PATTERN)
    seq: int = field(min=0)
    time: float = field(min=0, max=MAX_TIME)
    running: list[RunningGeneration] = field(default_factory=list, max_len=64)
    gpu_telemetry: bool = True
    gpu_telemetry_reason: str | None = field(default=None, max_len=500)
    draining: bool = False
    #: Records waiting in the agent's disk spool (non-zero after an outage, while replaying).
    spooled: int = field(default=0, min=0)
    telemetry_dropped: int = field(default=0, min=0)
    #: The interval this agent heartbeats at now. Sent by agents that follow the answer's
    #: ``heartbeat_interval_s`` (heartbeat pacing); None: an older agent, kept at the configured interval.
    interval_s: float | None = field(default=None, min=0, max=3600)


@dataclass(frozen=True)
class Command:
    id: str = field(pattern=ID_PATTERN)
    kind: str = field(choices=COMMAND_KINDS)
    idempotency_key: str = field(max_len=128)
    job: str | None = field(default=None, pattern=ID_PATTERN)
    generation: int | None = field(default=None, min=0)
    #: Null values allowed: a payload dumped with ``dump`` (not ``compact``) still parses.
    payload: dict[str, Any | None] = field(default_factory=dict, max_len=64)


@dataclass(frozen=True)
class HeartbeatResponse:
    commands: list[Command] = field(default_factory=list, max_len=MAX_COMMANDS_PER_HEARTBEAT)
    #: When to heartbeat next, in seconds: the fleet's paced interval. Only to an agent whose
    #: heartbeat gave ``interval_s`` (left out otherwise, so an older agent parses the answer).
    heartbeat_interval_s: float | None = field(default=None, min=0.05, max=3600)


@dataclass(frozen=True)
class CommandWaitResponse:
    #: True: a command waits for the node (heartbeat now to take it); False: the timeout passed.
    commands: bool


@dataclass(frozen=True)
class CommandAck:
    command_id: str = field(pattern=ID_PATTERN)
    idempotency_key: str = field(max_len=128)
    status: str = field(choices=ACK_STATUSES)
    time: float = field(min=0, max=MAX_TIME)
    job: str | None = field(default=None, pattern=ID_PATTERN)
    generation: int | None = field(default=None, min=0)
    detail: str = field(default="", max_len=2000)


@dataclass(frozen=True)
class ProbePeer:
    node: str = field(pattern=ID_PATTERN)
    address: str = field(max_len=253)
    port: int = field(min=1, max=65535)
    expected_mbps: float = field(min=0.001)


@dataclass(frozen=True)
class LaunchPayload:
    """What torchrun needs for one node of one generation; the hooks' settings ride along."""

    nnodes: int = field(min=1, max=4096)
    nproc_per_node: int = field(min=1, max=64)
    node_rank: int = field(min=0, max=4095)
    rdzv_endpoint: str = field(pattern=r"[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}")
    rdzv_id: str = field(pattern=ID_PATTERN)
    #: What torchrun runs, exactly one of the two (``validate_launch_target``): a ``.py`` file of the
    #: code directory (``workdir``), or a module of it run as ``python -m``.
    script: str | None = field(default=None, max_len=1024)
    module: str | None = field(default=None, max_len=MAX_MODULE)
    #: Passed verbatim after the script: never split, trimmed or read by a shell.
    args: list[str] = field(default_factory=list, max_len=256)
    #: Validated by ``validate_nccl_profile`` (names and values).
    nccl_env: dict[str, str] = field(default_factory=dict, max_len=64)
    #: Whether this node hosts the rendezvous store: node rank 0 (the endpoint's address). The
    #: agent's static rendezvous follows the node rank; agents that used c10d's rendezvous took it
    #: as ``--rdzv-conf=is_host``, and the control plane still sends it for them.
    rdzv_is_host: bool = False
    hooks_url: str | None = field(default=None, max_len=1024)
    hooks_token: str | None = field(default=None, max_len=256)
    ckpt_dir: str | None = field(default=None, max_len=1024)
    resume_from: str | None = field(default=None, max_len=1024)
    workdir: str | None = field(default=None, max_len=1024)
    #: A CPU-only job (gloo) may launch on a node without GPU telemetry; a GPU job may not.
    require_gpu: bool = True
    #: Global sample ranges [start, end) to skip, chosen by a rollback (NIGHTWATCH_SKIP_DATA).
    skip_data: list[list[int]] = field(default_factory=list, max_len=64)
    #: The job's other nodes: before launching, the agent measures its bandwidth to each and refuses
    #: the launch when a pair falls below the expected ratio (the pre-launch pairwise probe).
    probe_peers: list[ProbePeer] = field(default_factory=list, max_len=64)
    probe_bytes: int = field(default=16 * 2**20, min=2**16, max=2**32)
    probe_seconds: float = field(default=2.0, min=0.1, max=60)
    #: In-memory snapshots every this many steps (NIGHTWATCH_SNAPSHOT_EVERY); None: not set, the
    #: script's own choice. Sent only when the job's policy sets it (see the module docstring).
    snapshot_every: int | None = field(default=None, min=1, max=MAX_SNAPSHOT_EVERY)
    #: The first generation of the job's lineage branch (NIGHTWATCH_BRANCH_GENERATION): a snapshot
    #: of an earlier one belongs to history a rollback left and is never restored. None: not set,
    #: and the hooks restore only snapshots of their own generation.
    branch_generation: int | None = field(default=None, min=0, max=2**31 - 1)
    #: In-process restarts (``agents.hooks.inprocess``): a rank that crashes on this node is replaced
    #: in its generation up to this many times, the other ranks keeping their interpreters. Needs the
    #: agent's warm workers (a node without them starts the generation as before). None: off.
    inprocess_restarts: int | None = field(default=None, min=1, max=MAX_INPROCESS_RESTARTS)


@dataclass(frozen=True)
class StopPayload:
    grace_s: float = field(default=30.0, min=0, max=600)
    reason: str = field(default="", max_len=500)


@dataclass(frozen=True)
class DrainPayload:
    reason: str = field(default="", max_len=500)


@dataclass(frozen=True)
class HealthCheckPayload:
    peers: list[ProbePeer] = field(default_factory=list, max_len=64)
    probe_bytes: int = field(default=64 * 2**20, min=2**16, max=2**32)
    probe_seconds: float = field(default=5.0, min=0.1, max=60)
    #: False for CPU-only (gloo) nodes, which have no GPU telemetry to judge.
    require_gpu: bool = True


# --- what a launch runs ----------------------------------------------------------------------
# Checked here, in the protocol, so that the control plane refuses a bad spec when the job is
# created and the agent (and the Slurm script) refuse it again before launching: one definition.
# The script becomes torchrun's positional ``training_script``, after all of torchrun's own
# options; a value starting with "-" would be read as one of them (``--no-python`` turns the
# arguments into an arbitrary command), so no segment of a script may start with anything but a
# letter, digit or "_".

class LaunchSpecError(ProtocolError):
    """A launch names a script, module or environment variable it may not; ``field`` says which."""


_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}"
#: A relative path of a ``.py`` file: no ``..``, no hidden or empty segment, nothing absolute.
SCRIPT_PATTERN = rf"(?:{_SEGMENT}/){{0,15}}{_SEGMENT}\.py"
MODULE_PATTERN = r"[A-Za-z_][A-Za-z0-9_]{0,99}(?:\.[A-Za-z_][A-Za-z0-9_]{0,99}){0,15}"
#: ``python -m`` finds these before the code directory (builtin and frozen modules) or they turn
#: their arguments into code (``pdb -c``, ``timeit -s``, ``runpy``): never a training module.
RESERVED_MODULES = frozenset(sys.stdlib_module_names) | frozenset(sys.builtin_module_names)


def script_problem(value: str) -> str | None:
    """Why ``value`` cannot be a job's script, or None."""
    if len(value) > MAX_SCRIPT or not re.fullmatch(SCRIPT_PATTERN, value):
        return (f"must be a relative path to a .py file inside the code directory, at most {MAX_SCRIPT} "
                "characters: letters, digits, '.', '_', '-' and '/'; no '..', no segment starting with '.' "
                "or '-', not absolute")
    return None


def module_problem(value: str) -> str | None:
    """Why ``value`` cannot be a job's module, or None."""
    if len(value) > MAX_MODULE or not re.fullmatch(MODULE_PATTERN, value):
        return f"must be a dotted Python module name such as pkg.train, at most {MAX_MODULE} characters"
    if value.split(".")[0] in RESERVED_MODULES:
        return f"{value.split('.')[0]!r} is a standard-library module; name a module of the code directory"
    return None


def validate_launch_target(script: str | None, module: str | None) -> None:
    """Exactly one of ``script`` and ``module``, each well-formed; ``LaunchSpecError`` otherwise."""
    if (script is None) == (module is None):
        raise LaunchSpecError("script", "give exactly one of script and module")
    field_name, problem = ("script", script_problem(script)) if script is not None else (
        "module", module_problem(module or ""))
    if problem:
        raise LaunchSpecError(field_name, problem)


def module_files(module: str) -> list[tuple[str, ...]]:
    """The files, relative to the code directory, that make ``module`` one of its own: each
    alternative is complete. Every package on the way needs its ``__init__.py``: a namespace
    package would let a regular package of the same name elsewhere on ``sys.path`` win."""
    *packages, last = module.split(".")
    inits = tuple("/".join([*packages[:i + 1], "__init__.py"]) for i in range(len(packages)))
    base = "/".join([*packages, last])
    return [(*inits, f"{base}.py"), (*inits, f"{base}/__init__.py", f"{base}/__main__.py")]


# --- NCCL environment profile ----------------------------------------------------------------
# Validated here too, for the same reason: same rules on both ends.

class NcclProfileError(LaunchSpecError):
    """A job's NCCL profile names an unknown variable or gives one a bad value."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"nccl_env.{name}", reason)
        self.name = name


def _one_of(*allowed: str, case: bool = True) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        ok = value in allowed if case else value.lower() in {a.lower() for a in allowed}
        return None if ok else f"must be one of {', '.join(allowed)}"
    return check


def _int_range(low: int, high: int) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        if not re.fullmatch(r"-?[0-9]+", value) or not low <= int(value) <= high:
            return f"must be an integer from {low} to {high}"
        return None
    return check


def _name_list(item: str, *, prefixes: str = "", names: tuple[str, ...] = ()) -> Callable[[str], str | None]:
    """A comma-separated list (NCCL's ``^`` excludes, ``=`` matches exactly) of names or ``item``s."""
    def check(value: str) -> str | None:
        body = value[1:] if value[:1] and value[:1] in prefixes else value
        parts = body.split(",")
        if names:
            bad = [p for p in parts if p.lower() not in {n.lower() for n in names}]
            return f"unknown {bad[0]!r}; expected a comma-separated list of {', '.join(names)}" if bad else None
        if not all(re.fullmatch(item, p) for p in parts):
            prefixed = f" (optionally prefixed by {' or '.join(prefixes)})" if prefixes else ""
            return f"must be a comma-separated list of names{prefixed}"
        return None
    return check


def _file_name(value: str) -> str | None:
    """A file NCCL writes: only its name; the launcher places it in the generation's log directory."""
    if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.%-]{0,99}", value):
        return None
    return ("must be a bare file name (letters, digits, '.', '_', '-', NCCL's %h and %p); it is written "
            "to the generation's log directory")


_FLAG = _one_of("0", "1")
_IFNAME = r"[A-Za-z0-9_.:-]{1,32}"
_TOPO_LEVEL = _one_of("LOC", "NVL", "PIX", "PXB", "PHB", "SYS", "0", "1", "2", "3", "4", "5")
NCCL_PROFILE_RULES: dict[str, Callable[[str], str | None]] = {
    "TORCH_NCCL_BLOCKING_WAIT": _FLAG,
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": _one_of("0", "1", "2", "3"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": _FLAG,
    "TORCH_NCCL_ENABLE_MONITORING": _FLAG,
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": _int_range(1, 86400),
    "TORCH_NCCL_TRACE_BUFFER_SIZE": _int_range(0, 10_000_000),
    "TORCH_NCCL_DESYNC_DEBUG": _FLAG,
    "NCCL_ASYNC_ERROR_HANDLING": _FLAG,  # the pre-2.2 name of TORCH_NCCL_ASYNC_ERROR_HANDLING
    "NCCL_TIMEOUT": _int_range(1, 86400),
    "NCCL_DEBUG": _one_of("VERSION", "WARN", "INFO", "TRACE"),
    "NCCL_DEBUG_SUBSYS": _name_list("", prefixes="^", names=(
        "INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "CALL", "PROXY", "NVLS",
        "BOOTSTRAP", "REG", "PROFILE", "RAS", "ALL")),
    "NCCL_DEBUG_FILE": _file_name,
    "NCCL_TOPO_DUMP_FILE": _file_name,
    "NCCL_SOCKET_IFNAME": _name_list(_IFNAME, prefixes="^="),
    "GLOO_SOCKET_IFNAME": _name_list(_IFNAME),
    "NCCL_IB_HCA": _name_list(r"[A-Za-z0-9_.-]{1,32}(:[0-9]{1,3})?", prefixes="^="),
    "NCCL_IB_DISABLE": _FLAG,
    "NCCL_IB_TIMEOUT": _int_range(1, 31),
    "NCCL_IB_RETRY_CNT": _int_range(0, 7),
    "NCCL_IB_GID_INDEX": _int_range(0, 255),
    "NCCL_IB_TC": _int_range(0, 255),
    "NCCL_IB_SL": _int_range(0, 15),
    "NCCL_P2P_DISABLE": _FLAG,
    "NCCL_SHM_DISABLE": _FLAG,
    "NCCL_NVLS_ENABLE": _FLAG,
    "NCCL_CUMEM_ENABLE": _FLAG,
    "NCCL_P2P_LEVEL": _TOPO_LEVEL,
    "NCCL_NET_GDR_LEVEL": _TOPO_LEVEL,
    "NCCL_SOCKET_NTHREADS": _int_range(1, 16),
    "NCCL_NSOCKS_PERTHREAD": _int_range(1, 64),
    "NCCL_BUFFSIZE": _int_range(1, 2**31),
    "NCCL_MIN_NCHANNELS": _int_range(1, 64),
    "NCCL_MAX_NCHANNELS": _int_range(1, 64),
    "NCCL_ALGO": _name_list("", prefixes="^", names=(
        "Ring", "Tree", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT")),
    "NCCL_PROTO": _name_list("", prefixes="^", names=("LL", "LL128", "Simple")),
}


def validate_nccl_profile(env: Mapping[str, Any]) -> dict[str, str]:
    """The profile as environment strings; ``NcclProfileError`` names the first bad entry.

    Only the names above are accepted: a typo (``NCCL_DEBG``) would otherwise be ignored by
    NCCL in silence, and a profile must never override what the agent sets itself.
    """
    out: dict[str, str] = {}
    for name, raw in env.items():
        rule = NCCL_PROFILE_RULES.get(name)
        if rule is None:
            close = difflib.get_close_matches(name, NCCL_PROFILE_RULES, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; allowed: {', '.join(sorted(NCCL_PROFILE_RULES))}"
            raise NcclProfileError(name, "unknown variable" + hint)
        if isinstance(raw, bool) or not isinstance(raw, (str, int)):
            raise NcclProfileError(name, f"expected a string such as '1', got {raw!r}")
        value = str(raw)
        # Every rule is an allow-list already; this one holds for any rule added later.
        if any(c in value for c in "\0\n\r"):
            raise NcclProfileError(name, "must not contain NUL or line breaks")
        problem = rule(value)
        if problem:
            raise NcclProfileError(name, f"{value!r} {problem}")
        out[name] = value
    return out


#: Profile variables naming a file NCCL writes; the profile gives a bare name (``_file_name``).
NCCL_FILE_VARIABLES = ("NCCL_DEBUG_FILE", "NCCL_TOPO_DUMP_FILE")


def nccl_environment(profile: Mapping[str, Any], log_dir: str, prefix: str = "") -> dict[str, str]:
    """The validated profile as it is exported: file names become ``log_dir/prefix+name``, so a
    job can never make NCCL write anywhere but its generation's log directory."""
    env = validate_nccl_profile(profile)
    for name in NCCL_FILE_VARIABLES:
        if name in env:
            env[name] = f"{log_dir.rstrip('/')}/{prefix}{env[name]}"
    return env


def snapshot_environment(payload: LaunchPayload) -> dict[str, str]:
    """The hooks' snapshot variables for ``payload`` (``agents.hooks.settings``), as the agent's
    supervisor and the Slurm script both export them: none when the launch sets no snapshots, so
    the script's own ``Hooks(snapshot_every=)`` stands and a snapshot of another generation is never
    restored."""
    if not payload.snapshot_every:
        return {}
    env = {"NIGHTWATCH_SNAPSHOT_EVERY": str(payload.snapshot_every)}
    if payload.branch_generation is not None:
        env["NIGHTWATCH_BRANCH_GENERATION"] = str(payload.branch_generation)
    return env


def inprocess_environment(payload: LaunchPayload) -> dict[str, str]:
    """The variables of in-process restarts for ``payload`` (``agents.hooks.inprocess``): the budget,
    and torchrun's rendezvous store shared with its workers (the rounds meet there, since it outlives
    every worker; with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` rank 0 would host it and take it along
    when it dies). Only for a supervisor whose ranks are forked warm, which can replace one."""
    if not payload.inprocess_restarts:
        return {}
    return {INPROCESS_RESTARTS_ENV: str(payload.inprocess_restarts)}


def validate_launch(payload: LaunchPayload) -> None:
    """What the wire schema cannot say about a launch: its target, its arguments, its profile."""
    validate_launch_target(payload.script, payload.module)
    for index, arg in enumerate(payload.args):
        if "\0" in arg:  # execve could not pass it; refused, never cut short
            raise LaunchSpecError(f"args.{index}", "must not contain NUL")
    validate_nccl_profile(payload.nccl_env)


COMMAND_PAYLOADS: dict[str, type] = {
    "launch": LaunchPayload,
    "stop": StopPayload,
    "drain": DrainPayload,
    "health_check": HealthCheckPayload,
}


def compact(message: Any) -> dict[str, Any]:
    """``dump(message)`` without its null fields: the form of event details and command payloads."""
    return {k: v for k, v in dump(message).items() if v is not None}


def parse_command_payload(command: Command) -> Any:
    """The validated payload object of ``command`` (its class depends on ``kind``)."""
    if command.kind in ("launch", "stop") and (command.job is None or command.generation is None):
        raise ProtocolError("generation", f"a {command.kind} command needs a job and a generation")
    payload: object = parse(COMMAND_PAYLOADS[command.kind], command.payload, path="payload")
    if isinstance(payload, LaunchPayload):
        validate_launch(payload)
    return payload


# --- telemetry --------------------------------------------------------------------------------

def _count(default: int | None = None) -> Any:
    return field(default=default, min=0)


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment. ``None`` means the counter is not supported on this GPU/driver.

    ``*_recent`` fields are the increase within the last ``window_s`` seconds: health rules use
    them rather than the lifetime totals, so that one error long ago does not condemn a node.
    """

    node: str = field(pattern=ID_PATTERN)
    gpu: int = field(min=0, max=MAX_GPUS - 1)
    time: float = field(min=0, max=MAX_TIME)
    reachable: bool = True
    temperature_c: float | None = field(default=None, min=-50, max=200)
    memory_used: int | None = _count()
    memory_free: int | None = _count()
    utilization_pct: float | None = field(default=None, min=0, max=100)
    power_w: float | None = field(default=None, min=0, max=10_000)
    sm_clock_mhz: int | None = _count()
    #: NVML clocks-event (throttle) reasons bitmask, e.g. 0x40 hardware thermal slowdown.
    throttle_reasons: int | None = _count()
    ecc_corrected_volatile: int | None = _count()
    ecc_uncorrected_volatile: int | None = _count()
    ecc_corrected_aggregate: int | None = _count()
    ecc_uncorrected_aggregate: int | None = _count()
    ecc_corrected_recent: int | None = _count()
    ecc_uncorrected_recent: int | None = _count()
    retired_pages: int | None = _count()
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = _count()
    remapped_rows_uncorrectable: int | None = _count()
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    xid_total: int = _count(0)
    xid_recent: int = _count(0)
    #: Distinct Xid codes seen within the window, most recent last.
    recent_xid_codes: list[int] = field(default_factory=list, max_len=16)
    nvlink_replay_errors: int | None = _count()
    nvlink_recovery_errors: int | None = _count()
    nvlink_crc_flit_errors: int | None = _count()
    nvlink_crc_data_errors: int | None = _count()
    nvlink_errors_recent: int | None = _count()
    pcie_replays: int | None = _count()
    window_s: float = field(default=600.0, min=1, max=7 * 86400)


@dataclass(frozen=True)
class TelemetryBatch:
    samples: list[GpuSample] = field(max_len=MAX_SAMPLES_PER_BATCH)


# --- events -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class AgentEvent:
    #: Unique per event, fixed when the event is created: the server's deduplication key.
    key: str = field(max_len=128)
    kind: str = field(choices=EVENT_KINDS)
    time: float = field(min=0, max=MAX_TIME)
    job: str | None = field(default=None, pattern=ID_PATTERN)
    generation: int | None = field(default=None, min=0)
    detail: dict[str, Any | None] = field(default_factory=dict, max_len=32)


@dataclass(frozen=True)
class EventBatch:
    events: list[AgentEvent] = field(max_len=MAX_EVENTS_PER_BATCH)


#: Lines of training output per ``LogBatch``; the agent ships more in several.
MAX_LOG_LINES_PER_BATCH = 1000
#: Characters of one shipped line; a longer line arrives in pieces.
MAX_SHIPPED_LINE = 4096


@dataclass(frozen=True)
class LogBatch:
    """Lines of one generation's torchrun output on this node, in order (``POST /nodes/{id}/logs``).

    ``first_line`` numbers ``lines[0]`` in the generation's output on this node (from 0), so a batch
    sent twice is stored once, and a gap says how many lines the agent's bounded buffer dropped."""

    job: str = field(pattern=ID_PATTERN)
    generation: int = field(min=0)
    first_line: int = field(min=0)
    lines: list[str] = field(max_len=MAX_LOG_LINES_PER_BATCH)


@dataclass(frozen=True)
class RankExit:
    rank: int = field(min=0)
    local_rank: int = field(min=0)
    exit_code: int | None = None
    #: The signal that ended the rank (9 for SIGKILL), when it did not exit on its own.
    signal: int | None = field(default=None, min=1, max=64)
    pid: int | None = field(default=None, min=1)


@dataclass(frozen=True)
class ExitReport:
    """Detail of ``exited``: how a generation ended on this node, with the evidence."""

    #: torchrun's own exit status (negative: killed by that signal); ``None`` if unknown.
    exit_code: int | None = None
    #: Ranks that torchrun reported as failed; ranks not listed exited 0.
    ranks: list[RankExit] = field(default_factory=list, max_len=1024)
    #: The first rank to fail, as torchrun saw it.
    root_cause_rank: int | None = field(default=None, min=0)
    signature: str | None = field(default=None, choices=EXIT_SIGNATURES)
    #: The last line of the last traceback (``RuntimeError: ...``), when there is one.
    error_line: str | None = field(default=None, max_len=MAX_LOG_LINE)
    log_tail: list[str] = field(default_factory=list, max_len=MAX_LOG_TAIL_LINES)
    log_path: str = field(default="", max_len=1024)
    #: True when the agent stopped the generation on command (not a failure).
    requested_stop: bool = False
    runtime_s: float = field(default=0.0, min=0)
    #: Unix time (the node's clock) the generation was first seen failing or ending: torchrun
    #: closing its worker group, or its exit; for a generation that ended while no agent watched
    #: it, its log's last write. The control plane dates the fault from it (the event's own time
    #: is when the report was made, which after an agent restart is much later).
    ended_at: float | None = field(default=None, min=0, max=MAX_TIME)
    #: Unix time (the node's clock) the agent first found one of torchrun's workers gone: a rank
    #: died (at most one watch tick earlier), before torchrun noticed it. None if it saw none.
    rank_exited_at: float | None = field(default=None, min=0, max=MAX_TIME)
    #: torchrun's own time of the failure: when it first logged it (closing the worker group, or a
    #: failed worker's error; a monitor interval after the rank died), from the log line's
    #: timestamp. None without such a line.
    torchrun_failed_at: float | None = field(default=None, min=0, max=MAX_TIME)
    #: Xid codes seen on this node while the generation ran.
    xids: list[int] = field(default_factory=list, max_len=64)


@dataclass(frozen=True)
class RankGone:
    """Detail of ``rank_gone``: a rank of a running generation is going down, told at the first
    sign, before torchrun has closed the rest of the group and exited (the ``exited`` report that
    follows, seconds later, has the evidence). The control plane waits for that report instead of
    taking the silent generation for hung."""

    #: Unix time (the node's clock) of the sign: one of torchrun's workers found gone (one watch
    #: tick at most after it ended: the ``exited`` report's ``rank_exited_at``), or the last line of
    #: a rank's uncaught exception read from the output (the rank may take seconds more to exit).
    at: float = field(min=0, max=MAX_TIME)
    #: That line (``[rank0]: RuntimeError: ...`` without the prefix); None: a worker found gone.
    error_line: str | None = field(default=None, max_len=MAX_LOG_LINE)
    #: The agent killed the rank's worker because it had been stopped (state T) this many seconds: a
    #: hung rank, replaced in process (``agents.supervisor``, ``STOPPED_WORKER_KILL_S``); ``at`` is
    #: when it was first seen stopped. None: the rank died on its own.
    stopped_s: float | None = field(default=None, min=0, max=MAX_TIME)


@dataclass(frozen=True)
class LaunchedDetail:
    pid: int = field(min=1)
    log_path: str = field(max_len=1024)
    command: list[str] = field(default_factory=list, max_len=512)
    #: Started by the node's warm launcher (torch already imported), not a cold interpreter.
    warm: bool = False


@dataclass(frozen=True)
class HealthCheck:
    name: str = field(choices=HEALTH_CHECKS)
    ok: bool = field()
    detail: str = field(max_len=500)
    gpu: int | None = field(default=None, min=0, max=MAX_GPUS - 1)
    value: float | None = None
    limit: float | None = None


@dataclass(frozen=True)
class BandwidthResult:
    peer: str = field(pattern=ID_PATTERN)
    address: str = field(max_len=253)
    expected_mbps: float = field(min=0)
    ok: bool = field()
    mbps: float | None = field(default=None, min=0)
    error: str | None = field(default=None, max_len=500)


@dataclass(frozen=True)
class HealthReport:
    """Detail of ``health_check`` and ``launch_refused``: every check, passed or failed."""

    ok: bool
    reason: str = field(default="", max_len=2000)
    checks: list[HealthCheck] = field(default_factory=list, max_len=1024)
    bandwidth: list[BandwidthResult] = field(default_factory=list, max_len=64)


@dataclass(frozen=True)
class DrainAck:
    reason: str = field(default="", max_len=500)
    running: list[RunningGeneration] = field(default_factory=list, max_len=64)


@dataclass(frozen=True)
class TelemetryDropped:
    #: Samples dropped since the previous ``telemetry_dropped`` event, and since agent start.
    count: int = field(min=1)
    total: int = field(min=1)


@dataclass(frozen=True)
class XidDetail:
    gpu: int = field(min=0, max=MAX_GPUS - 1)
    code: int = field(min=0)


@dataclass(frozen=True)
class AgentStarted:
    agent_version: str = field(max_len=32)
    gpu_telemetry: bool = field()
    gpu_telemetry_reason: str | None = field(default=None, max_len=500)


EVENT_DETAILS: dict[str, type] = {
    "agent_started": AgentStarted,
    "launched": LaunchedDetail,
    "launch_refused": HealthReport,
    "exited": ExitReport,
    "stopped": ExitReport,
    "health_check": HealthReport,
    "drain_ack": DrainAck,
    "telemetry_dropped": TelemetryDropped,
    "xid": XidDetail,
    "rank_gone": RankGone,
}


def parse_event_details(batch: EventBatch) -> list[tuple[AgentEvent, Any]]:
    """Each event of a parsed batch with its validated detail object (class by ``kind``)."""
    return [(event, parse(EVENT_DETAILS[event.kind], event.detail, path=f"events.{i}.detail"))
            for i, event in enumerate(batch.events)]
