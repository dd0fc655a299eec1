"""The SSH transport against a real sshd on loopback, started by the ``sshd`` fixture."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.ssh import HostKeyRejected, SshTarget, SshTransport, bootstrap_agent
from tests.waiting import wait_for

POLL_S = 0.05  # the agent and the supervisor answer in milliseconds: poll often

pytestmark = pytest.mark.e2e


def target(sshd: Any, **overrides: Any) -> SshTarget:
    values: dict[str, Any] = dict(host="127.0.0.1", port=sshd.port, username=sshd.user,
                                  key_filename=str(sshd.client_key), known_hosts=sshd.known_hosts, connect_timeout=5)
    values.update(overrides)
    return SshTarget(**values)


@pytest.fixture
def ssh(sshd: Any) -> Iterator[SshTransport]:
    with SshTransport(target(sshd)) as transport:
        yield transport


def test_runs_a_command_and_returns_its_status_and_output(ssh: SshTransport) -> None:
    result = ssh.run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10)
    assert (result.exit_status, result.stdout, result.stderr, result.timed_out) == (3, "out\n", "err\n", False)


def test_output_is_streamed_while_the_command_runs(ssh: SshTransport) -> None:
    chunks: list[tuple[float, str, str]] = []
    ssh.run(["sh", "-c", "echo first; sleep 1; echo second"], timeout=10,
            on_output=lambda stream, text: chunks.append((time.monotonic(), stream, text)))
    first = next(t for t, _, text in chunks if "first" in text)
    second = next(t for t, _, text in chunks if "second" in text)
    assert second - first > 0.5  # "first" arrived before the command had finished


def test_a_command_that_outlives_its_timeout_is_killed_on_the_node(ssh: SshTransport,
                                                                   pid_alive: Callable[[int], bool]) -> None:
    marker = f"{time.monotonic_ns() % 10**6 + 1000}"  # a distinctive sleep length to look for
    started = time.monotonic()
    result = ssh.run(["sleep", marker], timeout=1)
    assert result.timed_out and result.exit_status == 124
    assert time.monotonic() - started < 8

    def still_sleeping() -> bool:
        wanted = f"sleep\0{marker}\0".encode()
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and (entry / "cmdline").read_bytes() == wanted and pid_alive(int(entry.name)):
                    return True
            except OSError:
                continue  # exited while we looked
        return False

    wait_for(lambda: not still_sleeping(), timeout=10, what="the remote sleep to be killed", interval=POLL_S)


def test_arguments_are_passed_literally_never_executed(ssh: SshTransport, tmp_path: Path) -> None:
    victim = tmp_path / "x"
    victim.mkdir()
    hostile = f"; rm -rf {victim}"
    result = ssh.run(["echo", hostile, "$(touch pwned)", "`id`", "a b"], timeout=10)
    assert result.stdout == f"{hostile} $(touch pwned) `id` a b\n"
    assert victim.exists()
    assert not (Path.home() / "pwned").exists()


def test_files_are_copied_over_sftp(ssh: SshTransport, tmp_path: Path) -> None:
    local = tmp_path / "local.txt"
    local.write_text("payload")
    remote = tmp_path / "remote.txt"
    ssh.copy(local, str(remote), mode=0o640)
    assert remote.read_text() == "payload" and (remote.stat().st_mode & 0o777) == 0o640
    secret = tmp_path / "secret"
    ssh.write_file(str(secret), b"token", mode=0o600)
    assert secret.read_bytes() == b"token" and (secret.stat().st_mode & 0o777) == 0o600


def test_an_unknown_host_key_is_refused(sshd: Any, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    with pytest.raises(HostKeyRejected, match="not pinned"):
        SshTransport(target(sshd, known_hosts=empty)).connect()


def test_a_changed_host_key_is_refused(sshd: Any, tmp_path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = " ".join((tmp_path / "other.pub").read_text().split()[:2])
    pinned = tmp_path / "known_hosts_other"
    pinned.write_text(f"[127.0.0.1]:{sshd.port} {other}\n")
    with pytest.raises(HostKeyRejected, match="does not match"):
        SshTransport(target(sshd, known_hosts=pinned)).connect()


def test_bootstrap_copies_and_starts_an_agent_that_registers(ssh: SshTransport, control_plane: Any,
                                                             tmp_path: Path, scenario_file: Callable[[str], Path],
                                                             pid_alive: Callable[[int], bool]) -> None:
    remote_dir = tmp_path / "node" / "nightwatch"
    config = {"control_plane_url": control_plane.url, "bootstrap_token": control_plane.bootstrap_token,
              "work_dir": str(remote_dir / "work"), "telemetry_source": "scripted",
              "scenario": str(scenario_file("gpus: 1")), "heartbeat_interval_s": 0.2, "probe_port": 0,
              "probe_host": "127.0.0.1"}
    pid = bootstrap_agent(ssh, remote_dir=str(remote_dir), config=config, python=sys.executable)
    try:
        wait_for(lambda: control_plane.registrations and control_plane.heartbeats,
                 timeout=30, what=f"the bootstrapped agent to register (log: {remote_dir / 'agent.log'})",
                 interval=POLL_S)
        assert "agents.agent" in Path(f"/proc/{pid}/cmdline").read_text()
        assert (remote_dir / "agents" / "agent" / "daemon.py").exists()
        assert (os.stat(remote_dir / "agent.yaml").st_mode & 0o777) == 0o600  # it holds the bootstrap token
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not pid_alive(pid), timeout=30, what="the bootstrapped agent to stop", interval=POLL_S)
