"""The agent ships each generation's torchrun output (issue 21): numbered batches, kept and resent
after a failure, bounded, dropped for good when the control plane refuses them."""

from __future__ import annotations

from typing import Any

from agents.agent.logship import LogShipper
from agents.http import Unreachable
from agents.protocol.agent import MAX_LOG_LINES_PER_BATCH, MAX_SHIPPED_LINE


class FakeControlPlane:
    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self.answers: list[Any] = []  # a status code, or an exception to raise; empty: 202

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, dict]:
        assert (method, path) == ("POST", "/api/v1/nodes/7/logs")
        answer = self.answers.pop(0) if self.answers else 202
        if isinstance(answer, Exception):
            raise answer
        if answer < 300:
            self.batches.append(body)
        return answer, {"detail": "refused"} if answer >= 400 else {}


def test_lines_go_out_numbered_in_batches_and_a_failed_batch_is_sent_again_from_the_same_line():
    shipper, plane = LogShipper(), FakeControlPlane()
    for n in range(MAX_LOG_LINES_PER_BATCH + 5):
        shipper.add("3", 1, f"line {n}")
    shipper.add("3", 1, "z" * (MAX_SHIPPED_LINE + 10))
    plane.answers = [Unreachable("down")]
    assert shipper.ship_once(plane, "7", now=0.0) == 0 and plane.batches == []  # kept, with a back-off
    assert shipper.ship_once(plane, "7", now=0.0) == 0  # not before the back-off
    sent = shipper.ship_once(plane, "7", now=1e9)
    assert sent == MAX_LOG_LINES_PER_BATCH + 6
    assert [(b["job"], b["generation"], b["first_line"], len(b["lines"])) for b in plane.batches] == [
        ("3", 1, 0, MAX_LOG_LINES_PER_BATCH), ("3", 1, MAX_LOG_LINES_PER_BATCH, 6)]
    assert plane.batches[0]["lines"][0] == "line 0" and len(plane.batches[1]["lines"][-1]) == MAX_SHIPPED_LINE
    shipper.add("3", 1, "more")
    plane.answers = [503]  # overloaded: kept too
    assert shipper.ship_once(plane, "7", now=2e9) == 0
    assert shipper.ship_once(plane, "7", now=3e9) == 1
    assert plane.batches[-1]["first_line"] == MAX_LOG_LINES_PER_BATCH + 6


def test_the_queue_is_bounded_and_says_how_many_lines_it_dropped():
    shipper, plane = LogShipper(max_lines=3), FakeControlPlane()
    for n in range(5):
        shipper.add("3", 2, f"line {n}")
    assert shipper.ship_once(plane, "7", now=0.0) == 3
    assert plane.batches == [{"job": "3", "generation": 2, "first_line": 2, "lines": ["line 2", "line 3", "line 4"]}]


def test_a_refused_generation_is_dropped_and_an_ended_one_goes_once_sent():
    shipper, plane = LogShipper(), FakeControlPlane()
    shipper.add("3", 1, "not ours")
    shipper.add("4", 1, "ours")
    shipper.ended("4", 1)
    plane.answers = [403, 202]
    assert shipper.ship_once(plane, "7", now=0.0) == 1
    assert shipper.ship_once(plane, "7", now=0.0) == 0 and len(plane.batches) == 1  # nothing is retried
    assert shipper._queues == {}


def test_the_supervisor_hands_every_line_of_a_generation_to_the_shipper(tmp_path):
    """Supervisor(on_output=…) sees each line torchrun's log gets, in order, as it reads it."""
    import queue
    import sys

    from agents.protocol.agent import LaunchPayload
    from agents.supervisor import Supervisor

    code = tmp_path / "code"
    code.mkdir()
    (code / "hello.py").write_text("for n in range(3):\n    print(f'hello {n}', flush=True)\n")
    # A stand-in for torchrun: skips its options and runs the script (the code directory is the cwd).
    torchrun = [sys.executable, "-c", "import runpy, sys; script = [a for a in sys.argv[1:] if not "
                                      "a.startswith('--')][0]; runpy.run_path(script, run_name='__main__')"]
    exits: queue.Queue = queue.Queue()
    seen: list[tuple[str, int, str]] = []
    sup = Supervisor(tmp_path / "work", on_exit=lambda *a: exits.put(a), torchrun=torchrun, warm_launcher=False,
                     on_output=lambda job, generation, line: seen.append((job, generation, line)))
    try:
        sup.launch("5", 1, LaunchPayload(script="hello.py", nnodes=1, nproc_per_node=1, node_rank=0,
                                         rdzv_endpoint="127.0.0.1:1", rdzv_id="x", workdir=str(code)))
        exits.get(timeout=30)
    finally:
        sup.shutdown(1.0)
    assert [line for job, gen, line in seen if (job, gen) == ("5", 1) and line.startswith("hello")] == [
        "hello 0", "hello 1", "hello 2"]
