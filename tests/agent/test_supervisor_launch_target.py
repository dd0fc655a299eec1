"""The supervisor runs only a script or module of the code directory, after every torchrun option,
with the job's arguments verbatim: a payload nobody validated is checked again and runs nothing."""

from __future__ import annotations

import json
import queue
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.protocol.agent import ExitReport, LaunchPayload, LaunchSpecError
from agents.supervisor import Supervisor
from tests.waiting import wait_for

POLL_S = 0.05  # the agent and the supervisor answer in milliseconds: poll often

#: Stands in for torchrun: if it ever starts, it leaves its argv and NCCL file variables behind.
RECORDING_TORCHRUN = """\
import json, os, sys
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({"argv": sys.argv[2:], "env": {k: v for k, v in os.environ.items() if k.endswith("_FILE")}}, f)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
"""


@pytest.fixture
def code_dir(tmp_path: Path) -> Path:
    code = tmp_path / "code"
    (code / "examples").mkdir(parents=True)
    (code / "examples" / "train.py").write_text("")
    (code / "pkg" / "sub").mkdir(parents=True)
    for name in ("pkg/__init__.py", "pkg/sub/__init__.py", "pkg/sub/main.py"):
        (code / name).write_text("")
    (code / "loose").mkdir()  # a namespace package: an installed "loose" would be imported instead
    (code / "loose" / "main.py").write_text("")
    (tmp_path / "outside.py").write_text("")
    (code / "escape.py").symlink_to(tmp_path / "outside.py")
    (code / "linked").symlink_to(tmp_path)
    return code


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    return tmp_path / "torchrun-argv.json"


@pytest.fixture
def supervisor(tmp_path: Path, recorded: Path) -> Iterator[Supervisor]:
    fake = tmp_path / "torchrun.py"
    fake.write_text(RECORDING_TORCHRUN)
    exits: queue.Queue[ExitReport] = queue.Queue()
    sup = Supervisor(tmp_path / "work", on_exit=lambda job, gen, report: exits.put(report),
                     torchrun=[sys.executable, str(fake), str(recorded)])
    yield sup
    sup.shutdown(grace_s=1.0)


def payload(code_dir: Path, **overrides: Any) -> LaunchPayload:
    fields: dict[str, Any] = {"script": "examples/train.py", "nnodes": 1, "nproc_per_node": 1, "node_rank": 0,
                              "rdzv_endpoint": "127.0.0.1:1", "rdzv_id": "x", "workdir": str(code_dir), **overrides}
    return LaunchPayload(**fields)


@pytest.mark.parametrize(("overrides", "field", "reason"), [
    ({"script": "--no-python", "args": ["sh", "-c", "touch /tmp/nw-pwned"]}, "script", "relative path"),
    ({"script": "/usr/bin/env.py"}, "script", "relative path"),
    ({"script": "../outside.py"}, "script", "relative path"),
    ({"script": "escape.py"}, "script", "not a file inside the code directory"),  # a symlink out of it
    ({"script": "linked/outside.py"}, "script", "not a file inside the code directory"),
    ({"script": "examples/missing.py"}, "script", "not a file inside the code directory"),
    ({"script": None, "module": "pdb", "args": ["-c", "import os"]}, "module", "standard-library"),
    ({"script": None, "module": "torch.distributed.run", "args": ["--no-python", "sh"]}, "module",
     "not a module of the code directory"),
    ({"script": None, "module": "loose.main"}, "module", "not a module of the code directory"),
    ({"script": None}, "script", "exactly one"),
    ({"module": "pkg.sub.main"}, "script", "exactly one"),
    ({"args": ["a\0b"]}, "args.0", "NUL"),
    ({"nccl_env": {"NCCL_DEBUG_FILE": "/etc/cron.d/x"}}, "nccl_env.NCCL_DEBUG_FILE", "bare file name"),
])
def test_a_payload_that_could_inject_is_refused_and_runs_nothing(
        supervisor: Supervisor, code_dir: Path, recorded: Path, overrides: dict[str, Any], field: str,
        reason: str) -> None:
    with pytest.raises(LaunchSpecError) as caught:
        supervisor.launch("job", 1, payload(code_dir, **overrides))
    assert caught.value.field == field and reason in caught.value.reason
    assert not recorded.exists() and supervisor.running() == []
    assert not (supervisor.work_dir / "jobs").exists()  # not even the generation's directory


def wait_for_file(path: Path) -> Any:
    return wait_for(lambda: json.loads(path.read_text()) if path.exists() else None,
                    timeout=20, what=f"{path.name} to be written", interval=POLL_S)


@pytest.mark.parametrize(("overrides", "target"), [
    ({}, ["examples/train.py"]),
    ({"script": None, "module": "pkg.sub.main"}, ["--module", "pkg.sub.main"]),
])
def test_the_target_comes_after_every_torchrun_option_and_the_args_verbatim_after_it(
        supervisor: Supervisor, code_dir: Path, recorded: Path,
        overrides: dict[str, Any], target: list[str]) -> None:
    args = ["--no-python", "  spaced ", "", "$(id)", "a;b"]
    supervisor.launch("job", 1, payload(code_dir, args=args, **overrides))
    argv = wait_for_file(recorded)["argv"]
    options = argv[:-len(target) - len(args)]
    assert argv[len(options):] == [*target, *args]
    assert options and all(option.startswith("--") and option != "--no-python" for option in options)


def test_nccl_files_land_in_the_generations_log_directory(supervisor: Supervisor, code_dir: Path,
                                                          recorded: Path) -> None:
    supervisor.launch("job", 2, payload(code_dir, nccl_env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "nccl.%h.%p.log",
                                                            "NCCL_TOPO_DUMP_FILE": "topo.xml"}))
    env = wait_for_file(recorded)["env"]
    generation_dir = supervisor.work_dir / "jobs" / "job" / "generation-2"
    assert env["NCCL_DEBUG_FILE"] == f"{generation_dir}/nccl.%h.%p.log"
    assert env["NCCL_TOPO_DUMP_FILE"] == f"{generation_dir}/topo.xml"


MODULE_MAIN = """\
import json, os, sys
with open(os.path.join(os.path.dirname(__file__), "ran.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "name": __name__, "spec": __spec__.name}, f)
"""


@pytest.mark.e2e
def test_a_module_runs_under_real_torchrun(tmp_path: Path, code_dir: Path, free_port: Callable[[], int]) -> None:
    (code_dir / "pkg" / "sub" / "main.py").write_text(MODULE_MAIN)
    exits: queue.Queue[ExitReport] = queue.Queue()
    sup = Supervisor(tmp_path / "real", on_exit=lambda job, gen, report: exits.put(report), warm_launcher=False)
    try:
        sup.launch("job", 1, payload(code_dir, script=None, module="pkg.sub.main", args=["--no-python", " x "],
                                     rdzv_endpoint=f"127.0.0.1:{free_port()}"))
        report = exits.get(timeout=90)
    finally:
        sup.shutdown(grace_s=1.0)
    assert report.exit_code == 0, report.log_tail
    ran = json.loads((code_dir / "pkg" / "sub" / "ran.json").read_text())
    assert ran == {"argv": ["--no-python", " x "], "name": "__main__", "spec": "pkg.sub.main"}
