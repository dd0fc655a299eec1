"""What a launch may run: the script or module rules and the NCCL file placement, shared by the API,
the CLI, the agent and the Slurm script (``agents.protocol.agent``)."""

from __future__ import annotations

import pytest

from agents.protocol import ProtocolError
from agents.protocol.agent import (
    Command,
    LaunchSpecError,
    module_files,
    module_problem,
    nccl_environment,
    parse_command_payload,
    script_problem,
    validate_launch_target,
)

LAUNCH = {"script": "examples/train.py", "nnodes": 1, "nproc_per_node": 1, "node_rank": 0,
          "rdzv_endpoint": "10.0.0.1:29400", "rdzv_id": "nw-1-g1"}


@pytest.mark.parametrize("script", ["train.py", "examples/train.py", "a/b-c/d_e.f.py", "_private/x.py", "0.py"])
def test_good_scripts(script: str) -> None:
    assert script_problem(script) is None


@pytest.mark.parametrize("script", [
    "--no-python", "-m", "-train.py", "examples/-x.py",  # would read as a torchrun option
    "/etc/train.py", "../train.py", "a/../../train.py", "./train.py", ".hidden/train.py",  # out of the code dir
    "train", "train.sh", "examples/", "a//b.py", "", " train.py", "train.py ", "tr ain.py", "tr\0ain.py",
    "tr\nain.py", "a\\b.py", "$(id).py", "x" * 498 + ".py",
])
def test_bad_scripts(script: str) -> None:
    assert script_problem(script)


@pytest.mark.parametrize("module", ["train", "pkg.train", "_pkg.sub_2.main"])
def test_good_modules(module: str) -> None:
    assert module_problem(module) is None


@pytest.mark.parametrize(("module", "reason"), [
    ("-m pkg", "dotted"), ("pkg.", "dotted"), (".pkg", "dotted"), ("pkg..train", "dotted"), ("pkg/train", "dotted"),
    ("2pkg", "dotted"), ("pkg train", "dotted"), ("x" * 201, "dotted"),
    # Modules that turn their arguments into code, or that python -m finds before the code directory.
    ("pdb", "standard-library"), ("runpy", "standard-library"), ("timeit", "standard-library"),
    ("os.path", "standard-library"), ("sys", "standard-library"), ("code", "standard-library"),
])
def test_bad_modules(module: str, reason: str) -> None:
    assert reason in (module_problem(module) or "")


@pytest.mark.parametrize(("script", "module", "field"), [
    (None, None, "script"), ("t.py", "pkg.train", "script"), ("--no-python", None, "script"), (None, "pdb", "module"),
])
def test_exactly_one_good_target(script: str | None, module: str | None, field: str) -> None:
    with pytest.raises(LaunchSpecError) as caught:
        validate_launch_target(script, module)
    assert caught.value.field == field


def test_a_module_of_the_code_directory_needs_every_init() -> None:
    assert module_files("train") == [("train.py",), ("train/__init__.py", "train/__main__.py")]
    assert module_files("pkg.sub.main") == [
        ("pkg/__init__.py", "pkg/sub/__init__.py", "pkg/sub/main.py"),
        ("pkg/__init__.py", "pkg/sub/__init__.py", "pkg/sub/main/__init__.py", "pkg/sub/main/__main__.py")]


def launch_command(**overrides: object) -> Command:
    return Command(id="c", kind="launch", idempotency_key="k", job="1", generation=1, payload={**LAUNCH, **overrides})


@pytest.mark.parametrize(("overrides", "field"), [
    ({"script": "--no-python", "args": ["sh", "-c", "touch /tmp/pwned"]}, "script"),
    ({"script": None, "module": "torch.distributed.run"}, None),  # well-formed: the agent checks the code dir
    ({"script": None, "module": "pdb", "args": ["-c", "import os"]}, "module"),
    ({"module": "pkg.train"}, "script"),
    ({"args": ["fine", "nul\0"]}, "args.1"),
])
def test_the_agent_refuses_an_injected_payload_before_it_reaches_the_supervisor(overrides, field) -> None:
    if field is None:
        parse_command_payload(launch_command(**overrides))
        return
    with pytest.raises(ProtocolError) as caught:  # LaunchSpecError, or the wire schema's own (NUL)
        parse_command_payload(launch_command(**overrides))
    assert caught.value.field.removeprefix("payload.") == field


def test_args_travel_verbatim() -> None:
    args = ["  --lr ", "1e-3", "", "a b", "$(id)", "--no-python", "é"]
    assert parse_command_payload(launch_command(args=args)).args == args


def test_nccl_files_are_placed_in_the_log_directory() -> None:
    env = nccl_environment({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "nccl.%h.%p.log",
                            "NCCL_TOPO_DUMP_FILE": "topo.xml"}, "/var/lib/nw/jobs/1/generation-2/")
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "/var/lib/nw/jobs/1/generation-2/nccl.%h.%p.log",
                   "NCCL_TOPO_DUMP_FILE": "/var/lib/nw/jobs/1/generation-2/topo.xml"}
    assert nccl_environment({"NCCL_DEBUG_FILE": "d.log"}, "/logs", prefix="generation-3-") == {
        "NCCL_DEBUG_FILE": "/logs/generation-3-d.log"}


@pytest.mark.parametrize(("nnodes", "node_rank"), [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_the_nodes_meet_in_the_static_rendezvous_at_the_rank_the_control_plane_gave(tmp_path, nnodes,
                                                                                    node_rank) -> None:
    """Node rank 0 hosts the store; no node's rank is left to the order the nodes joined in."""
    from pathlib import Path

    from agents.supervisor import Supervisor

    payload = parse_command_payload(launch_command(nnodes=nnodes, node_rank=node_rank, rdzv_is_host=node_rank == 0))
    supervisor = Supervisor(tmp_path, on_exit=lambda *exit: None, warm_launcher=False)
    try:
        command = supervisor._command(payload, Path(__file__).resolve().parents[2])
    finally:
        supervisor.shutdown(grace_s=1.0)
    rendezvous = [option for option in command if option.startswith(("--rdzv", "--node-rank", "--nnodes"))]
    assert rendezvous == [f"--nnodes={nnodes}", "--rdzv-backend=static", f"--rdzv-endpoint={payload.rdzv_endpoint}",
                          f"--rdzv-id={payload.rdzv_id}", f"--node-rank={node_rank}"]
