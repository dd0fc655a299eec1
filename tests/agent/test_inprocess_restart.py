"""In-process restarts on real torchrun, through the agent's supervisor with warm workers
(``agents.hooks.inprocess``, ``agents.supervisor.warm_client``): a rank killed in the middle of a
snapshot copy, a rank that lost its node's memory, and the rank holding its partner's copy, one
after the other in one generation. The dead rank is replaced from the zygote, the survivors keep
their interpreters, torchrun never sees a failure, every resume takes the newest snapshot whole on
every rank (never a torn one), and the run ends bit-identical to one never interrupted. What is not
restarted in process (an exception, the budget spent, a node held after an Xid) ends the generation
as before, with its root cause.
"""

from __future__ import annotations

import queue
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agents.protocol.agent import ExitReport, LaunchPayload
from agents.supervisor import STOPPED_WORKER_KILL_S, Supervisor, warm_client
from tests.agent.conftest import free_port
from tests.hooks.conftest import REPO, torchrun
from tests.hooks.test_exact_resume import assert_same_run

pytestmark = pytest.mark.e2e

STEPS = 18
COMMON = ["--steps", str(STEPS), "--ckpt-every", "8", "--check-every", "5", "--snapshot-every", "1"]
#: attempt:kind:rank:step (tests/hooks/snapshot_run.py; in process, the attempt is the round): rank 1
#: dies copying snapshot 5; in round 1 its replacement loses its snapshots and dies at step 11; in
#: round 2 rank 0, which holds rank 1's copies, dies at step 15.
FAULTS = "0:copy:1:5,1:lose:1:11,2:kill:0:15"
#: Each rank's node memory apart (``SNAPSHOT_NODES``): rank 1's loss leaves rank 0's copy of it.
NODES = "0:a,b"


@dataclass
class Generation:
    report: ExitReport
    log: str
    notices: list[tuple[Any, ...]]
    directory: Path


def supervised(directory: Path, monkeypatch: pytest.MonkeyPatch, *, restarts: int | None, faults: str = "",
               extra: tuple[str, ...] = (), hold: str | None = None, nodes: str = "") -> Generation:
    """One generation of ``tests.hooks.snapshot_run`` (examples/train.py with planted faults) on
    two ranks, launched as the agent launches it, with ``restarts`` in-process restarts a rank."""
    monkeypatch.setenv("SNAPSHOT_FAULTS", faults)
    monkeypatch.setenv("SNAPSHOT_NODES", nodes)
    monkeypatch.setenv("NIGHTWATCH_SNAPSHOT_DIR", str(directory / "memory"))
    exits: queue.Queue[ExitReport] = queue.Queue()
    notices: list[tuple[Any, ...]] = []
    supervisor = Supervisor(directory / "agent", on_exit=lambda job, gen, report: exits.put(report),
                            on_rank_gone=lambda *notice: notices.append(notice), default_grace_s=5.0,
                            warm_workers=True)
    if hold:
        supervisor.hold_replacements(hold)
    ckpt = directory / "ckpt"
    try:
        supervisor.launch("job", 1, LaunchPayload(
            module="tests.hooks.snapshot_run", workdir=str(REPO), nnodes=1, nproc_per_node=2, node_rank=0,
            rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="job-1", require_gpu=False, snapshot_every=1,
            ckpt_dir=str(ckpt), inprocess_restarts=restarts,
            args=[*COMMON, "--log-samples", str(directory / "samples"), "--final-state", str(directory / "final"),
                  *extra]))
        report = exits.get(timeout=150)
    finally:
        supervisor.shutdown(grace_s=2.0)
        # A run that ends without its final checkpoint keeps its snapshots in node memory.
        shutil.rmtree(directory / "memory", ignore_errors=True)
    log = (directory / "agent" / "jobs" / "job" / "generation-1" / "torchrun.log").read_text()
    return Generation(report, log, notices, directory)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("uninterrupted")
    run = torchrun([*COMMON, "--ckpt-dir", str(directory / "ckpt"), "--log-samples", str(directory / "samples"),
                    "--final-state", str(directory / "final")], module="tests.hooks.snapshot_run", timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    return directory


def test_ranks_restart_in_process_after_a_torn_copy_a_lost_memory_and_a_killed_holder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: Path) -> None:
    run = supervised(tmp_path, monkeypatch, restarts=3, faults=FAULTS, nodes=NODES)
    assert run.report.exit_code == 0 and run.report.signature is None, run.log[-4000:]
    assert run.log.count(warm_client.REPLACEMENT_LINE) == 3, run.log[-4000:]
    for line in ("rank 1 killed in the middle of the snapshot copy of step 5",
                 "rank 1 lost its snapshots and is killed at step 11", "rank 0 killed at step 15"):
        assert line in run.log
    assert "exitcode" not in run.log, "torchrun saw a failure"
    for number in (1, 2, 3):
        assert f"round {number} of the process group formed" in run.log

    resumes = [(int(step), line) for line in run.log.splitlines()
               for step in re.findall(r"resumed from step (\d+) \(snapshot ", line)]
    steps = [step for step, _ in resumes]
    assert len(steps) == 6, run.log[-4000:]  # 3 in-process restarts, 2 ranks each
    torn, lost, killed = sorted(steps)[0:2], sorted(steps)[2:4], sorted(steps)[4:6]
    assert torn == [4, 4], "the snapshot torn at step 5 must never be restored"
    assert re.search(r"not restoring snapshot step-00000005-\S+: this rank stopped before it was committed", run.log)
    assert lost == [10, 10], "lost work: one step at most"
    assert [line for step, line in resumes if step == 10 and "rank 0's copy" in line], (
        "rank 1 lost its memory: its snapshot comes from its partner's copy")
    assert killed[0] == killed[1] and killed[0] in (13, 14), "lost work: one step (and the one in flight)"
    # The agent told the control plane of each death at once, one notice each (and, as for every
    # generation, maybe one more when the first rank exits at the end of the run).
    assert len(run.notices) in (3, 4) and all(notice[:2] == ("job", 1) for notice in run.notices)

    assert_same_run(tmp_path, uninterrupted, STEPS)


def test_a_stopped_rank_is_killed_by_the_agent_and_replaced_in_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: Path) -> None:
    """A hung rank (SIGSTOPped at step 9) holds its peer in the next collective for ever. The
    supervisor finds it stopped, tells of it (``stopped_s``), kills it after STOPPED_WORKER_KILL_S,
    and the replacement resumes the group from the newest whole snapshot, as for a crash; the run
    ends bit-identical to an uninterrupted one."""
    started = time.monotonic()
    run = supervised(tmp_path, monkeypatch, restarts=2, faults="0:stop:1:9")
    assert run.report.exit_code == 0 and run.report.signature is None, run.log[-4000:]
    assert "rank 1 stopped at step 9" in run.log
    assert run.log.count(warm_client.REPLACEMENT_LINE) == 1 and "killed by signal 9" in run.log, run.log[-4000:]
    resumed = sorted(int(step) for step in re.findall(r"resumed from step (\d+) \(snapshot ", run.log))
    # The step it stopped in is lost, and the snapshot of step 8 if its copy was in flight (a
    # stopped rank's snapshot thread stops too): never a torn one.
    assert resumed in ([8, 8], [7, 7]), run.log[-4000:]
    stopped = [notice[2] for notice in run.notices if notice[2].stopped_s is not None]
    assert len(stopped) == 1 and STOPPED_WORKER_KILL_S <= stopped[0].stopped_s < STOPPED_WORKER_KILL_S + 1.0
    assert time.monotonic() - started < 120
    assert_same_run(tmp_path, uninterrupted, STEPS)


def test_an_exception_is_not_restarted_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = supervised(tmp_path, monkeypatch, restarts=3, extra=("--raise-at", "6", "--fault-rank", "1"))
    # A deterministic bug would repeat: the generation ends at once, named by its exception, and
    # the survivor is not left waiting for a replacement that does not come.
    assert run.report.exit_code != 0 and run.report.root_cause_rank == 1
    assert "injected deterministic failure at step 6" in (run.report.error_line or ""), run.log[-3000:]
    assert warm_client.REPLACEMENT_LINE not in run.log and "did not form" not in run.log
    assert run.report.runtime_s < 30, "the survivor waited for a round that could not form"


@pytest.mark.parametrize(("restarts", "faults", "hold"), [
    (1, "0:kill:1:5,1:kill:1:9", None),  # the budget: one replacement, then the second death stands
    (3, "0:kill:1:5", "GPU 0: Xid 79"),  # the node failed its health check before the crash
])
def test_a_crash_past_the_budget_or_on_a_held_node_ends_the_generation_as_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restarts: int, faults: str, hold: str | None) -> None:
    run = supervised(tmp_path, monkeypatch, restarts=restarts, faults=faults, hold=hold)
    assert run.report.exit_code != 0 and run.report.signature == "signal", run.log[-3000:]
    assert run.report.root_cause_rank == 1 and run.report.ranks[1].signal == 9
    assert run.log.count(warm_client.REPLACEMENT_LINE) == (0 if hold else 1)
