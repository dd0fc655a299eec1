"""The supervisor when things around a generation go wrong: a rank that cannot be stopped politely
after a peer died, and the agent itself dying while its generation runs (real torchrun, gloo)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.protocol import dump
from agents.protocol.agent import ExitReport, LaunchedDetail, LaunchPayload
from agents.supervisor import Supervisor
from tests.waiting import wait_for

POLL_S = 0.05  # the agent and the supervisor answer in milliseconds: poll often

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

#: Prints a step line on every rank, all the time: under the old pipe to the agent, a dead agent
#: made the next print fail with BrokenPipeError.
STEPPING_SCRIPT = '''
import json, os, sys, time
import torch.distributed as dist

out_dir = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
tmp = os.path.join(out_dir, f"rank{rank}.tmp")
with open(tmp, "w") as f:
    json.dump({"pid": os.getpid()}, f)
os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
step = 0
while True:
    dist.barrier()
    step += 1
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(0.05)
'''

#: A stand-in for the agent process: launches one generation, prints what it launched, waits to be killed.
DYING_AGENT = '''
import json, sys, time
from pathlib import Path
from agents.protocol import dump, parse
from agents.protocol.agent import LaunchPayload
from agents.supervisor import Supervisor

sup = Supervisor(Path(sys.argv[1]), on_exit=lambda *a: None, default_grace_s=5.0)
detail = sup.launch("job", 1, parse(LaunchPayload, json.loads(sys.argv[2])))
print(json.dumps(dump(detail)), flush=True)
time.sleep(600)
'''


@pytest.fixture
def exits() -> queue.Queue[tuple[str, int, ExitReport]]:
    return queue.Queue()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(STEPPING_SCRIPT)
    return path


@pytest.fixture
def payload(script: Path, tmp_path: Path, free_port: Callable[[], int]) -> Callable[[Path], LaunchPayload]:
    def make(out: Path) -> LaunchPayload:
        out.mkdir(exist_ok=True)
        return LaunchPayload(script=script.name, workdir=str(script.parent),
                             args=[str(out)], nnodes=1, nproc_per_node=2, node_rank=0,
                             rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="job-1", require_gpu=False)
    return make


def rank_pids(out: Path) -> list[int]:
    return [json.loads((out / f"rank{rank}.json").read_text())["pid"] for rank in (0, 1)]


def ranks_ready(out: Path) -> bool:
    return all((out / f"rank{rank}.json").exists() for rank in (0, 1))


def newest_step(log_path: Path) -> int:
    steps = [int(line.split()[-1]) for line in log_path.read_text(errors="replace").splitlines()
             if line.startswith("rank 0 step ")]
    return max(steps, default=0)


def kill_quietly(pids: list[int]) -> None:
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


# --- a rank that cannot act on torchrun's SIGTERM ------------------------------------------------

def test_a_dead_rank_ends_the_generation_promptly_although_its_peer_is_stopped(
        tmp_path: Path, exits: queue.Queue[Any], payload: Callable[[Path], LaunchPayload],
        pid_alive: Callable[[int], bool]) -> None:
    sup = Supervisor(tmp_path / "work", on_exit=lambda job, gen, report: exits.put(report), default_grace_s=5.0)
    out = tmp_path / "out"
    pids: list[int] = []
    try:
        sup.launch("job", 1, payload(out))
        wait_for(lambda: ranks_ready(out), timeout=60, what="both ranks to start", interval=POLL_S)
        pids = rank_pids(out)
        os.kill(pids[1], signal.SIGSTOP)  # cannot handle torchrun's SIGTERM while stopped
        os.kill(pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
        report = exits.get(timeout=25)  # torchrun alone would wait 30 s for the stopped rank
        took = time.monotonic() - killed_at
    finally:
        kill_quietly(pids)
        sup.shutdown(grace_s=2.0)
    assert took < 10, f"the exit was reported {took:.1f} s after the rank died"
    assert not report.requested_stop and report.root_cause_rank == 0
    ranks = {r.rank: r for r in report.ranks}
    assert ranks[0].signal == 9 and ranks[0].pid == pids[0]
    assert report.signature == "signal" and report.exit_code != 0
    assert not pid_alive(pids[1])


def test_a_requested_stop_ends_a_stopped_rank_without_waiting_out_the_grace(
        tmp_path: Path, payload: Callable[[Path], LaunchPayload],
        pid_alive: Callable[[int], bool]) -> None:
    """The control plane stops a hung generation: a SIGSTOPped rank gets SIGCONT after SIGTERM
    (as systemd does), so it acts on the SIGTERM at once instead of being SIGKILLed after the grace."""
    sup = Supervisor(tmp_path / "work", on_exit=lambda *_: None, default_grace_s=60.0)
    out = tmp_path / "out"
    pids: list[int] = []
    try:
        sup.launch("job", 1, payload(out))
        wait_for(lambda: ranks_ready(out), timeout=60, what="both ranks to start", interval=POLL_S)
        pids = rank_pids(out)
        os.kill(pids[1], signal.SIGSTOP)
        started = time.monotonic()
        report = sup.stop("job", 1)
        took = time.monotonic() - started
    finally:
        kill_quietly(pids)
        sup.shutdown(grace_s=2.0)
    assert report is not None and report.requested_stop
    assert took < 30, f"stopping took {took:.1f} s: the stopped rank sat out the 60 s grace"
    assert not any(pid_alive(pid) for pid in pids)


# --- the agent dies, a new one adopts the generation ---------------------------------------------

@pytest.fixture
def orphaned_generation(tmp_path: Path,
                        payload: Callable[[Path], LaunchPayload]) -> Iterator[tuple[Path, Path, LaunchedDetail]]:
    """A generation whose agent process was SIGKILLed: (work dir, rank output dir, what was launched)."""
    work, out = tmp_path / "work", tmp_path / "out"
    helper = tmp_path / "dying_agent.py"
    helper.write_text(DYING_AGENT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    agent = subprocess.Popen([sys.executable, str(helper), str(work), json.dumps(dump(payload(out)))],
                             stdout=subprocess.PIPE, env=env, cwd=REPO)
    pids: list[int] = []
    launched = None
    try:
        assert agent.stdout is not None
        launched = LaunchedDetail(**json.loads(agent.stdout.readline()))
        wait_for(lambda: ranks_ready(out) and newest_step(Path(launched.log_path)) >= 5,
                 timeout=60, what="training to step", interval=POLL_S)
        pids = [launched.pid, *rank_pids(out)]
        agent.kill()
        agent.wait(timeout=10)
        yield work, out, launched
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        kill_quietly(pids if pids else ([launched.pid] if launched else []))


@pytest.mark.parametrize("ending", ["stop", "rank_dies"])
def test_a_new_agent_adopts_the_generation_of_an_agent_that_died(
        orphaned_generation: tuple[Path, Path, LaunchedDetail], exits: queue.Queue[Any],
        pid_alive: Callable[[int], bool], ending: str) -> None:
    work, out, launched = orphaned_generation
    log_path = Path(launched.log_path)
    step_at_death = newest_step(log_path)
    assert launched.warm  # the warm launcher was handed the log file as its output
    sup = Supervisor(work, on_exit=lambda job, gen, report: exits.put((job, gen, report)), warm_launcher=False)
    try:
        [adopted] = sup.adopt()
        assert (adopted.job, adopted.generation) == ("job", 1) and launched.pid in adopted.pids
        assert set(rank_pids(out)) <= set(adopted.pids)
        # Training went on without its agent: no broken pipe, and the new agent sees it step.
        wait_for(lambda: newest_step(log_path) >= step_at_death + 20,
                 timeout=30, what="training to go on after the agent died", interval=POLL_S)
        assert [(r.job, r.generation) for r in sup.running()] == [("job", 1)]
        if ending == "stop":
            report = sup.stop("job", 1, grace_s=5.0)
            assert report is not None and report.requested_stop and report.signature is None
            assert exits.get(timeout=5) == ("job", 1, report)
        else:
            os.kill(rank_pids(out)[1], signal.SIGKILL)
            job, generation, report = exits.get(timeout=30)
            assert (job, generation) == ("job", 1)
            assert not report.requested_stop and report.root_cause_rank == 1
            assert report.signature == "signal" and report.exit_code == 1  # derived from the failure table
        assert any(line.startswith("rank 0 step ") for line in report.log_tail)
        assert exits.empty()  # reported once
        # The exit is reported once torchrun has printed its failure table (its workers are gone);
        # its own interpreter may take a moment longer to go.
        wait_for(lambda: [pid for pid in [launched.pid, *rank_pids(out)] if pid_alive(pid)] == [],
                 timeout=10, what="torchrun and its ranks to be gone", interval=POLL_S)
        assert sup.running() == []
        wait_for(lambda: list((work / "running").iterdir()) == [],
                 timeout=5, what="the record to be removed", interval=POLL_S)
    finally:
        sup.shutdown(grace_s=2.0)


def test_records_of_generations_that_are_gone_are_reported_once_and_never_adopted(
        tmp_path: Path, exits: queue.Queue[Any], pid_alive: Callable[[int], bool]) -> None:
    work = tmp_path / "work"
    records = work / "running"
    records.mkdir(parents=True)
    bystander = subprocess.Popen(["sleep", "300"])  # holds the pid a stale record names
    finished = subprocess.Popen(["true"])
    finished.wait()  # reaped: its pid names nothing (or, later, someone else)
    try:
        log_dir = tmp_path / "logs"
        log_dir.mkdir()
        failed_log = log_dir / "failed.log"
        failed_log.write_text("rank 1 step 3\n[rank1]: ValueError: boom\nRoot Cause (first observed failure):\n"
                              "[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 4242)\n" + "=" * 54 + "\n")
        silent_log = log_dir / "silent.log"
        silent_log.write_text("rank 0 step 1\n")
        started = int(Path(f"/proc/{bystander.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])

        def record(job: str, pid: int, pid_started: int, log_path: Path) -> None:
            detail = LaunchedDetail(pid=pid, log_path=str(log_path), command=["torchrun"])
            (records / f"{job}@2.json").write_text(json.dumps({
                "job": job, "generation": 2, "pid": pid, "pid_started": pid_started, "log_path": str(log_path),
                "started_at": time.time() - 60, "launched": dump(detail)}))

        record("reused", bystander.pid, started - 1, silent_log)  # same pid, another process
        record("gone", finished.pid, 1, failed_log)
        (records / "torn@1.json").write_text('{"job": "torn", "pid": ')

        sup = Supervisor(work, on_exit=lambda job, gen, report: exits.put((job, gen, report)), warm_launcher=False)
        try:
            assert sup.adopt() == []
            reports = {job: report for job, _, report in (exits.get(timeout=10), exits.get(timeout=10))}
            assert sup.running() == []
        finally:
            sup.shutdown(grace_s=1.0)
        assert exits.empty()
        # Removed right after the report was handed over (a crash in between reports it again).
        wait_for(lambda: list(records.iterdir()) == [], timeout=5, what="the records to be removed", interval=POLL_S)
        assert pid_alive(bystander.pid)  # a reused pid is never signalled
        gone, reused = reports["gone"], reports["reused"]
        assert gone.exit_code == 1 and gone.root_cause_rank == 1 and gone.signature == "traceback"
        assert gone.error_line == "ValueError: boom" and not gone.requested_stop
        assert reused.exit_code is None and reused.signature == "unknown" and reused.log_tail == ["rank 0 step 1"]
        assert 0 < reused.runtime_s <= 61
        # The fence remembers the generations, as if this agent had launched them.
        with pytest.raises(Exception, match="older than generation 2"):
            Supervisor(work, on_exit=lambda *a: None, warm_launcher=False).check_fence("gone", 1)
    finally:
        bystander.kill()
        bystander.wait()
