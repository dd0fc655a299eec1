"""Registration: trade the one-time bootstrap token for this node's own token, and keep it.

The node token file is created with mode 0600 (never readable by others, not even for a moment)
and replaced atomically, so a crash never leaves half a token behind.

An answer can be lost after the control plane used the bootstrap token up (a timeout, a crash
before the token was saved). So the agent makes a random attempt id before its first try, keeps
it next to the token file until it holds its token, and sends it with every try: the control
plane answers a retry with the same id with the same node and a fresh token, not with a 401.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from agents import __version__
from agents.http import ControlPlaneClient
from agents.protocol import ProtocolError, dump, parse
from agents.protocol.agent import REGISTER_PATH, GpuInfo, Register, RegisterResponse

log = logging.getLogger(__name__)


class RegistrationRefused(Exception):
    """The control plane answered registration with a 4xx: retrying cannot help."""


@dataclass(frozen=True)
class NodeCredentials:
    control_plane_url: str
    node_id: str
    node_token: str
    heartbeat_interval_s: float


def load_credentials(path: Path, control_plane_url: str) -> NodeCredentials | None:
    """The stored credentials, if any were issued by this control plane."""
    if not path.exists():
        return None
    creds = NodeCredentials(**json.loads(path.read_text()))
    if creds.control_plane_url.rstrip("/") != control_plane_url.rstrip("/"):
        log.warning("%s holds a token for %s, not %s; registering again", path, creds.control_plane_url,
                    control_plane_url)
        return None
    return creds


def save_credentials(path: Path, creds: NodeCredentials) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a leftover tmp file
        os.write(fd, json.dumps(asdict(creds)).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def attempt_id(path: Path) -> str:
    """This registration's attempt id, made (mode 0600) on the first call and read back after."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, value.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return value


def register(client: ControlPlaneClient, *, bootstrap_token: str, hostname: str, address: str,
             labels: dict[str, str], gpus: list[GpuInfo], gpu_telemetry: bool, gpu_telemetry_reason: str | None,
             probe_port: int | None, attempt: str | None = None) -> RegisterResponse:
    """POST the registration; raises ``agents.http.Unreachable`` or ``RegistrationRefused``."""
    message = Register(bootstrap_token=bootstrap_token, hostname=hostname, address=address,
                       agent_version=__version__, labels=labels, gpus=gpus, gpu_telemetry=gpu_telemetry,
                       gpu_telemetry_reason=gpu_telemetry_reason, probe_port=probe_port, attempt=attempt)
    status, body = client.request("POST", REGISTER_PATH, dump(message))
    if status != 201:
        raise RegistrationRefused(f"registration refused ({status}): {body}")
    try:
        return parse(RegisterResponse, body)
    except ProtocolError as exc:
        raise RegistrationRefused(f"registration answer is malformed: {exc}") from exc
