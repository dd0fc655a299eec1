"""Finding 5, and the launch-spec parts of finding 11: argument injection into torchrun.

Reproduced before the fix: a ``ci`` token launched ``entrypoint: "--no-python"`` with
``args: ["sh", "-c", "…"]``; torchrun read the entrypoint as its own option, and the real
``Supervisor`` ran the shell command (as root, with the node token in its environment). NCCL's file
variables accepted any path, args were whitespace-trimmed and unknown spec or policy keys dropped.

Now, against the real server (daphne + Celery + PostgreSQL + Redis) with a ``ci`` token, every such
spec is a 400 naming the field and no job is created; and the same payload handed straight to the
real ``Supervisor`` (the agent's own torchrun) is refused before anything starts: the file the shell
command would create never exists, while a legitimate script of the code directory does run, with
its arguments verbatim.
"""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from agents.protocol.agent import ExitReport, LaunchPayload, LaunchSpecError
from agents.supervisor import Supervisor
from tests.e2e.cluster import api
from tests.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def ci_token(transactional_db) -> str:
    """A CI pipeline's token: scope ``ci``, held by a user in the operator role (as ``cast`` does)."""
    from django.contrib.auth.models import Group, User

    from core.models import ApiToken

    user = User.objects.create_user("ci-bot")
    user.groups.add(Group.objects.get(name="operator"))
    return ApiToken.issue(name="ci", scope="ci", user=user)[1]


def injected_specs(marker: Path) -> list[tuple[dict, str, str]]:
    shell = ["sh", "-c", f"touch {marker}"]
    return [
        ({"name": "pwn", "entrypoint": "--no-python", "args": shell}, "entrypoint", "relative path"),
        ({"name": "pwn", "entrypoint": "--run-path=x", "args": shell}, "entrypoint", "relative path"),
        ({"name": "pwn", "entrypoint": "/bin/sh.py", "args": shell}, "entrypoint", "relative path"),
        ({"name": "pwn", "entrypoint": "../../../tmp/x.py"}, "entrypoint", "relative path"),
        ({"name": "pwn", "module": "pdb", "args": ["-c", f"import os; os.system('touch {marker}')"]}, "module",
         "standard-library"),
        ({"name": "pwn", "module": "-m torch.distributed.run", "args": ["--no-python", *shell]}, "module",
         "dotted Python module name"),
        ({"name": "pwn", "entrypoint": "t.py", "module": "pkg.train"}, "entrypoint", "exactly one"),
        ({"name": "pwn", "entrypoint": "t.py", "nccl_profile": {"NCCL_DEBUG_FILE": "/etc/cron.d/nightwatch"}},
         "nccl_profile", "bare file name"),
        ({"name": "pwn", "entrypoint": "t.py", "nccl_profile": {"NCCL_TOPO_DUMP_FILE": "../../root/.bashrc"}},
         "nccl_profile", "bare file name"),
        ({"name": "pwn", "entrypoint": "t.py", "nccl_profile": {"LD_PRELOAD": "/tmp/evil.so"}}, "nccl_profile",
         "unknown variable"),
        ({"name": "pwn", "entrypoint": "t.py", "torchrun_args": ["--no-python"]}, "torchrun_args",
         "Unknown field"),
        ({"name": "pwn", "entrypoint": "t.py", "recovery_policy": {"max_restart": 0}},
         "recovery_policy.max_restart", "Unknown field"),
        ({"name": "pwn", "entrypoint": "t.py", "checkpoint_policy": {"dir": "/etc"}}, "checkpoint_policy.dir",
         "is outside"),
        ({"name": "pwn", "entrypoint": "t.py", "checkpoint_policy": {"replica_dir": "/etc"}},
         "checkpoint_policy.replica_dir", "no root is configured"),
        ({"name": "pwn", "entrypoint": "t.py", "checkpoint_policy": {"keep": 1}}, "checkpoint_policy.keep",
         "Unknown field"),
    ]


def test_an_injected_spec_is_a_400_naming_the_field_and_creates_no_job(cluster, ci_token, tmp_path):
    from jobs.models import Job

    marker = tmp_path / "pwned"
    for body, field, reason in injected_specs(marker):
        status, problem = api(cluster, ci_token, "POST", "/api/v1/jobs", body)
        assert status == 400, (body, problem)
        assert any(e["field"] == field and reason in e["reason"] for e in problem["errors"]), (body, problem)
    assert not Job.objects.exists() and not marker.exists()
    # The same token launches a clean spec, its arguments exactly as sent: the refusals were the spec's.
    args = ["  --lr ", "1e-3", "", "--no-python"]
    status, job = api(cluster, ci_token, "POST", "/api/v1/jobs",
                      {"name": "clean", "entrypoint": "examples/train.py", "args": args, "accelerator": "cpu",
                       "nccl_profile": {"NCCL_DEBUG_FILE": "nccl.%h.%p.log"}})
    assert status == 201, job
    assert Job.objects.get(pk=job["id"]).args == args


LEGITIMATE = """\
import pathlib, sys
pathlib.Path(sys.argv[1]).write_text(repr(sys.argv[2:]))
"""


def test_the_real_supervisor_refuses_an_injected_payload_and_runs_nothing(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(LEGITIMATE)
    marker, ran = tmp_path / "pwned", tmp_path / "ran"
    exits: queue.Queue[ExitReport] = queue.Queue()
    supervisor = Supervisor(tmp_path / "work", on_exit=lambda job, gen, report: exits.put(report),
                            warm_launcher=False)

    def payload(**target) -> LaunchPayload:
        return LaunchPayload(nnodes=1, nproc_per_node=1, node_rank=0, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                             rdzv_id="pwn", require_gpu=False, workdir=str(code), **target)

    shell = ["sh", "-c", f"touch {marker}"]
    try:
        for target in ({"script": "--no-python", "args": shell},
                       {"module": "torch.distributed.run", "args": ["--nproc-per-node=1", "--no-python", *shell]},
                       {"script": "../../../../bin/sh.py", "args": shell}):
            with pytest.raises(LaunchSpecError):
                supervisor.launch("pwn", 1, payload(**target))
            assert supervisor.running() == [] and not marker.exists()
        # The control: a script of the code directory runs, its arguments verbatim after it.
        supervisor.launch("pwn", 1, payload(script="train.py", args=[str(ran), "--no-python", " sh "]))
        report = exits.get(timeout=120)
    finally:
        supervisor.shutdown(grace_s=2.0)
    assert report.exit_code == 0, report.log_tail
    assert ran.read_text() == repr(["--no-python", " sh "])
    assert not marker.exists()
