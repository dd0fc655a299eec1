"""The agent's configuration: a YAML file, then ``NIGHTWATCH_AGENT_*`` environment variables,
then command-line flags, each overriding the one before.

Every setting has the same name everywhere: ``heartbeat_interval_s`` in YAML is
``NIGHTWATCH_AGENT_HEARTBEAT_INTERVAL_S`` in the environment and ``--heartbeat-interval-s`` on
the command line. Mappings and lists (``labels``, ``health``, ``torchrun``) come from YAML only.
Secrets are better given as files (``bootstrap_token_file``) than as flags, which ``ps`` shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import types
import typing
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agents.health import HealthThresholds
from agents.telemetry import DEFAULT_SOURCE, SOURCES

ENV_PREFIX = "NIGHTWATCH_AGENT_"


@dataclass(frozen=True)
class AgentConfig:
    control_plane_url: str
    #: Where the agent's events (rank exits, Xids) and command acks go, when the control plane serves
    #: them from processes of their own (docker-compose's ``urgent`` service, docs/deployment.md), so
    #: that a verdict never waits behind the fleet's telemetry and step reports. Default: the
    #: control plane's URL (one proxy can route them by path instead).
    urgent_url: str | None = None
    work_dir: Path = Path("/var/lib/nightwatch-agent")
    #: Where job entrypoints (``examples/train.py``) are found when a launch names no workdir;
    #: default: the directory the agent was started in.
    code_dir: Path | None = None
    #: One-time token that registration exchanges for this node's own token.
    bootstrap_token: str | None = None
    bootstrap_token_file: Path | None = None
    #: Where the node token is kept (mode 0600); default ``<work_dir>/node-token.json``.
    node_token_file: Path | None = None
    hostname: str = field(default_factory=socket.gethostname)
    #: How peers reach this node (bandwidth probe); default: the host name.
    address: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    #: Until registration answers with the control plane's own interval.
    heartbeat_interval_s: float = 10.0
    telemetry_interval_s: float = 10.0
    #: Samples wait up to this long to share one request with the samples after them (0: each
    #: sample goes at once). An event or a command ack goes at once and takes them along. At the
    #: defaults a node sends a heartbeat every 10 s and telemetry every 30 s, not every 10 s.
    telemetry_batch_s: float = 30.0
    telemetry_source: str = DEFAULT_SOURCE
    scenario: Path | None = None
    #: Window of the Xid/ECC/NVLink rates that health rules judge.
    rate_window_s: float = 600.0
    spool_max_records: int = 100_000
    probe_port: int = 29510
    probe_host: str = "0.0.0.0"
    torchrun: list[str] = field(default_factory=list)
    #: Keep one torchrun launcher with torch already imported for the next generation (≈ 1 s
    #: faster restarts, one idle interpreter's memory). Only with the default ``torchrun``.
    warm_launcher: bool = True
    #: Fork each rank from a zygote of the warm launcher that has imported torch, DCP and the
    #: hooks, instead of starting a cold interpreter (``agents.supervisor.zygote``): a restart's
    #: ranks skip ≈ 1-2 s of start-up. Needs ``warm_launcher``; a generation it cannot serve
    #: warm starts cold.
    warm_workers: bool = False
    #: This node's memory for the ranks' in-memory snapshots (``NIGHTWATCH_SNAPSHOT_DIR`` of the
    #: hooks); default: theirs, ``/dev/shm/nightwatch``. Set it when several agents share one
    #: machine's memory (a demo, a benchmark), or the tmpfs is mounted elsewhere.
    snapshot_dir: Path | None = None
    #: Keep a long poll open for commands (``agents.agent.wake``), so that a stop or a launch is
    #: taken at once instead of with the next heartbeat. Off: commands come with heartbeats only.
    command_wait: bool = True
    stop_grace_s: float = 30.0
    #: Stop the jobs this agent runs when it is stopped cleanly (SIGTERM: node maintenance). With
    #: False they keep running and the next agent on the node adopts them (``Supervisor.adopt``), as
    #: it does after a crash: set it to upgrade agents without restarting jobs.
    stop_jobs_on_exit: bool = True
    log_max_bytes: int = 20 * 2**20
    log_backups: int = 5
    request_timeout_s: float = 5.0
    log_level: str = "INFO"
    health: dict[str, Any] = field(default_factory=dict)

    @property
    def token_path(self) -> Path:
        return self.node_token_file or self.work_dir / "node-token.json"

    @property
    def thresholds(self) -> HealthThresholds:
        return HealthThresholds.from_mapping(self.health)

    def read_bootstrap_token(self) -> str | None:
        if self.bootstrap_token:
            return self.bootstrap_token
        if self.bootstrap_token_file:
            return self.bootstrap_token_file.read_text().strip() or None
        return None


_HINTS = typing.get_type_hints(AgentConfig)
_SCALARS = {f.name for f in dataclasses.fields(AgentConfig)
            if typing.get_origin(_HINTS[f.name]) not in (dict, list)}


class ConfigError(ValueError):
    pass


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    parser = _parser()
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if args.config:
        values.update(_from_file(Path(args.config)))
    for name in _SCALARS:
        if (raw := environ.get(ENV_PREFIX + name.upper())) is not None:
            values[name] = _convert(name, raw, f"{ENV_PREFIX}{name.upper()}")
    for name in _SCALARS:
        if (raw := getattr(args, name)) is not None:
            values[name] = _convert(name, raw, f"--{name.replace('_', '-')}")
    return _validated(values)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nightwatch-agent", description="Nightwatch node agent.")
    parser.add_argument("--config", help="YAML configuration file")
    for name in sorted(_SCALARS):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None,
                            help=f"overrides '{name}' (env {ENV_PREFIX}{name.upper()})")
    return parser


def _from_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    known = {f.name for f in dataclasses.fields(AgentConfig)}
    out = {}
    for name, value in data.items():
        if name not in known:
            raise ConfigError(f"{path}: unknown setting {name!r}")
        out[name] = _convert(name, value, f"{path}: {name}")
    return out


def _convert(name: str, value: Any, where: str) -> Any:
    target = _HINTS[name]
    if isinstance(target, types.UnionType):  # X | None: convert to X
        target = next(t for t in typing.get_args(target) if t is not type(None))
    if value is None:
        return None
    try:
        if typing.get_origin(target) is dict:
            if not isinstance(value, dict):
                raise TypeError("expected a mapping")
            return {str(k): (str(v) if name == "labels" else v) for k, v in value.items()}
        if typing.get_origin(target) is list:
            if not isinstance(value, list):
                raise TypeError("expected a list")
            return [str(v) for v in value]
        if target is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"expected true or false, got {value!r}")
        if target in (int, float) and isinstance(value, bool):
            raise TypeError("expected a number")
        return target(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _validated(values: dict[str, Any]) -> AgentConfig:
    if not values.get("control_plane_url"):
        raise ConfigError("control_plane_url is required (YAML, NIGHTWATCH_AGENT_CONTROL_PLANE_URL or "
                          "--control-plane-url)")
    for name in ("control_plane_url", "urgent_url"):
        if (url := values.get(name)) is not None and urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ConfigError(f"{name} must be an http:// or https:// URL, got {url!r}")
    config = AgentConfig(**values)
    if config.telemetry_source not in SOURCES:
        raise ConfigError(f"telemetry_source must be one of {sorted(SOURCES)}, got {config.telemetry_source!r}")
    if config.telemetry_source == "scripted" and config.scenario is None:
        raise ConfigError("telemetry_source 'scripted' needs a scenario file (scenario)")
    for name in ("heartbeat_interval_s", "telemetry_interval_s", "rate_window_s", "request_timeout_s"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name} must be positive")
    if config.telemetry_batch_s < 0:
        raise ConfigError("telemetry_batch_s must not be negative")
    if config.spool_max_records < 100:
        raise ConfigError("spool_max_records must be at least 100")
    if config.snapshot_dir is not None and not config.snapshot_dir.is_absolute():
        raise ConfigError(f"snapshot_dir must be an absolute path, got {str(config.snapshot_dir)!r}")
    if not 0 <= config.probe_port <= 65535:
        raise ConfigError("probe_port must be 0..65535 (0: any free port)")
    try:
        config.thresholds  # noqa: B018 - validates the health overrides now, not at first launch
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return config
