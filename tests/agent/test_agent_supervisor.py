"""The torchrun supervisor against real 2-process torchrun runs (gloo on CPU)."""

from __future__ import annotations

import json
import queue
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.protocol.agent import ExitReport, LaunchedDetail, LaunchPayload
from agents.supervisor import OutputScan, StaleGeneration, Supervisor, attach_xids, classify_exit
from agents.supervisor import _core as supervisor_module
from tests.waiting import wait_for

POLL_S = 0.05  # the agent and the supervisor answer in milliseconds: poll often

pytestmark = pytest.mark.e2e


@pytest.fixture
def exits() -> queue.Queue[tuple[str, int, ExitReport]]:
    return queue.Queue()


@pytest.fixture
def supervisor(tmp_path: Path, exits: queue.Queue[tuple[str, int, ExitReport]]) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path / "work", on_exit=lambda job, gen, report: exits.put((job, gen, report)),
                     log_max_bytes=64 * 1024, log_backups=2, default_grace_s=5.0)
    yield sup
    sup.shutdown(grace_s=2.0)


@pytest.fixture
def launch(supervisor: Supervisor, train_script: Path, tmp_path: Path,
           free_port: Callable[[], int]) -> Callable[..., Path]:
    """``launch(mode, generation)``: start the training script; the directory it reports into."""
    def start(mode: str, generation: int = 1, **overrides: Any) -> Path:
        out = tmp_path / f"out-{mode}-{generation}"
        out.mkdir()
        payload = LaunchPayload(script="train.py", workdir=str(train_script.parent),
                                args=[str(out), mode], nnodes=1, nproc_per_node=2,
                                node_rank=0, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id=f"job-{generation}",
                                require_gpu=False, **overrides)
        supervisor.launch("job", generation, payload)
        return out
    return start


def family_pids(out: Path, rank_info: Callable[[Path, int], Any]) -> list[int]:
    pids = []
    for rank in (0, 1):
        info = rank_info(out, rank)
        pids += [info["pid"], *info["children"]]
    return pids


def test_stop_kills_every_process_of_the_generation(supervisor: Supervisor, launch: Callable[..., Path],
                                                    exits: queue.Queue[Any], rank_info: Callable[..., Any],
                                                    pid_alive: Callable[[int], bool]) -> None:
    out = launch("loop", generation=3, nccl_env={"NCCL_DEBUG": "WARN"}, hooks_url="http://cp:8000",
                 hooks_token="t0k", ckpt_dir="/ckpt/job")
    wait_for(lambda: rank_info(out, 0) and rank_info(out, 1), timeout=60, what="both ranks to start", interval=POLL_S)
    pids = family_pids(out, rank_info)
    [running] = wait_for(lambda: [r for r in supervisor.running() if set(pids) <= set(r.pids)],
                         timeout=10, what="the heartbeat view to list ranks and their children", interval=POLL_S)
    assert (running.job, running.generation) == ("job", 3)

    env = rank_info(out, 1)["env"]
    assert env["NIGHTWATCH_JOB"] == "job" and env["NIGHTWATCH_GENERATION"] == "3"
    assert env["NIGHTWATCH_URL"] == "http://cp:8000" and env["NIGHTWATCH_TOKEN"] == "t0k"
    assert env["NIGHTWATCH_CKPT_DIR"] == "/ckpt/job" and env["NIGHTWATCH_SPOOL_DIR"].endswith("generation-3/spool")
    assert "NIGHTWATCH_RESUME_FROM" not in env
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["NCCL_DEBUG"] == "WARN"

    report = supervisor.stop("job", 3, grace_s=5.0)
    assert report is not None and report.requested_stop and report.signature is None
    # Every rank, its child in the group and the child that left the group (setsid) are gone.
    assert [pid for pid in [*pids, running.pids[0]] if pid_alive(pid)] == []
    assert supervisor.running() == []
    job, generation, reported = exits.get(timeout=5)
    assert (job, generation, reported) == ("job", 3, report)
    assert "rank 1 ready" in Path(report.log_path).read_text()


@pytest.mark.parametrize(("mode", "signature", "rank1", "error"), [
    ("kill", "signal", {"signal": 9, "exit_code": None}, None),
    ("raise", "traceback", {"signal": None, "exit_code": 1}, "ValueError: boom at step 40"),
    ("pause", "paused", {"signal": None, "exit_code": 85}, None),
])
def test_a_failing_rank_is_reported_with_its_code_and_signature(
        launch: Callable[..., Path], exits: queue.Queue[Any], rank_info: Callable[..., Any],
        pid_alive: Callable[[int], bool],
        mode: str, signature: str, rank1: dict[str, Any], error: str | None) -> None:
    out = launch(mode)
    _, _, report = exits.get(timeout=90)
    assert not report.requested_stop and report.exit_code != 0
    assert report.signature == signature
    assert report.root_cause_rank == 1
    ranks = {r.rank: r for r in report.ranks}
    assert {"signal": ranks[1].signal, "exit_code": ranks[1].exit_code} == rank1
    if error is not None:
        assert report.error_line == error
    assert report.log_tail and report.runtime_s > 0
    # The failure is dated from torchrun's own log time (and the agent's sighting of the dead
    # rank), no later than the agent saw torchrun close the worker group.
    assert report.ended_at is not None
    if mode == "kill":
        assert report.torchrun_failed_at is not None and report.rank_exited_at is not None
    if report.torchrun_failed_at is not None:
        assert report.torchrun_failed_at <= report.ended_at
    if report.rank_exited_at is not None:
        assert report.rank_exited_at <= report.ended_at + supervisor_module.WATCH_TICK_S
    # A generation that ended on its own leaves nothing behind either, setsid'd children included.
    wait_for(lambda: not [pid for pid in family_pids(out, rank_info) if pid_alive(pid)],
             timeout=10, what="the children of the failed generation to be killed", interval=POLL_S)


def test_an_older_generation_is_refused(tmp_path: Path, train_script: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "generations.json").write_text(json.dumps({"job": 5}))  # seen before the agent restarted
    sup = Supervisor(work, on_exit=lambda *a: None)
    payload = LaunchPayload(script="train.py", workdir=str(train_script.parent),
                            nnodes=1, nproc_per_node=1, node_rank=0,
                            rdzv_endpoint="127.0.0.1:1", rdzv_id="x")
    with pytest.raises(StaleGeneration, match="generation 4 is older than generation 5"):
        sup.launch("job", 4, payload)
    with pytest.raises(StaleGeneration):
        sup.stop("job", 4)
    assert sup.stop("job", 5) is None  # the current generation, not running here: nothing to do
    assert sup.running() == []
    sup.shutdown()


def test_generations_start_in_the_warm_launcher_and_cold_without_it(
        tmp_path: Path, train_script: Path, exits: queue.Queue[Any], rank_info: Callable[..., Any],
        free_port: Callable[[], int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_module, "WARM_RESPAWN_DELAY_S", 0.1)

    def run(sup: Supervisor, generation: int, **snapshots: int) -> tuple[LaunchedDetail, dict[str, Any]]:
        out = tmp_path / f"out-{sup.work_dir.name}-{generation}"
        out.mkdir()
        payload = LaunchPayload(script="train.py", workdir=str(train_script.parent),
                                args=[str(out), "loop"], nnodes=1, nproc_per_node=2,
                                node_rank=0, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id=f"g{generation}",
                                nccl_env={"NCCL_DEBUG": "INFO"}, hooks_url="http://cp:8000", hooks_token="t0k",
                                **snapshots)
        detail = sup.launch("job", generation, payload)
        info = wait_for(lambda: rank_info(out, 1), timeout=60, what="rank 1 to start", interval=POLL_S)
        assert sup.stop("job", generation, grace_s=5.0).requested_stop
        return detail, info["env"]

    warm = Supervisor(tmp_path / "warm", on_exit=lambda *a: exits.put(a))
    try:
        first, env = run(warm, 1, snapshot_every=5, branch_generation=1)
        # The next one too: a fresh launcher replaced the one the first generation used.
        second, _ = run(warm, 2)
    finally:
        warm.shutdown(grace_s=2.0)
    assert first.warm and second.warm and first.pid != second.pid
    # The warm launcher became exactly the generation a cold start would have run.
    assert env["NIGHTWATCH_GENERATION"] == "1" and env["NIGHTWATCH_TOKEN"] == "t0k" and env["NCCL_DEBUG"] == "INFO"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    # The snapshot settings reach the ranks (the hooks restore snapshots of generation 1 on).
    assert (env["NIGHTWATCH_SNAPSHOT_EVERY"], env["NIGHTWATCH_BRANCH_GENERATION"]) == ("5", "1")

    cold = Supervisor(tmp_path / "cold", on_exit=lambda *a: exits.put(a), warm_launcher=False)
    try:
        detail, env = run(cold, 1)
    finally:
        cold.shutdown(grace_s=2.0)
    assert not detail.warm and env["NIGHTWATCH_GENERATION"] == "1"
    # A launch without them sets neither: the script's own snapshot_every, its own generation only.
    assert "NIGHTWATCH_SNAPSHOT_EVERY" not in env and "NIGHTWATCH_BRANCH_GENERATION" not in env


LINGERING_TORCHRUN = """\
import time
for line in ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
             "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
             "  exitcode  : -9 (pid: 4242)  (SIGKILL)", "=" * 54]:
    print(line, flush=True)
time.sleep(120)  # a torchrun whose interpreter takes its time to tear down
"""


def test_a_generation_ends_when_torchrun_has_printed_its_failure_table(
        tmp_path: Path, exits: queue.Queue[Any], pid_alive: Callable[[int], bool]) -> None:
    fake = tmp_path / "torchrun.py"
    fake.write_text(LINGERING_TORCHRUN)
    (tmp_path / "train.py").write_text("")
    sup = Supervisor(tmp_path / "work", on_exit=lambda job, gen, report: exits.put(report),
                     torchrun=[sys.executable, str(fake)])
    try:
        payload = LaunchPayload(script="train.py", workdir=str(tmp_path), nnodes=1, nproc_per_node=2, node_rank=0,
                                rdzv_endpoint="127.0.0.1:1", rdzv_id="x")
        detail = sup.launch("job", 1, payload)
        report = exits.get(timeout=20)  # not after the 120 s the fake torchrun would take
    finally:
        sup.shutdown(grace_s=1.0)
    assert not detail.warm  # a custom torchrun is never replaced by the warm launcher
    assert report.root_cause_rank == 1 and report.signature == "signal" and not report.requested_stop
    assert report.runtime_s < 20 and not pid_alive(detail.pid)


SLOW_CLOSING_TORCHRUN = """\
import subprocess, sys, time
workers = [subprocess.Popen(["sleep", "1"]), subprocess.Popen(["sleep", "300"])]
time.sleep(4)  # the first worker died at 1 s; torchrun takes its time to notice and close the group
workers[1].kill()
sys.exit(1)
"""


def test_a_worker_gone_is_told_at_once_while_torchrun_still_runs(
        tmp_path: Path, exits: queue.Queue[Any], pid_alive: Callable[[int], bool]) -> None:
    fake = tmp_path / "torchrun.py"
    fake.write_text(SLOW_CLOSING_TORCHRUN)
    (tmp_path / "train.py").write_text("")
    notices: queue.Queue[tuple[str, int, float, bool]] = queue.Queue()
    launched: list[LaunchedDetail] = []
    sup = Supervisor(tmp_path / "work", on_exit=lambda job, gen, report: exits.put(report),
                     torchrun=[sys.executable, str(fake)],
                     on_rank_gone=lambda job, gen, gone: notices.put((job, gen, gone.at, pid_alive(launched[0].pid))))
    try:
        launched.append(sup.launch("job", 4, LaunchPayload(script="train.py", workdir=str(tmp_path), nnodes=1,
                                                          nproc_per_node=2, node_rank=0,
                                                          rdzv_endpoint="127.0.0.1:1", rdzv_id="x")))
        job, generation, at, torchrun_running = notices.get(timeout=10)
        report = exits.get(timeout=20)
    finally:
        sup.shutdown(grace_s=1.0)
    assert (job, generation) == ("job", 4) and torchrun_running
    assert at == report.rank_exited_at and at < report.ended_at - 1.0  # seconds before torchrun's exit
    assert notices.empty()  # once per generation


SLOW_TO_STOP_TORCHRUN = """\
import signal, subprocess, sys, time
# A rank that finishes what it writes on SIGTERM (0.5 s), then says so on its way out.
RANK = (
    "import pathlib, signal, sys, time\\n"
    "def done(*_):\\n    time.sleep(0.5); pathlib.Path(sys.argv[1]).write_text('done'); sys.exit(0)\\n"
    "signal.signal(signal.SIGTERM, done)\\n"
    "pathlib.Path(sys.argv[1] + '.ready').touch()\\n"
    "while True: time.sleep(0.05)\\n"
)
signal.signal(signal.SIGTERM, lambda *_: time.sleep(60))  # torchrun's teardown, made long
rank = subprocess.Popen([sys.executable, "-c", RANK, sys.argv[-1]])
while True:
    time.sleep(0.05)
"""


def test_a_stop_waits_for_the_ranks_not_for_torchrun_s_own_teardown(
        tmp_path: Path, exits: queue.Queue[Any], pid_alive: Callable[[int], bool]) -> None:
    """Once every rank is gone nothing of the generation can write: torchrun is killed then, not
    waited for until the grace period ends (its teardown took 0.3-0.7 s of every relaunch). A rank
    still finishing its write on SIGTERM is waited for."""
    fake = tmp_path / "torchrun.py"
    fake.write_text(SLOW_TO_STOP_TORCHRUN)
    (tmp_path / "train.py").write_text("")
    marker = tmp_path / "rank-finished"
    sup = Supervisor(tmp_path / "work", on_exit=lambda job, gen, report: exits.put(report),
                     torchrun=[sys.executable, str(fake)], default_grace_s=20.0)
    try:
        detail = sup.launch("job", 1, LaunchPayload(script="train.py", workdir=str(tmp_path), nnodes=1,
                                                    nproc_per_node=1, node_rank=0, rdzv_endpoint="127.0.0.1:1",
                                                    rdzv_id="x", args=[str(marker)]))
        # The rank says when its SIGTERM handler is in place: a stop before that kills it outright.
        wait_for(lambda: Path(f"{marker}.ready").exists(), timeout=10,
                 what="the fake torchrun's rank", interval=POLL_S)
        asked = time.monotonic()
        report = sup.stop("job", 1)
        took = time.monotonic() - asked
    finally:
        sup.shutdown(grace_s=1.0)
    assert marker.read_text() == "done"  # the rank finished before torchrun was killed
    assert 0.5 <= took < 5.0 and report is not None and report.requested_stop
    assert not pid_alive(detail.pid)


# --- reading the output, without processes -------------------------------------------------------

TORCHRUN_FAILURE = """\
[rank0]:[E1130 12:00:00 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=42, OpType=ALLREDUCE) ran for 1800000 milliseconds before timing out.
[rank1]: Traceback (most recent call last):
[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 101)
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 102)
"""


def scan(text: str) -> OutputScan:
    result = OutputScan()
    for line in text.splitlines():
        result.feed(line)
    return result


def test_the_most_specific_evidence_wins() -> None:
    result = scan(TORCHRUN_FAILURE)
    assert result.root_cause_rank == 1
    assert {r.rank: (r.exit_code, r.signal, r.pid) for r in result.ranks.values()} == {0: (None, 6, 101),
                                                                                        1: (1, None, 102)}
    # The OOM on rank 1 made rank 0 time out: the OOM is the cause.
    assert classify_exit(1, result) == ("oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize(("line", "signature"), [
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1) ran for 600000 ms", "nccl_timeout"),
    ("[PG 0 Rank 1] Heartbeat monitor timed out! Process will be terminated after dumping debug info.",
     "nccl_watchdog"),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", "cuda_error"),
    ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", "xid"),
])
def test_signatures_from_the_log(line: str, signature: str) -> None:
    assert classify_exit(1, scan(line))[0] == signature


def test_a_clean_exit_has_no_signature_and_xids_outrank_the_log() -> None:
    assert classify_exit(0, scan("step 100 done")) == (None, None)
    report = ExitReport(exit_code=1, signature="cuda_error")
    assert attach_xids(report, [79]).signature == "xid" and attach_xids(report, [79]).xids == [79]
    assert attach_xids(ExitReport(exit_code=1, signature="paused"), [79]).signature == "paused"
