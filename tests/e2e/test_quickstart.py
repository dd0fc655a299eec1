"""docs/quickstart.md, followed literally: its commands are read from the document, not copied here.

The guide marks each shell block it wants run: ```` ```sh step=NAME ```` (``background``: it keeps
running, like a command left in a terminal of its own; ``per-node``: run once for each node, with
that node's variables), ```` ```sh variables ```` (the values a reader sets; the test sets its own
for exactly those names) or ```` ```sh untested=WHY ```` (needs the network, root or Docker). The
quick tests below hold the document to that format, to the step list the end-to-end test walks
through, and its diff to the example files; the end-to-end test runs the steps in order in a
temporary directory with free ports: the embedded control plane (SQLite, as the guide's path), a
bootstrap token and an agent for ``node-1``, a 2-rank job of the adapted example, a killed rank
(automatic restart), a second one (circuit breaker, paused), the approval (resumed, completed),
then a second agent process standing in for a second machine (``node-2``) and a 2-node job.

Each step runs in ``bash -euo pipefail`` from the checkout, with the exports of the steps before
(``export -p`` is carried from one step to the next, as in the reader's shell); every wait has a
deadline, and every process the steps start is stopped at the end, with its process group and any
leftover that carries this test's directory in its environment.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "quickstart.md"

#: The steps the end-to-end test walks through, in the guide's order (``fault`` twice, the per-node
#: steps once for each node). The quick test fails when the guide's steps and this list part ways.
STEPS = ["control-plane", "cli-token", "project", "bootstrap-token", "agent", "nodes", "launch", "watch", "fault",
         "paused", "approve", "launch-two-nodes"]
NODES = ("node-1", "node-2")

_FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_EXPORT = re.compile(r"^export (?P<name>[A-Z_][A-Z0-9_]*)=", re.M)


@dataclass
class Block:
    lang: str
    attrs: dict[str, str]
    body: str
    line: int

    @property
    def step(self) -> str | None:
        return self.attrs.get("step")


def blocks(text: str) -> list[Block]:
    found = []
    for match in _FENCE.finditer(text):
        words = match["info"].split()
        attrs = dict(w.split("=", 1) if "=" in w else (w, "") for w in words[1:])
        found.append(Block(words[0] if words else "", attrs, match["body"], text.count("\n", 0, match.start()) + 1))
    return found


def guide_blocks() -> list[Block]:
    return blocks(GUIDE.read_text())


def steps_of(found: list[Block]) -> dict[str, Block]:
    return {b.step: b for b in found if b.step}


def declared_variables(found: list[Block]) -> list[str]:
    (variables,) = [b for b in found if b.lang == "sh" and "variables" in b.attrs]
    return _EXPORT.findall(variables.body)


# --- the document's format, steps and diff (quick) ---------------------------------------------------

def test_every_shell_block_is_a_step_the_variables_or_marked_untested():
    found = guide_blocks()
    shell = [b for b in found if b.lang in ("sh", "bash", "console", "shell")]
    assert shell, "no shell blocks found in the guide"
    for block in shell:
        kinds = [k for k in ("step", "variables", "untested") if k in block.attrs]
        assert len(kinds) == 1, f"docs/quickstart.md line {block.line}: a shell block needs exactly one of " \
                                f"step=NAME, variables, untested=WHY (has {block.attrs})"
        assert block.lang == "sh", f"line {block.line}: use ```sh for commands"
        if "untested" in block.attrs:
            assert block.attrs["untested"], f"line {block.line}: say why it is untested (untested=WHY)"
    names = [b.step for b in found if b.step]
    assert len(names) == len(set(names)), f"step names repeat: {names}"


def test_the_guide_has_exactly_the_steps_the_end_to_end_test_runs():
    assert [b.step for b in guide_blocks() if b.step] == STEPS


def test_every_variable_a_step_uses_is_declared_or_set_by_an_earlier_step():
    found = guide_blocks()
    known = set(declared_variables(found)) | {"HOME"}
    for block in found:
        if not block.step:
            continue
        known |= set(_EXPORT.findall(block.body))  # its own exports count from where they are set
        used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", block.body))
        assert used <= known, f"step {block.step} uses undeclared {sorted(used - known)}"


def test_the_diff_in_the_guide_is_the_diff_of_the_example_files():
    plain, watched = ROOT / "examples" / "byo" / "plain_ddp.py", ROOT / "examples" / "byo" / "watched.py"
    (shown,) = [b.body for b in guide_blocks() if b.lang == "diff"]
    actual = subprocess.run(["diff", "-u", str(plain), str(watched)], capture_output=True, text=True, check=False)
    assert actual.returncode == 1, actual.stderr
    hunks = actual.stdout.split("\n", 2)[2]  # without the ---/+++ header lines
    assert shown == hunks, "docs/quickstart.md's diff is not `diff -u examples/byo/plain_ddp.py " \
                           "examples/byo/watched.py`: paste the new one"


def test_the_readme_and_the_agent_config_point_to_the_guide():
    assert "](docs/quickstart.md)" in (ROOT / "README.md").read_text()
    assert "docs/quickstart.md" in (ROOT / "deploy" / "agent.yaml").read_text()


# --- the guide, run ------------------------------------------------------------------------------------

@dataclass
class Guide:
    """Runs the guide's steps like a reader's shell: one state of exported variables, carried over."""

    tmp: Path
    common: dict[str, str]
    per_node: dict[str, dict[str, str]]
    steps: dict[str, Block]
    env: dict[str, str] = field(default_factory=dict)
    background: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    count: int = 0

    def __post_init__(self):
        self.state = self.tmp / "shell-state.sh"
        self.state.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.common.items()))
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("NIGHTWATCH", "DATABASE_URL", "REDIS_URL", "NW_", "VIRTUAL_ENV"))}
        # The reader's activated virtual environment: `python`, `nightwatch`, `nightwatch-agent`.
        base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
        base["PYTHONUNBUFFERED"] = "1"
        self.env = base

    def _script(self, name: str, node: str) -> tuple[Path, Path]:
        block = self.steps[name]
        self.count += 1
        label = f"{self.count:02d}-{name}" + (f"-{node}" if "per-node" in block.attrs else "")
        script, log = self.tmp / "steps" / f"{label}.sh", self.tmp / "steps" / f"{label}.log"
        script.parent.mkdir(exist_ok=True)
        overrides = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.per_node[node].items())
        keep = "" if "background" in block.attrs else (
            f"\nexport -p | grep -Ev '^declare -x (PWD|OLDPWD|SHLVL|_)=' > {shlex.quote(str(self.state))}.new"
            f" && mv {shlex.quote(str(self.state))}.new {shlex.quote(str(self.state))}\n")
        script.write_text(f"set -euo pipefail\nsource {shlex.quote(str(self.state))}\n{overrides}"
                          f"cd {shlex.quote(str(ROOT))}\n{block.body}{keep}")
        return script, log

    def run(self, name: str, node: str = NODES[0], timeout: float = 120) -> str:
        """A foreground step: its output; fails the test on a non-zero exit or past ``timeout``."""
        assert "background" not in self.steps[name].attrs, name
        script, log = self._script(name, node)
        with open(log, "wb") as out:
            proc = subprocess.Popen(["bash", str(script)], cwd=ROOT, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise AssertionError(f"step {name} ({node}) ran past {timeout:g} s:\n{log.read_text()}") from None
        output = log.read_text(errors="replace")
        assert code == 0, f"step {name} ({node}) exited {code}:\n{output}"
        return output

    def start(self, name: str, node: str = NODES[0]) -> subprocess.Popen:
        """A background step (a command left running in a terminal of its own)."""
        assert "background" in self.steps[name].attrs, name
        script, log = self._script(name, node)
        with open(log, "wb") as out:
            proc = subprocess.Popen(["bash", str(script)], cwd=ROOT, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.background.append((f"{name}-{node}", proc))
        return proc

    def output(self, name: str) -> str:
        """What the latest run of a step has printed so far."""
        logs = sorted((self.tmp / "steps").glob(f"*-{name}*.log"))
        return logs[-1].read_text(errors="replace") if logs else ""

    def var(self, name: str) -> str:
        """A variable as the reader's shell holds it after the steps so far."""
        shown = subprocess.run(["bash", "-c", f'source "$1"; printf %s "${{{name}:-}}"', "-", str(self.state)],
                               capture_output=True, text=True, env=self.env, check=True)
        return shown.stdout

    def logs(self) -> str:
        parts = [f"===== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                 for p in sorted((self.tmp / "steps").glob("*.log"))]
        var = Path(self.common["NIGHTWATCH_VAR_DIR"]) / "logs"
        parts += [f"===== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(var.glob("*.log"))]
        home = Path(self.common["NW_HOME"])
        for torchrun in sorted(home.glob("agent-*/supervisor/jobs/*/generation-*/torchrun.log")):
            parts.append(f"===== {torchrun}\n{torchrun.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        # The agents first (they stop their torchruns), then the control plane (it stops its children).
        for _, proc in reversed(self.background):
            _stop_group(proc)
        _kill_leftovers(str(self.tmp))


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _stop_group(proc: subprocess.Popen, grace: float = 20) -> None:
    _kill_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc)  # whatever of the group is left, even when the leader exited
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _kill_leftovers(marker: str) -> None:
    """torchrun and the control plane's children run in sessions of their own: anything still alive
    with this test's directory in its environment goes now."""
    wanted = marker.encode()
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            if int(pid_dir.name) != os.getpid() and wanted in (pid_dir / "environ").read_bytes():
                os.kill(int(pid_dir.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


class Api:
    def __init__(self, url: str, token: str):
        self.url, self.token = url, token

    def get(self, path: str):
        request = urllib.request.Request(f"{self.url}/api/v1{path}",  # noqa: S310 - the test's own server
                                         headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def results(self, path: str) -> list:
        answer = self.get(path)
        return answer.get("results", []) if isinstance(answer, dict) else []


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:  # noqa: S310
            return response.status == 200
    except OSError:
        return False


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_quickstart_runs_as_written(tmp_path):
    found = guide_blocks()
    steps = steps_of(found)
    home = tmp_path / "home"
    port = free_port()
    common = {"NW_HOME": str(home), "NW_HOST": "127.0.0.1", "NW_PORT": str(port),
              "NW_URL": f"http://127.0.0.1:{port}", "NW_RDZV_PORT": str(free_port()),
              "NIGHTWATCH_VAR_DIR": str(home / "var"), "NIGHTWATCH_CHECKPOINT_ROOT": str(home / "checkpoints")}
    per_node = {node: {"NW_NODE": node, "NW_ADDRESS": "127.0.0.1", "NW_PROBE_PORT": str(free_port())}
                for node in NODES}
    # The test sets exactly what the guide declares: no hidden setting makes the steps work.
    assert sorted(declared_variables(found)) == sorted([*common, *per_node[NODES[0]]])
    guide = Guide(tmp_path, common, per_node, steps)
    url = common["NW_URL"]
    try:
        plane = guide.start("control-plane")
        # What the reader waits for: the command says it is up (after its own readiness check).
        wait_for(lambda: "Nightwatch is up" in guide.output("control-plane") or plane.poll() is not None,
                 timeout=180, what="the control plane to say it is up")
        assert plane.poll() is None and _ready(url), guide.logs()

        guide.run("cli-token")
        token = guide.var("NIGHTWATCH_TOKEN")
        assert token.startswith("nw_") and guide.var("NIGHTWATCH_URL") == url
        api = Api(url, token)

        guide.run("project")
        assert (home / "project" / "mytrain.py").is_file()

        def start_node(node: str) -> None:
            guide.run("bootstrap-token", node)
            assert (home / f"bootstrap-token-{node}").read_text().startswith("nw_")
            agent = guide.start("agent", node)
            wait_for(lambda: agent.poll() is not None or any(
                n["health"] == "healthy" for n in api.results(f"/nodes?hostname={node}")),
                timeout=120, what=f"{node} to register and report healthy")
            assert agent.poll() is None, guide.logs()

        start_node("node-1")
        listed = guide.run("nodes")
        assert "node-1" in listed and "healthy" in listed, listed

        launched = guide.run("launch")
        job = int(guide.var("JOB"))
        assert f"{url}/jobs/{job}/" in launched, launched

        def status() -> dict:
            return api.get(f"/jobs/{job}/status") or {}

        def verified() -> list:
            return api.results(f"/jobs/{job}/checkpoints?state=verified")

        try:
            wait_for(lambda: status().get("state") == "running" and verified(), timeout=240,
                     what="the job running with a verified checkpoint")
        except AssertionError:
            raise AssertionError(f"{status()}\n{guide.logs()}") from None
        watched = guide.run("watch")
        # status, the checkpoints the control plane verified, and the ranks' own output.
        assert f"job {job} running" in watched and "verified" in watched and "rank" in watched, watched

        # First kill: a crash inside the budget, restarted on its own from a verified checkpoint.
        guide.run("fault")
        try:
            wait_for(lambda: status().get("generation") == 2 and status().get("state") == "running", timeout=180,
                     what="generation 2 running after the first kill")
        except AssertionError:
            raise AssertionError(f"{status()}\n{guide.logs()}") from None
        # Second kill: the budget is spent, the breaker opens, the job waits for a person.
        guide.run("fault")
        try:
            wait_for(lambda: status().get("state") == "paused", timeout=180, what="the job paused by the breaker")
        except AssertionError:
            raise AssertionError(f"{status()}\n{guide.logs()}") from None
        paused = guide.run("paused")
        assert f"job {job} paused" in paused and "circuit breaker" in paused and "crash" in paused, paused

        guide.run("approve")
        try:
            wait_for(lambda: status().get("state") in ("completed", "failed", "cancelled"), timeout=360,
                     what="the approved job to finish")
        except AssertionError:
            raise AssertionError(f"{status()}\n{guide.logs()}") from None
        final = status()
        assert final["state"] == "completed" and final["generation"] == 3 and final["restart_count"] == 2, final
        generations = api.results(f"/jobs/{job}/generations")
        assert [g["number"] for g in generations] == [1, 2, 3], generations
        # Each restart resumed from a verified checkpoint, never from scratch.
        assert all(g["resumed_from"] for g in generations[1:]), generations

        # A second machine, stood in for by a second agent process with its own name and work dir.
        start_node("node-2")
        two = guide.run("launch-two-nodes", timeout=480)
        assert " completed · " in two, two
        second = int(two.split("launched job ", 1)[1].split()[0])
        (generation,) = api.results(f"/jobs/{second}/generations")
        assert sorted(generation["nodes"]) == ["node-1", "node-2"] and generation["world_size"] == 4, generation
    except BaseException:
        print(guide.logs())
        raise
    finally:
        guide.close()
