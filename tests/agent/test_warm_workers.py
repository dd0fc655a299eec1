"""The zygote and its warm client (``agents.supervisor.zygote``, ``warm_client.py``): a rank forked
from the zygote must look to torchrun exactly like a cold ``python -u script.py``.

The zygote here is forked off a small stand-in for torchrun (no torch imported: the protocol is
what is tested); the real thing, under torchrun, is in test_agent_supervisor.py.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.protocol.agent import ExitReport, LaunchedDetail, LaunchPayload
from agents.supervisor import Supervisor, warm_client, zygote
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.02

#: Stands for torchrun: forks the zygote, says so, and waits (the zygote dies with it).
PARENT = """
import signal, sys
from agents.supervisor import zygote
spec = zygote.start(zygote.listen(sys.argv[1]))
if spec is not None:
    zygote.run_and_exit(spec)
print("ready", flush=True)
signal.pause()
"""

#: The rank's script: reports what it became, then does what argv[1] says.
SCRIPT = """
import json, os, signal, sys, time
from pathlib import Path
out = Path(os.environ["OUT"])
info = {"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("X"), "name": __name__, "pid": os.getpid(),
        "ppid": os.getppid(), "sid": os.getsid(0), "path0": sys.path[0], "file": __file__,
        "agent_var": os.environ.get("ONLY_IN_ZYGOTE")}
(out / "info.json.tmp").write_text(json.dumps(info))
os.replace(out / "info.json.tmp", out / "info.json")
print("to stdout", flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "kill-once":  # an in-process restart's replacement finds the variable set
    replacement = os.environ.get("NIGHTWATCH_INPROCESS_REPLACEMENT")
    if not replacement:
        os.kill(os.getpid(), signal.SIGKILL)
    (out / "replacement").write_text(replacement)
if mode == "raise":
    raise ValueError("boom")
if mode == "term":
    def on_term(signum, frame):
        (out / "got-term").write_text("1")
        sys.exit(3)
    signal.signal(signal.SIGTERM, on_term)
if mode == "end":  # falls off the end, with a thread still to join and an atexit handler
    import atexit, threading
    atexit.register(lambda: (out / "atexit").write_text("1"))
    threading.Thread(target=lambda: (time.sleep(0.2), (out / "thread").write_text("1"))).start()
if mode in ("term", "wait"):
    (out / "waiting").write_text("1")
    while True:
        time.sleep(0.01)
"""


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Every process a test starts; killed (with its group) at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = zygote.private_socket_dir()
    yield path
    zygote.remove_socket_dir(path)
    assert not path.exists()


@pytest.fixture
def zygote_at(socket_dir: Path, started: list[subprocess.Popen[bytes]]) -> Callable[[], str]:
    """``zygote_at()``: start a zygote (under a stand-in torchrun); its socket's path."""
    def start() -> str:
        path = str(socket_dir / "sock")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "ONLY_IN_ZYGOTE": "1"}
        parent = subprocess.Popen([sys.executable, "-u", "-c", PARENT, path], env=env, stdout=subprocess.PIPE,
                                  start_new_session=True)
        started.append(parent)
        assert parent.stdout is not None and parent.stdout.readline() == b"ready\n"
        return path
    return start


@pytest.fixture
def rank(tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> Callable[..., subprocess.Popen[bytes]]:
    """``rank(socket, *args)``: start the warm client as torchrun would (own session, output to files)."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "script.py").write_text(SCRIPT)

    def start(socket_path: str, *args: str, target: tuple[str, ...] = ("script.py",),
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        environment = {k: v for k, v in os.environ.items() if k != "ONLY_IN_ZYGOTE"}
        environment.update(OUT=str(tmp_path), X="from the client", PYTHONPATH=str(tmp_path / "code"), RANK="1",
                           **(env or {}))
        with open(tmp_path / "stdout", "wb") as out, open(tmp_path / "stderr", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-u", zygote.CLIENT, socket_path, *target, *args],
                                    cwd=tmp_path / "code", env=environment, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=err, start_new_session=True)
        started.append(proc)
        return proc
    return start


def info(tmp_path: Path) -> dict:
    return json.loads(wait_for(lambda: (tmp_path / "info.json").exists() and (tmp_path / "info.json").read_text(),
                               timeout=30, what="the rank's report", interval=POLL_S))


state = zygote._state  # a process's state letter from /proc; None once it is gone


def gone(pid: int) -> bool:
    return state(pid) in (None, "Z")


def test_a_forked_rank_becomes_the_script_with_the_clients_fds_env_cwd_and_argv(
        zygote_at: Callable[[], str], rank: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    client = rank(zygote_at(), "exit", "7")
    assert client.wait(timeout=30) == 7
    got = info(tmp_path)
    code = str(tmp_path / "code")
    assert got["argv"] == ["script.py", "exit", "7"] and got["name"] == "__main__"
    assert got["cwd"] == code and got["path0"] == code and got["file"] == f"{code}/script.py"
    # The client's environment replaced the zygote's: a variable only the zygote had is gone.
    assert got["x"] == "from the client" and got["agent_var"] is None
    # A child of the zygote, not of the client, in a session of its own (as torchrun's workers are).
    assert got["ppid"] != client.pid and got["sid"] == got["pid"] != client.pid
    assert (tmp_path / "stdout").read_text() == "to stdout\n"
    assert (tmp_path / "stderr").read_text() == "to stderr\n"


def test_a_module_target_runs_as_python_dash_m(zygote_at: Callable[[], str],
                                               rank: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    client = rank(zygote_at(), "exit", "0", target=("-m", "script"))
    assert client.wait(timeout=30) == 0
    got = info(tmp_path)
    assert got["argv"][1:] == ["exit", "0"] and got["argv"][0].endswith("script.py") and got["name"] == "__main__"


@pytest.mark.parametrize(("mode", "code"), [("kill", -signal.SIGKILL), ("raise", 1), ("end", 0)])
def test_the_client_ends_as_the_worker_did(zygote_at: Callable[[], str], rank: Callable[..., subprocess.Popen[bytes]],
                                           tmp_path: Path, mode: str, code: int) -> None:
    client = rank(zygote_at(), mode)
    assert client.wait(timeout=30) == code  # -9: the same signal, re-raised on the client itself
    if mode == "raise":
        assert "ValueError: boom" in (tmp_path / "stderr").read_text()
    if mode == "end":  # the interpreter's exit: threads joined, then atexit handlers
        assert (tmp_path / "thread").exists() and (tmp_path / "atexit").exists()


def test_sigterm_to_the_client_reaches_the_worker(zygote_at: Callable[[], str],
                                                  rank: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    socket_path = zygote_at()
    client = rank(socket_path, "term")
    wait_for(lambda: (tmp_path / "waiting").exists(), timeout=30, what="the rank to wait", interval=POLL_S)
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=30) == 3 and (tmp_path / "got-term").exists()
    (tmp_path / "waiting").unlink()
    (tmp_path / "info.json").unlink()
    plain = rank(socket_path, "wait")  # no handler: it dies of the signal, and so does the client
    wait_for(lambda: (tmp_path / "waiting").exists(), timeout=30, what="the rank to wait", interval=POLL_S)
    plain.send_signal(signal.SIGTERM)
    assert plain.wait(timeout=30) == -signal.SIGTERM


def test_a_killed_or_stopped_client_takes_its_worker_with_it(
        zygote_at: Callable[[], str], rank: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    client = rank(zygote_at(), "wait")
    worker = info(tmp_path)["pid"]
    client.send_signal(signal.SIGSTOP)  # a hang injected into the process torchrun sees
    wait_for(lambda: state(worker) == "T", timeout=10, what="the worker to be stopped too", interval=POLL_S)
    client.send_signal(signal.SIGCONT)
    wait_for(lambda: state(worker) in ("R", "S"), timeout=10, what="the worker to run again", interval=POLL_S)
    client.kill()  # torchrun's SIGKILL after its grace, or a test's
    assert client.wait(timeout=10) == -signal.SIGKILL
    wait_for(lambda: gone(worker), timeout=10, what="the worker to be killed", interval=POLL_S)


def test_without_a_zygote_the_rank_starts_cold(socket_dir: Path, rank: Callable[..., subprocess.Popen[bytes]],
                                               tmp_path: Path) -> None:
    client = rank(str(socket_dir / "sock"), "exit", "5")
    assert client.wait(timeout=30) == 5
    got = info(tmp_path)
    assert got["pid"] == client.pid and got["argv"] == ["script.py", "exit", "5"]  # exec'd: the client is the rank
    assert "cannot reach the zygote" in (tmp_path / "stderr").read_text()


def test_a_zygote_that_dies_under_a_rank_ends_it_with_a_clear_message(
        zygote_at: Callable[[], str], rank: Callable[..., subprocess.Popen[bytes]], tmp_path: Path,
        started: list[subprocess.Popen[bytes]]) -> None:
    client = rank(zygote_at(), "wait")
    worker = info(tmp_path)["pid"]
    os.killpg(started[0].pid, signal.SIGKILL)  # the stand-in torchrun, and with it the zygote
    assert client.wait(timeout=30) == 1
    assert "the zygote that forked this rank's worker" in (tmp_path / "stderr").read_text()
    wait_for(lambda: gone(worker), timeout=10, what="the worker to be killed", interval=POLL_S)


def test_the_socket_directory_is_private(socket_dir: Path) -> None:
    assert socket_dir.stat().st_mode & 0o777 == 0o700
    socket_dir.chmod(0o755)
    with pytest.raises(PermissionError):
        zygote.listen(str(socket_dir / "sock"))
    socket_dir.chmod(0o700)


@pytest.mark.parametrize(("body", "fds", "error"), [
    (b"not json", [0, 1, 2], "not JSON"),
    (json.dumps({"argv": ["a"], "env": {}, "cwd": "/", "extra": 1}).encode(), [0, 1, 2], "exactly argv"),
    (json.dumps({"argv": [], "env": {}, "cwd": "/"}).encode(), [0, 1, 2], "non-empty"),
    (json.dumps({"argv": ["a"], "env": {"A": 1}, "cwd": "/"}).encode(), [0, 1, 2], "strings to strings"),
    (json.dumps({"argv": ["-m"], "env": {}, "cwd": "/"}).encode(), [0, 1, 2], "without a module"),
    (json.dumps({"argv": ["a"], "env": {}, "cwd": "/"}).encode(), [0], "3 file descriptors"),
])
def test_a_request_is_checked_field_by_field(body: bytes, fds: list[int], error: str) -> None:
    with pytest.raises(zygote.RequestError, match=error):
        zygote.parse_request(body, fds)


# --- in-process restarts: the client replaces a crashed worker (agents.hooks.inprocess) -----------

def test_a_crashed_worker_is_replaced_in_process_and_torchrun_sees_nothing(
        zygote_at: Callable[[], str], rank: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    client = rank(zygote_at(), "kill-once", env={warm_client.RESTARTS_ENV: "2"})
    assert client.wait(timeout=30) == 0  # the replacement's exit: the SIGKILL never reached torchrun
    assert (tmp_path / "replacement").read_text() == "1"
    stderr = (tmp_path / "stderr").read_text()
    assert f"{warm_client.REPLACEMENT_LINE}1 in process (1 of 2)" in stderr and "signal 9" in stderr


def test_replacements_stop_at_the_budget_and_the_client_then_dies_as_the_worker_did(
        zygote_at: Callable[[], str], rank: Callable[..., subprocess.Popen[bytes]], tmp_path: Path) -> None:
    client = rank(zygote_at(), "kill", env={warm_client.RESTARTS_ENV: "2"})
    assert client.wait(timeout=30) == -signal.SIGKILL
    assert (tmp_path / "stderr").read_text().count(warm_client.REPLACEMENT_LINE) == 2


@pytest.mark.parametrize("held", [False, True])
def test_no_replacement_for_an_exception_or_while_the_supervisor_holds_them(
        zygote_at: Callable[[], str], rank: Callable[..., subprocess.Popen[bytes]], tmp_path: Path,
        socket_dir: Path, held: bool) -> None:
    socket_path = zygote_at()
    if held:  # the node failed its health check: a crash there ends the generation as before
        (socket_dir / warm_client.HOLD_FILE).write_text("unhealthy")
    client = rank(socket_path, "kill" if held else "raise", env={warm_client.RESTARTS_ENV: "3"})
    assert client.wait(timeout=30) == (-signal.SIGKILL if held else 1)
    assert warm_client.REPLACEMENT_LINE not in (tmp_path / "stderr").read_text()


@pytest.mark.parametrize(("outcome", "stopping", "replaced", "held", "allowed"), [
    ({"signal": signal.SIGKILL}, False, 0, False, True),
    ({"signal": signal.SIGSEGV}, False, 1, False, True),
    ({"signal": signal.SIGKILL}, False, 2, False, False),  # the budget (2) is spent
    ({"signal": signal.SIGKILL}, True, 0, False, False),  # a stop came through the client first
    ({"signal": signal.SIGTERM}, False, 0, False, False),  # somebody stopped it
    ({"exit": 1}, False, 0, False, False),  # an exception: deterministic until shown otherwise
    ({"signal": signal.SIGKILL}, False, 0, True, False),  # the supervisor holds replacements
])
def test_which_ends_are_replaced(outcome: dict, stopping: bool, replaced: int, held: bool, allowed: bool) -> None:
    assert warm_client.replacement_allowed(outcome, stopping=stopping, replaced=replaced, budget=2,
                                           held=held) is allowed


def test_torchruns_target_goes_through_the_client() -> None:
    options = ["--nnodes=1", "--nproc-per-node=2", "--max-restarts=0"]
    assert zygote.through_client([*options, "train.py", "--lr", "1"], "/s") == [
        *options, zygote.CLIENT, "/s", "train.py", "--lr", "1"]
    assert zygote.through_client([*options, "--module", "pkg.train", "--x"], "/s") == [
        *options, zygote.CLIENT, "/s", "-m", "pkg.train", "--x"]


def test_only_a_directory_it_made_is_removed(tmp_path: Path) -> None:
    other = tmp_path / "nw-zygote-not-in-tmp"
    other.mkdir()
    zygote.remove_socket_dir(other)
    assert other.exists()




# --- under the supervisor, with real torchrun (gloo, 2 ranks) ------------------------------------

def comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def ppid(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2:].split()[1])


@pytest.fixture
def warm_supervisor(tmp_path: Path) -> Iterator[tuple[Supervisor, queue.Queue[tuple[str, int, ExitReport]]]]:
    exits: queue.Queue[tuple[str, int, ExitReport]] = queue.Queue()
    sup = Supervisor(tmp_path / "work", on_exit=lambda job, gen, report: exits.put((job, gen, report)),
                     default_grace_s=5.0, warm_workers=True)
    yield sup, exits
    sup.shutdown(grace_s=2.0)


def launch_warm(sup: Supervisor, train_script: Path, out: Path, mode: str, port: int,
                inprocess_restarts: int = 0) -> LaunchedDetail:
    out.mkdir()
    payload = LaunchPayload(script="train.py", workdir=str(train_script.parent), args=[str(out), mode], nnodes=1,
                            nproc_per_node=2, node_rank=0, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="job-1",
                            require_gpu=False, hooks_token="t0k", inprocess_restarts=inprocess_restarts or None)
    return sup.launch("job", 1, payload)


@pytest.mark.e2e
@pytest.mark.parametrize(("mode", "signature", "rank1"), [
    ("kill", "signal", {"signal": 9, "exit_code": None}),
    ("raise", "traceback", {"signal": None, "exit_code": 1}),
])
def test_a_failed_warm_rank_is_still_the_root_cause(
        warm_supervisor: tuple[Supervisor, queue.Queue[Any]], train_script: Path, tmp_path: Path,
        rank_info: Callable[..., Any], free_port: Callable[[], int], mode: str, signature: str,
        rank1: dict[str, Any]) -> None:
    sup, exits = warm_supervisor
    out = tmp_path / "out"
    detail = launch_warm(sup, train_script, out, mode, free_port())
    assert detail.warm
    info1 = wait_for(lambda: rank_info(out, 1), timeout=60, what="rank 1 to start", interval=POLL_S)
    zygote_pid = ppid(info1["pid"])
    assert zygote_pid is not None and comm(zygote_pid) == zygote.ZYGOTE_COMM  # forked, not a cold interpreter
    _, _, report = exits.get(timeout=90)
    # torchrun's attribution is a cold start's: a killed rank 1 is named first, with its own signal (a
    # fork server's MultiprocessContext named rank 0, which died of the broken collective). A raising
    # rank 1 is not yet reliably first: rank 0 exits 1 too, of the broken collective, and a forked
    # rank's exit is slow and varies enough that torchrun finds rank 0 first in about 1 run of 6. That
    # race is why ``warm_workers`` stays off by default (docs/benchmarks/recovery.md).
    assert report.signature == signature
    assert report.root_cause_rank == 1 if mode == "kill" else report.root_cause_rank in (0, 1)
    assert {"signal": report.ranks[1].signal, "exit_code": report.ranks[1].exit_code} == rank1
    # torchrun's table names the warm client; the report names the rank's own process.
    assert report.ranks[1].pid == info1["pid"]
    assert report.rank_exited_at is not None
    children = [*rank_info(out, 0)["children"], *info1["children"]]
    wait_for(lambda: all(gone(pid) for pid in [zygote_pid, *children, rank_info(out, 0)["pid"]]), timeout=10,
             what="the zygote and every rank's children to be gone", interval=POLL_S)
    assert sup.running() == []


@pytest.mark.e2e
def test_a_stop_leaves_no_warm_worker_behind_and_an_agent_restart_adopts_them(
        warm_supervisor: tuple[Supervisor, queue.Queue[Any]], train_script: Path, tmp_path: Path,
        rank_info: Callable[..., Any], free_port: Callable[[], int]) -> None:
    sup, exits = warm_supervisor
    out = tmp_path / "out"
    launch_warm(sup, train_script, out, "loop", free_port(), inprocess_restarts=2)
    infos = wait_for(lambda: rank_info(out, 0) and rank_info(out, 1) and [rank_info(out, 0), rank_info(out, 1)],
                     timeout=60, what="both ranks to start", interval=POLL_S)
    zygote_pid = ppid(infos[0]["pid"])
    assert zygote_pid == ppid(infos[1]["pid"]) and comm(zygote_pid) == zygote.ZYGOTE_COMM
    assert infos[1]["env"]["NIGHTWATCH_TOKEN"] == "t0k"  # the generation's environment, not the zygote's
    family = [zygote_pid, *(i["pid"] for i in infos), *(c for i in infos for c in i["children"])]
    [running] = wait_for(lambda: [r for r in sup.running() if set(family) <= set(r.pids)], timeout=10,
                         what="the heartbeat view to list the zygote, its ranks and their children", interval=POLL_S)
    gen = sup._running["job"]
    assert gen.zygote_dir is not None and (gen.zygote_dir / "sock").exists()
    # An agent that restarts (a second supervisor on the same directory) adopts the generation.
    adopter = Supervisor(tmp_path / "work", on_exit=lambda *a: exits.put(a), default_grace_s=5.0,
                         warm_launcher=False)
    try:
        [adopted] = adopter.adopt()
        assert set(family) <= set(adopted.pids)
        assert gen.inprocess and adopter._running["job"].inprocess  # its stopped ranks are still killed
        report = adopter.stop("job", 1, grace_s=5.0)
    finally:
        adopter.shutdown(grace_s=2.0)
    assert report is not None and report.requested_stop
    assert [pid for pid in family if not gone(pid)] == []
    wait_for(lambda: not gen.zygote_dir.exists(), timeout=10, what="the socket directory to be removed",
             interval=POLL_S)


def test_the_zygotes_children_are_torchruns_workers_and_the_zygote_is_not() -> None:
    from agents.supervisor.procs import _Proc, _worker_gone, _workers

    torchrun = _Proc(pid=100, ppid=1, pgid=100, state="S", started=5)
    clients = [_Proc(pid=101, ppid=100, pgid=101, state="S", started=6),
               _Proc(pid=102, ppid=100, pgid=102, state="S", started=6)]
    zyg = _Proc(pid=103, ppid=100, pgid=100, state="S", started=6, comm=zygote.ZYGOTE_COMM)
    unnamed = _Proc(pid=103, ppid=100, pgid=100, state="S", started=6, comm="python")  # seen before it renamed
    ranks = [_Proc(pid=104, ppid=103, pgid=104, state="S", started=7),
             _Proc(pid=105, ppid=103, pgid=105, state="S", started=7)]
    loader = _Proc(pid=106, ppid=104, pgid=104, state="S", started=8)  # a rank's data-loader worker
    seen = [torchrun, *clients, unnamed, *ranks, loader]
    assert {p.pid for p in _workers(seen, 100, also=[zyg])} == {101, 102, 104, 105}
    assert not _worker_gone(seen, [torchrun, *clients, zyg, *ranks, loader], 100)
    # A rank gone while its client has not ended yet (the zygote reports it a moment later).
    assert _worker_gone(seen, [torchrun, *clients, zyg, ranks[0], loader], 100)
    assert not _worker_gone(seen, [torchrun, *clients, zyg, *ranks], 100)  # only the loader ended


def test_a_generation_that_starts_cold_is_told_of_no_in_process_restarts() -> None:
    from agents.supervisor._core import _cold_environment

    warm = {"NIGHTWATCH_INPROCESS_RESTARTS": "3", "RANKS": "2", "PYTHONUNBUFFERED": "1"}
    cold = _cold_environment(warm, "job", 4)
    # No zygote to replace a rank: no budget, and torchrun's store is not shared (its restarts' setting).
    assert cold == {"RANKS": "2", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    plain = {"RANKS": "2", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert _cold_environment(plain, "job", 4) is plain


def test_the_client_spells_the_variables_as_the_package_does() -> None:
    from agents.hooks import inprocess
    from agents.protocol.agent import INPROCESS_RESTARTS_ENV

    assert warm_client.RESTARTS_ENV == INPROCESS_RESTARTS_ENV == inprocess.ENV_RESTARTS
    assert warm_client.REPLACEMENT_ENV == inprocess.ENV_REPLACEMENT
