"""In-memory snapshots on real torchrun: a rank killed in the middle of a snapshot copy, a rank
that lost its node's memory, and the rank holding its partner's copy killed, one after the other
in one run (torchrun restarts it each time). Every resume takes the newest snapshot that is whole
on every rank, never a torn one, and the run ends bit-identical to one never interrupted, having
trained the same samples at every step."""

from __future__ import annotations

import re

import pytest

from tests.hooks.conftest import torchrun
from tests.hooks.test_exact_resume import assert_same_run

pytestmark = pytest.mark.e2e

STEPS = 18
COMMON = ["--steps", str(STEPS), "--ckpt-every", "8", "--check-every", "5", "--snapshot-every", "1"]
# attempt:kind:rank:step (tests/hooks/snapshot_run.py): rank 1 dies copying snapshot 5; then rank 1
# loses its snapshots and dies at step 11; then rank 0, which holds rank 1's copies, dies at step 15.
FAULTS = "0:copy:1:5,1:lose:1:11,2:kill:0:15"
# Each rank on a node of its own, on every attempt: rank 1's lost memory leaves rank 0's copy.
NODES = "0:a,b;1:a,b;2:a,b;3:a,b"


def test_snapshot_resumes_after_torn_copy_lost_memory_and_killed_holder(tmp_path):
    def run(name, **options):
        directory = tmp_path / name
        result = torchrun([*COMMON, "--ckpt-dir", str(directory / "ckpt"), "--log-samples",
                           str(directory / "samples"), "--final-state", str(directory / "final")],
                          env={"NIGHTWATCH_SNAPSHOT_DIR": str(directory / "memory"), **options.pop("env", {})},
                          module="tests.hooks.snapshot_run", timeout=120, **options)
        assert result.returncode == 0, result.output[-4000:]
        # Finished with the final checkpoint on disk: no snapshot is left in node memory.
        assert not [p for p in (directory / "memory").rglob("*") if p.is_file()], "snapshots left in tmpfs"
        return directory, result

    reference, _ = run("uninterrupted")
    faulted, result = run("faulted", max_restarts=3, env={"SNAPSHOT_FAULTS": FAULTS, "SNAPSHOT_NODES": NODES})
    output = result.output
    assert "rank 1 killed in the middle of the snapshot copy of step 5" in output
    assert "rank 1 lost its snapshots and is killed at step 11" in output
    assert "rank 0 killed at step 15" in output

    resumes = [(int(step), line) for line in output.splitlines()
               for step in re.findall(r"resumed from step (\d+) \(snapshot ", line)]
    steps = [step for step, _ in resumes]
    assert len(steps) == 6, output[-4000:]  # 3 restarts, 2 ranks each
    torn, lost, killed = sorted(steps)[0:2], sorted(steps)[2:4], sorted(steps)[4:6]
    assert torn == [4, 4], "the snapshot torn at step 5 must never be restored"
    assert re.search(r"not restoring snapshot step-00000005-\S+: this rank stopped before it was committed", output)
    assert lost == [10, 10], "lost work: one step at most"
    assert [line for step, line in resumes if step == 10 and "rank 0's copy" in line], (
        "rank 1 lost its memory: its snapshot comes from its partner's copy")
    assert killed[0] == killed[1] and killed[0] in (13, 14), "lost work: one step (and the one in flight)"

    assert_same_run(faulted, reference, STEPS)


def test_a_lost_node_s_rank_resumes_on_a_spare_from_its_partner_s_copy_after_the_ranks_are_renumbered(tmp_path):
    """Node a (rank 0) is lost at step 11; the next attempt runs on the survivor b, now rank 0, and
    the spare c, rank 1, whose memory is empty (``SNAPSHOT_NODES``). b holds rank 1's own copies and
    rank 0's partner copies: it restores rank 0's from its memory and sends rank 1's to c. One step
    lost, not the steps back to the disk checkpoint, and bit-identical to an uninterrupted run."""
    steps = 16

    def run(name, **options):
        directory = tmp_path / name
        result = torchrun(["--steps", str(steps), "--ckpt-every", "8", "--check-every", "5", "--snapshot-every", "1",
                           "--ckpt-dir", str(directory / "ckpt"), "--log-samples", str(directory / "samples"),
                           "--final-state", str(directory / "final")],
                          env={"NIGHTWATCH_SNAPSHOT_DIR": str(directory / "memory"), "SNAPSHOT_NODES": "0:a,b;1:b,c",
                               **options.pop("env", {})},
                          module="tests.hooks.snapshot_run", timeout=120, **options)
        assert result.returncode == 0, result.output[-4000:]
        return directory, result

    reference, _ = run("uninterrupted")
    faulted, result = run("faulted", max_restarts=1, env={"SNAPSHOT_FAULTS": "0:kill:0:11"})
    output = result.output
    assert "rank 0 killed at step 11" in output
    resumes = sorted(re.findall(r"resumed from step (\d+) \(snapshot \S+, ([^;]+);", output))
    # Step 10's, or step 9's when rank 0 died before its copy of step 10 was whole on b (the copy
    # runs in the background): one step lost, and the step in flight.
    assert [source for _, source in resumes] == ["rank 0's copy", "this node's memory"], output[-4000:]
    assert resumes[0][0] == resumes[1][0] in ("9", "10"), output[-4000:]
    # The survivor and the spare finished with the final checkpoint on disk: nothing left in their
    # memory, the earlier numbering's copies included. Node a's memory went with it.
    for node in ("b", "c"):
        assert not [p for p in (faulted / "memory" / node).rglob("*") if p.is_file()], f"snapshots left on {node}"
    assert_same_run(faulted, reference, steps)
