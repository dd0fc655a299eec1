"""The batch script and sbatch options of a generation (pure: no Slurm needed)."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from agents.protocol import agent as wire
from nodes.transports.slurm import script


def payload(**overrides):
    raw = {"script": "examples/train.py", "nnodes": 2, "nproc_per_node": 4, "node_rank": 0,
           "rdzv_endpoint": "gpu-01:29400", "rdzv_id": "nw-7-g3", "args": ["--lr", "1e-3"],
           "nccl_env": {"NCCL_IB_HCA": "mlx5_0"}, "hooks_url": "http://cp:8000", "ckpt_dir": "/ckpt/job-7",
           "resume_from": "/ckpt/job-7/step-00000100", "skip_data": [[10, 20]], **overrides}
    return wire.parse_command_payload(wire.Command(id="0", kind="launch", idempotency_key="k", job="7", generation=3,
                                                   payload=raw))


def render(p=None, **kwargs):
    return script.render(job="7", generation=3, payload=p or payload(), hostnames=["gpu-01", "gpu-02"],
                         excluded=["gpu-09"], python="/opt/venv/bin/python", workdir="/srv/code",
                         output_path="/logs/g3.out", spool_dir="/logs/g3-spool", partition="train", **kwargs)


def test_the_options_pin_the_placement_exclude_kept_out_nodes_and_turn_slurms_requeue_off():
    batch = render(extra_options=["--account=ml"])
    assert batch.options == [
        "--job-name=nw-7-g3", "--nodes=2", "--ntasks-per-node=1", "--nodelist=gpu-01,gpu-02", "--exclusive",
        "--no-requeue", "--output=/logs/g3.out", "--chdir=/srv/code",
        "--export=PATH,LANG,SLURM_CONF,NIGHTWATCH_TOKEN", "--exclude=gpu-09", "--partition=train", "--account=ml"]


def test_the_script_sets_the_hooks_environment_as_the_agent_does_and_holds_no_token():
    text = render().script
    for line in ["export NIGHTWATCH_URL=http://cp:8000", "export NIGHTWATCH_JOB=7", "export NIGHTWATCH_GENERATION=3",
                 "export NIGHTWATCH_CKPT_DIR=/ckpt/job-7", "export NIGHTWATCH_RESUME_FROM=/ckpt/job-7/step-00000100",
                 "export NIGHTWATCH_SPOOL_DIR=/logs/g3-spool", "export NIGHTWATCH_SKIP_DATA=10-20",
                 "export NCCL_IB_HCA=mlx5_0", "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]:
        assert line in text.splitlines()
    assert "TOKEN" not in text
    assert '--rdzv-endpoint="$rdzv_host":29400' in text and "--max-restarts=0" in text
    assert "srun --export=ALL" in text and "--kill-on-bad-exit=1" in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # it parses


def test_the_snapshot_settings_are_exported_only_when_the_launch_sets_them():
    lines = render(payload(snapshot_every=25, branch_generation=2)).script.splitlines()
    assert "export NIGHTWATCH_SNAPSHOT_EVERY=25" in lines and "export NIGHTWATCH_BRANCH_GENERATION=2" in lines
    assert not [line for line in render().script.splitlines() if "SNAPSHOT" in line or "BRANCH" in line]


def test_hostile_arguments_stay_single_words():
    nasty = ["$(touch /tmp/pwned)", "a b; rm -rf /", "`id`", "it's"]
    text = render(payload(args=nasty)).script
    last = text.rstrip("\n").splitlines()[-1]
    assert shlex.split(last) == ["examples/train.py", *nasty]


@pytest.mark.parametrize("bad", ["gpu-01,gpu-02", "gpu 1", "-x", "gpu[1-2]", ""])
def test_a_node_name_that_is_not_one_name_is_refused(bad):
    with pytest.raises(ValueError, match="not a single Slurm node name"):
        script.render(job="7", generation=3, payload=payload(), hostnames=[bad], excluded=[], python="python",
                      workdir="/w", output_path="/o", spool_dir="/s")


def target_check(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("if ! "))


def test_a_module_runs_with_torchrun_module_after_every_option_and_must_be_in_the_work_directory(tmp_path):
    text = render(payload(script=None, module="pkg.train", args=["--no-python", "sh"])).script
    lines = text.rstrip("\n").splitlines()
    assert shlex.split(lines[-1]) == ["--module", "pkg.train", "--no-python", "sh"]
    assert "--max-restarts=0" in lines[-2]  # torchrun's own options all come before
    check = target_check(text)
    missing = subprocess.run(["bash", "-c", check], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert missing.returncode == 2 and "module pkg.train is not in the work directory" in missing.stderr
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text("")
    # Without __init__.py, pkg is a namespace package: an installed "pkg" would win the import.
    assert subprocess.run(["bash", "-c", check], cwd=tmp_path, check=False).returncode == 2
    (tmp_path / "pkg" / "__init__.py").write_text("")
    assert subprocess.run(["bash", "-c", check], cwd=tmp_path, check=False).returncode == 0


def test_the_script_must_be_in_the_work_directory(tmp_path):
    check = target_check(render().script)
    assert subprocess.run(["bash", "-c", check], cwd=tmp_path, capture_output=True, check=False).returncode == 2
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "train.py").write_text("")
    assert subprocess.run(["bash", "-c", check], cwd=tmp_path, check=False).returncode == 0


@pytest.mark.parametrize(("overrides", "field"), [
    ({"script": "--no-python"}, "script"),
    ({"script": "/bin/sh"}, "script"),
    ({"script": "../outside.py"}, "script"),
    ({"script": None, "module": "pdb"}, "module"),
    ({"script": None}, "script"),
    ({"args": ["ok", "nul\0"]}, "args.1"),
    ({"nccl_env": {"NCCL_DEBUG_FILE": "/etc/cron.d/x"}}, "nccl_env.NCCL_DEBUG_FILE"),
])
def test_a_payload_nobody_parsed_is_checked_again(overrides, field):
    raw = {"script": "examples/train.py", "nnodes": 1, "nproc_per_node": 1, "node_rank": 0,
           "rdzv_endpoint": "gpu-01:29400", "rdzv_id": "nw-7-g3", **overrides}
    with pytest.raises(wire.LaunchSpecError) as caught:
        render(wire.LaunchPayload(**raw))
    assert caught.value.field == field


def test_nccl_files_are_written_next_to_the_generations_output():
    text = render(payload(nccl_env={"NCCL_DEBUG_FILE": "nccl.%h.%p.log", "NCCL_TOPO_DUMP_FILE": "topo.xml"})).script
    assert "export NCCL_DEBUG_FILE=/logs/generation-3-nccl.%h.%p.log" in text.splitlines()
    assert "export NCCL_TOPO_DUMP_FILE=/logs/generation-3-topo.xml" in text.splitlines()
