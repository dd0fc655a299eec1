"""Fixtures for the node-side tests: real servers on loopback, never mocks of them.

- ``control_plane``: a stdlib HTTP server that speaks the agent protocol (validating every body
  with the same ``parse`` the real server uses), records what it receives, re-sends pending
  commands until they are acked, and can go down (refusing connections) and come back.
- ``sshd``: a real OpenSSH server on a free loopback port with a generated host key.
- ``train_script``: a tiny gloo training loop for torchrun that can fail on request.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agents.agent.config import AgentConfig
from agents.agent.daemon import Agent
from agents.protocol import ProtocolError, dump, parse
from agents.protocol.agent import (
    CommandAck,
    EventBatch,
    Heartbeat,
    Register,
    RegisterResponse,
    TelemetryBatch,
    parse_event_details,
)
from tests.ports import free_port
from tests.waiting import wait_for


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has finished: it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# Helpers reach test modules as fixtures: importing a conftest by module name is fragile.

@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    return free_port


@pytest.fixture(name="pid_alive")
def pid_alive_fixture() -> Callable[[int], bool]:
    return pid_alive


# --- control plane ---------------------------------------------------------------------------

class ControlPlane:
    node_id = "node-1"
    node_token = "node-token-1"
    bootstrap_token = "bootstrap-1"

    def __init__(self, heartbeat_interval_s: float = 0.2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.heartbeat_interval_s = heartbeat_interval_s
        self.lock = threading.Lock()
        self.registrations: list[Register] = []
        self.heartbeats: list[Heartbeat] = []
        self.samples: list[dict[str, Any]] = []
        self.telemetry_posts: list[int] = []  # samples per telemetry request
        self.events: dict[str, Any] = {}  # key -> (event, detail): the server deduplicates on key
        self.event_deliveries = 0
        self.event_arrivals: dict[str, float] = {}  # key -> when it first arrived (Unix time)
        self.acks: list[CommandAck] = []
        self.errors: list[str] = []
        self.pending: list[dict[str, Any]] = []  # commands re-sent until acked
        self.ack_answers: dict[str, int] = {}  # command id -> status to answer its ack with
        self.register_delays: list[float] = []  # seconds to sit on each next registration's answer
        #: Heartbeat pacing: the interval to ask of an agent that says its own (None: never asked).
        self.paced_interval_s: float | None = None
        #: A control plane older than pacing refuses the heartbeat field it does not know.
        self.knows_interval = True
        #: A shedding control plane: telemetry is answered 503 with this Retry-After (None: taken).
        self.telemetry_retry_after: int | None = None
        self.telemetry_refusals = 0
        #: The next this many heartbeats are answered 503 with ``Retry-After: 1`` (admission control).
        self.refuse_heartbeats = 0
        self.refused_heartbeats: list[float] = []  # when each was refused (monotonic)
        #: The command wait (GET commands/wait): answered as soon as a command is pending.
        self.knows_command_wait = True
        self.command_waits = 0
        self.changed = threading.Condition(self.lock)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def up(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def down(self) -> None:
        """Close the listening socket: connections are refused until ``up()``."""
        if self._server is not None:
            with self.changed:
                self.changed.notify_all()  # the waits answer now (self._server is None then)
            self._server.shutdown()
            self._server.server_close()
            assert self._thread is not None
            self._thread.join()
            self._server = None
            with self.changed:
                self.changed.notify_all()

    def send(self, command: Any) -> None:
        with self.changed:
            self.pending.append(dump(command))
            self.changed.notify_all()

    def _wait(self, path: str, auth: str | None) -> tuple[int, dict[str, Any]]:
        url = urllib.parse.urlsplit(path)
        if auth != f"Bearer {self.node_token}":
            return 401, {"error": "bad node token"}
        if not self.knows_command_wait or url.path != f"/api/v1/nodes/{self.node_id}/commands/wait":
            return 404, {"error": f"no route {path}"}
        timeout = float(urllib.parse.parse_qs(url.query)["timeout"][0])
        with self.changed:
            self.command_waits += 1
            server = self._server
            waiting = self.changed.wait_for(lambda: self.pending or self._server is not server, timeout=timeout)
        return 200, {"commands": bool(waiting and self.pending)}

    def events_of(self, kind: str) -> list[tuple[Any, Any]]:
        with self.lock:
            return [pair for pair in self.events.values() if pair[0].kind == kind]

    def _handle(self, path: str, body: Any, auth: str | None) -> tuple[int, dict[str, Any]]:
        parts = path.strip("/").split("/")
        if path == "/api/v1/agents/register":
            message = parse(Register, body)
            if message.bootstrap_token != self.bootstrap_token:
                return 403, {"error": "unknown bootstrap token"}
            self.registrations.append(message)
            if self.register_delays:
                time.sleep(self.register_delays.pop(0))  # the agent has given up on this answer
            return 201, dump(RegisterResponse(node_id=self.node_id, node_token=self.node_token,
                                              heartbeat_interval_s=self.heartbeat_interval_s))
        if auth != f"Bearer {self.node_token}":
            return 401, {"error": "bad node token"}
        if parts[:3] != ["api", "v1", "nodes"] or parts[3] != self.node_id:
            return 404, {"error": "no such node"}
        if parts[4:] == ["heartbeat"]:
            if self.refuse_heartbeats:
                self.refuse_heartbeats -= 1
                self.refused_heartbeats.append(time.monotonic())
                return 503, {"title": "Service Unavailable", "status": 503, "code": "overloaded"}
            if "interval_s" in body and not self.knows_interval:
                return 400, {"type": "about:blank", "title": "Bad request", "status": 400,
                             "detail": "interval_s: unknown field"}  # as parse() words it
            beat = parse(Heartbeat, body)
            self.heartbeats.append(beat)
            answer: dict[str, Any] = {"commands": list(self.pending)}
            if beat.interval_s is not None and self.paced_interval_s is not None:
                answer["heartbeat_interval_s"] = self.paced_interval_s
            return 200, answer
        if parts[4:] == ["telemetry"]:
            if self.telemetry_retry_after is not None:
                self.telemetry_refusals += 1
                return 503, {"title": "Service Unavailable", "status": 503, "code": "overloaded"}
            samples = parse(TelemetryBatch, body).samples
            self.samples.extend(dump(s) for s in samples)
            self.telemetry_posts.append(len(samples))
            return 202, {}
        if parts[4:] == ["events"]:
            for event, detail in parse_event_details(parse(EventBatch, body)):
                self.event_deliveries += 1
                self.events.setdefault(event.key, (event, detail))
                self.event_arrivals.setdefault(event.key, time.time())
            return 202, {}
        if len(parts) == 7 and parts[4] == "commands" and parts[6] == "ack":
            ack = parse(CommandAck, body)
            self.acks.append(ack)
            self.pending = [c for c in self.pending if c["id"] != ack.command_id]
            return self.ack_answers.get(ack.command_id, 200), {}
        return 404, {"error": f"no route {path}"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        plane = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with plane.lock:
                    try:
                        status, answer = plane._handle(self.path, json.loads(raw), self.headers.get("Authorization"))
                    except (ProtocolError, ValueError) as exc:
                        plane.errors.append(f"{self.path}: {exc}")
                        status, answer = 400, {"error": str(exc)}
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 503 and self.path.endswith("/heartbeat"):
                    self.send_header("Retry-After", "1")
                elif status == 503 and plane.telemetry_retry_after is not None:
                    self.send_header("Retry-After", str(plane.telemetry_retry_after))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                status, answer = plane._wait(self.path, self.headers.get("Authorization"))
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                pass

        return Handler


@pytest.fixture
def control_plane() -> Iterator[ControlPlane]:
    plane = ControlPlane()
    plane.up()
    yield plane
    plane.down()
    assert not plane.errors, f"the agent sent messages that do not parse: {plane.errors}"


@pytest.fixture
def urgent_plane() -> Iterator[ControlPlane]:
    """A second control plane for the agent's ``urgent_url`` (the processes that take its events and
    acks): the same protocol and node token as ``control_plane``, its own port and records."""
    plane = ControlPlane()
    plane.up()
    yield plane
    plane.down()
    assert not plane.errors, f"the agent sent messages that do not parse: {plane.errors}"


# --- agent -----------------------------------------------------------------------------------

SCENARIO = """
gpus: 2
baseline: {temperature: 45, utilization: 95, memory_used: 2GiB}
events: []
"""


@pytest.fixture
def scenario_file(tmp_path: Path) -> Callable[[str], Path]:
    def write(text: str = SCENARIO) -> Path:
        path = tmp_path / f"scenario-{time.monotonic_ns()}.yaml"
        path.write_text(text)
        return path
    return write


@pytest.fixture
def agent_config(tmp_path: Path, control_plane: ControlPlane,
                 scenario_file: Callable[[str], Path]) -> Callable[..., AgentConfig]:
    """``agent_config(**overrides)``: a config for an agent of ``control_plane``, fast intervals."""
    def make(**overrides: Any) -> AgentConfig:
        values: dict[str, Any] = dict(
            control_plane_url=control_plane.url, work_dir=tmp_path / "agent", hostname="test-node",
            address="127.0.0.1", bootstrap_token=control_plane.bootstrap_token, heartbeat_interval_s=0.2,
            telemetry_interval_s=0.05, telemetry_batch_s=0.2, telemetry_source="scripted",
            scenario=scenario_file(SCENARIO),
            probe_port=0, probe_host="127.0.0.1", stop_grace_s=5.0, request_timeout_s=1.0)
        values.update(overrides)
        return AgentConfig(**values)
    return make


class RunningAgent:
    def __init__(self, agent: Agent):
        self.agent = agent
        self.exit_status: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.exit_status = self.agent.run()

    def stop(self) -> int | None:
        self.agent.stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "agent did not stop"
        return self.exit_status


@pytest.fixture
def start_agent() -> Iterator[Callable[[Any], RunningAgent]]:
    """Runs an ``Agent`` on a thread; stops it (and whatever it launched) at the end."""
    started: list[RunningAgent] = []

    def start(config: AgentConfig) -> RunningAgent:
        running = RunningAgent(Agent(config))
        running.thread.start()
        started.append(running)
        return running

    yield start
    for running in started:
        if running.thread.is_alive():
            running.stop()


# --- torchrun --------------------------------------------------------------------------------

TRAIN_SCRIPT = '''
import json, os, signal, subprocess, sys, time
import torch.distributed as dist

out_dir, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
# One child in the process group and one that leaves it: a stop must find both.
children = [subprocess.Popen(["sleep", "300"]), subprocess.Popen(["sleep", "300"], start_new_session=True)]
env = {k: v for k, v in os.environ.items() if k.startswith(("NIGHTWATCH_", "NCCL_", "TORCH_DISABLE"))}
tmp = os.path.join(out_dir, f"rank{rank}.tmp")
with open(tmp, "w") as f:
    json.dump({"pid": os.getpid(), "children": [c.pid for c in children], "env": env}, f)
os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
print(f"rank {rank} ready", flush=True)
step = 0
while True:
    dist.barrier()
    step += 1
    time.sleep(0.05)
    if rank == 1 and step == 40:  # about 2 s in: the supervisor has seen the children by then
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "raise":
            raise ValueError(f"boom at step {step}")
        if mode == "pause":
            sys.exit(85)
'''


@pytest.fixture
def train_script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN_SCRIPT)
    return path


@pytest.fixture
def rank_info() -> Callable[[Path, int], dict[str, Any] | None]:
    """What rank N of ``train_script`` wrote about itself (pid, children, environment)."""
    def read(out_dir: Path, rank: int) -> dict[str, Any] | None:
        path = out_dir / f"rank{rank}.json"
        return json.loads(path.read_text()) if path.exists() else None
    return read


# --- sshd ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Sshd:
    port: int
    host_public_key: str
    client_key: Path
    known_hosts: Path
    user: str


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    binary = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").exists() else None)
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("sshd is missing: CI must run scripts/install-system-deps.sh")
        pytest.skip("sshd is not installed (scripts/install-system-deps.sh installs it)")
    d = tmp_path / "sshd"
    d.mkdir()
    for name in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "client.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory (see PLATFORM-NOTES)
    port = free_port()
    (d / "sshd_config").write_text(f"""
ListenAddress 127.0.0.1
Port {port}
HostKey {d / "host"}
PidFile {d / "sshd.pid"}
AuthorizedKeysFile {d / "authorized_keys"}
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
Subsystem sftp internal-sftp
""")
    host_public_key = " ".join((d / "host.pub").read_text().split()[:2])
    known_hosts = d / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {host_public_key}\n")
    proc = subprocess.Popen([binary, "-D", "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")])

    def accepting() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"sshd exited: {(d / 'sshd.log').read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    try:
        wait_for(accepting, timeout=10, what="sshd to accept connections", interval=0.05)
        yield Sshd(port=port, host_public_key=host_public_key, client_key=d / "client", known_hosts=known_hosts,
                   user=pwd.getpwuid(os.getuid()).pw_name)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

