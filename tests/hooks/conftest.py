"""Shared fixtures for the hooks tests: real torchrun runs of examples/train.py and a real HTTP
server that speaks the hooks' three control-plane endpoints and records what it receives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from agents.protocol import ProtocolError, dump, parse
from agents.protocol.hooks import PROGRESS_HEADER, CheckpointCommit, Control, ReportBatch

REPO = Path(__file__).resolve().parents[2]


# -- torchrun ---------------------------------------------------------------------------------


@dataclass
class Run:
    returncode: int
    output: str

    def lines(self, needle: str) -> list[str]:
        return [line for line in self.output.splitlines() if needle in line]


def torchrun(args: list[str], *, nproc: int = 2, max_restarts: int = 0, env: dict[str, str] | None = None,
             timeout: float = 60.0, module: str = "examples.train") -> Run:
    """Run examples/train.py (or a wrapper ``module`` around it) under a real torchrun (gloo on CPU);
    kill everything it started on timeout."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",  # standalone: free ports
               f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
               "-m", module, *args]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTWATCH_")}
    environment.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                        # torch 2.13: restarted workers otherwise reach the dead peer's address.
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})})
    process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(process)
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish within {timeout}s:\n{output[-4000:]}")
    finally:
        _kill_tree(process)
    return Run(process.returncode, output)


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (torchrun puts each worker in a session of its own).

    Only while torchrun is still alive and unreaped: then its pid and its children's are ours.
    """
    if process.poll() is not None:
        return
    for pid in [*_descendants(process.pid), process.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=10)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def read_samples(directory: Path, rank: int) -> dict[int, list[int]]:
    """step -> sample ids a rank trained on; a step retrained after a resume replaces the lost one."""
    steps: dict[int, list[int]] = {}
    for line in (directory / f"rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record["ids"]
    return steps


# -- a control plane that records -------------------------------------------------------------


@dataclass
class ControlPlaneStub:
    """The hooks' endpoints on a real socket: validates with the shared protocol, deduplicates step
    reports on (job, generation, rank, step) as the real server does and node windows on (job,
    generation, node, last_step) (the server's key adds the exchange time, which a replay repeats),
    and can be taken down (connections refused)."""

    generation: int = 0
    control: dict[str, Any] = field(default_factory=dict)
    port: int = 0
    received: list[dict[str, Any]] = field(default_factory=list)  # every report batch, duplicates included
    reports: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)  # (gen, rank, step)
    windows: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)  # (gen, node, last_step)
    events: list[dict[str, Any]] = field(default_factory=list)
    commits: list[dict[str, Any]] = field(default_factory=list)
    bad_requests: list[str] = field(default_factory=list)
    tokens: list[str | None] = field(default_factory=list)
    progress: list[str | None] = field(default_factory=list)  # each report POST's progress header
    shed: int = 0  # report batches still to refuse with 503 + Retry-After, as an overloaded server does
    retry_after_s: int = 1
    report_posts: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, status) per POST
    arrivals: list[tuple[str, int]] = field(default_factory=list)  # ("event:<kind>" or "commit", step), in order

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                stub.tokens.append(self.headers.get("Authorization"))
                query = parse_qs(urlsplit(self.path).query)
                generation = int(query.get("generation", ["0"])[0])
                self._answer(*stub.answer_control(generation))

            def do_POST(self) -> None:  # noqa: N802
                stub.tokens.append(self.headers.get("Authorization"))
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                path = urlsplit(self.path).path
                if path.endswith("/reports"):
                    stub.progress.append(self.headers.get(PROGRESS_HEADER))
                if path.endswith("/reports") and stub.shed > 0:
                    stub.shed -= 1
                    stub.report_posts.append((time.monotonic(), 503))
                    self._answer(503, {"title": "Service Unavailable"},
                                 headers={"Retry-After": str(stub.retry_after_s)})
                elif path.endswith("/reports"):
                    stub.report_posts.append((time.monotonic(), 202))
                    self._answer(*stub.accept_reports(body))
                elif path.endswith("/checkpoints"):
                    self._answer(*stub.accept_commit(body))
                else:
                    self._answer(404, {"error": "no such endpoint"})

            def _answer(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def down(self) -> None:
        """Stop listening: from now on connections are refused."""
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def current_control(self) -> dict[str, Any]:
        return dump(parse(Control, {"generation": self.generation, **self.control}))

    def answer_control(self, generation: int) -> tuple[int, dict[str, Any]]:
        if generation < self.generation:
            return 409, {"error": "stale generation", "current_generation": self.generation}
        return 200, self.current_control()

    def accept_reports(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            batch = parse(ReportBatch, body)
        except ProtocolError as error:
            self.bad_requests.append(str(error))
            return 400, {"error": str(error)}
        if batch.generation < self.generation:
            return 409, {"error": "stale generation", "current_generation": self.generation}
        accepted = duplicates = 0
        with self.lock:
            self.received.append(body)
            for report in body["reports"]:
                key = (report["generation"], report["rank"], report["step"])
                if key in self.reports:
                    duplicates += 1
                else:
                    self.reports[key] = report
                    accepted += 1
            for window in body["windows"]:
                self.windows.setdefault((window["generation"], window["node"], window["last_step"]), window)
            known = {e["key"] for e in self.events}
            fresh = [e for e in body["events"] if e["key"] not in known]
            self.events.extend(fresh)
            self.arrivals.extend((f"event:{e['kind']}", e["step"]) for e in fresh)
        return 202, {"accepted": accepted, "duplicates": duplicates, "control": self.current_control()}

    def accept_commit(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            commit = parse(CheckpointCommit, body)
        except ProtocolError as error:
            self.bad_requests.append(str(error))
            return 400, {"error": str(error)}
        if commit.generation < self.generation:
            return 409, {"error": "stale generation"}
        with self.lock:
            if any(c["path"] == commit.path for c in self.commits):
                return 200, {"recorded": False}
            self.commits.append(body)
            self.arrivals.append(("commit", body["step"]))
        return 201, {"recorded": True}

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.events if e["kind"] == kind]


@pytest.fixture
def control_plane() -> Iterator[ControlPlaneStub]:
    stub = ControlPlaneStub()
    stub.up()
    try:
        yield stub
    finally:
        stub.down()
