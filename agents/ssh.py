"""SSH transport (paramiko): bootstrap agents on new nodes, and drive agentless nodes.

Two rules keep it safe:

- Host keys are pinned: only the known_hosts file the operator manages is loaded (never the
  user's own; unknown keys are never added on the fly), and an unknown or changed host key is refused.
- Commands are argument lists joined with ``shlex.join``; user data is never concatenated into
  a shell string. Where a shell is needed (to detach the agent), the data is passed as the
  shell's positional parameters, not pasted into its script.
"""

from __future__ import annotations

import codecs
import io
import logging
import select
import shlex
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import paramiko
import yaml

import agents

log = logging.getLogger(__name__)

OutputCallback = Callable[[str, str], None]  # (stream name "stdout" | "stderr", text)


class HostKeyRejected(Exception):
    """The server's host key is not pinned in the known_hosts file, or does not match it."""


@dataclass(frozen=True)
class SshTarget:
    host: str
    known_hosts: Path
    port: int = 22
    username: str = "root"
    key_filename: str | None = None
    connect_timeout: float = 10.0


@dataclass(frozen=True)
class RunResult:
    exit_status: int
    stdout: str
    stderr: str
    timed_out: bool


class SshTransport:
    """One SSH connection to a node; use as a context manager."""

    def __init__(self, target: SshTarget):
        self.target = target
        self._client: paramiko.SSHClient | None = None

    def __enter__(self) -> SshTransport:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        client = paramiko.SSHClient()
        client.load_host_keys(str(self.target.known_hosts))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        t = self.target
        try:
            client.connect(t.host, port=t.port, username=t.username, key_filename=t.key_filename,
                           timeout=t.connect_timeout, banner_timeout=t.connect_timeout,
                           auth_timeout=t.connect_timeout, allow_agent=False,
                           look_for_keys=t.key_filename is None)
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyRejected(f"{t.host}:{t.port}: host key does not match {t.known_hosts}: {exc}") from exc
        except paramiko.SSHException as exc:
            client.close()
            if "known_hosts" in str(exc):  # what RejectPolicy raises for an unknown host
                raise HostKeyRejected(f"{t.host}:{t.port}: host key not pinned in {t.known_hosts}") from exc
            raise
        self._client = client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def run(self, argv: Sequence[str], *, timeout: float, on_output: OutputCallback | None = None) -> RunResult:
        """Run ``argv`` on the node, streaming output to ``on_output`` as it arrives.

        The remote side runs under coreutils ``timeout`` so that a command that outlives its
        time is killed on the node too (exit status 124), not merely abandoned by us.
        """
        if not argv:
            raise ValueError("empty command")
        remote = ["timeout", "--kill-after=2", f"{timeout:g}s", *argv]
        channel = self._transport().open_session()
        channel.exec_command(shlex.join(remote))
        decoders = {"stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                    "stderr": codecs.getincrementaldecoder("utf-8")("replace")}
        captured: dict[str, list[str]] = {"stdout": [], "stderr": []}

        def take(stream: str, data: bytes, final: bool = False) -> None:
            text = decoders[stream].decode(data, final)
            if text:
                captured[stream].append(text)
                if on_output is not None:
                    on_output(stream, text)

        # Our own deadline only backs up the remote one (a hung connection, a missing `timeout`).
        deadline = time.monotonic() + timeout + 5.0
        timed_out = False
        try:
            while True:
                if channel.recv_ready():
                    take("stdout", channel.recv(32768))
                elif channel.recv_stderr_ready():
                    take("stderr", channel.recv_stderr(32768))
                elif channel.exit_status_ready():
                    break
                elif time.monotonic() >= deadline:
                    timed_out = True
                    break
                else:
                    select.select([channel], [], [], 0.1)
            status = channel.recv_exit_status() if not timed_out else 124
        finally:
            channel.close()
        for stream in decoders:  # a multi-byte character cut at the very end
            take(stream, b"", final=True)
        timed_out = timed_out or status == 124
        return RunResult(exit_status=status, stdout="".join(captured["stdout"]),
                         stderr="".join(captured["stderr"]), timed_out=timed_out)

    def check(self, argv: Sequence[str], *, timeout: float = 60.0) -> str:
        """Run ``argv``; its stdout, or ``RuntimeError`` with stderr when it fails."""
        result = self.run(argv, timeout=timeout)
        if result.exit_status != 0:
            raise RuntimeError(f"{shlex.join(argv)} failed on {self.target.host} "
                               f"(exit {result.exit_status}): {result.stderr.strip()[-500:]}")
        return result.stdout

    def copy(self, local: Path, remote: str, *, mode: int | None = None) -> None:
        with self._client_or_raise().open_sftp() as sftp:
            sftp.put(str(local), remote)
            if mode is not None:
                sftp.chmod(remote, mode)

    def write_file(self, remote: str, data: bytes, *, mode: int = 0o600) -> None:
        """Write ``data`` to a remote file that is never readable by others, not even briefly."""
        with self._client_or_raise().open_sftp() as sftp, sftp.open(remote, "wb") as handle:
            sftp.chmod(remote, mode)  # before the content arrives: it may hold a token
            handle.write(data)

    def _client_or_raise(self) -> paramiko.SSHClient:
        if self._client is None:
            raise RuntimeError("not connected")
        return self._client

    def _transport(self) -> paramiko.Transport:
        transport = self._client_or_raise().get_transport()
        if transport is None or not transport.is_active():
            raise RuntimeError(f"SSH connection to {self.target.host} is closed")
        return transport


def agent_bundle(package_dir: Path | None = None) -> bytes:
    """The ``agents`` package as a gzip tarball (no bytecode), ready to unpack on a node."""
    package_dir = package_dir or Path(agents.__file__).parent
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(package_dir, arcname="agents",
                filter=lambda info: None if "__pycache__" in info.name or info.name.endswith(".pyc") else info)
    return buffer.getvalue()


def bootstrap_agent(ssh: SshTransport, *, remote_dir: str, config: Mapping[str, Any],
                    python: str = "python3", timeout: float = 60.0) -> int:
    """Copy the agent and its config to the node and start it detached; the agent's pid there.

    The node needs Python with the agent's dependencies (nvidia-ml-py, pyyaml); the config
    (with the one-time bootstrap token) is written with mode 0600.
    """
    base = PurePosixPath(remote_dir)
    bundle, config_path, log_path = base / "nightwatch-agent.tar.gz", base / "agent.yaml", base / "agent.log"
    ssh.check(["mkdir", "-p", "-m", "700", str(base)], timeout=timeout)
    ssh.write_file(str(bundle), agent_bundle(), mode=0o600)
    ssh.check(["tar", "-xzf", str(bundle), "-C", str(base)], timeout=timeout)
    ssh.write_file(str(config_path), yaml.safe_dump(dict(config)).encode(), mode=0o600)
    # The script is a constant; every path travels as a positional parameter ($1..$4).
    script = ('cd "$1" && PYTHONPATH="$1" nohup setsid "$2" -m agents.agent --config "$3" '
              '</dev/null >>"$4" 2>&1 & echo $!')
    out = ssh.check(["sh", "-c", script, "nightwatch-bootstrap", str(base), python, str(config_path),
                     str(log_path)], timeout=timeout)
    pid = int(out.strip())
    log.info("agent started on %s with pid %d (log %s)", ssh.target.host, pid, log_path)
    return pid
