"""A failed checkpoint save never ends training (issue 24, item 3).

torch's ``CheckpointException`` is a ``BaseException``: the checkpointer must survive it (and an
``OSError`` such as ENOSPC or EACCES), report the cause in words, and remove the partial save.
"""

from __future__ import annotations

import errno
import traceback
from concurrent.futures import Future

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from agents.hooks import checkpointer as checkpointer_module
from agents.hooks.checkpointer import Checkpointer, describe_failure, lost_peer
from agents.hooks.topology import Topology

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FIELDS = {"config_hash": "x", "world_size": 1, "data_cursor": 0, "parts": ["model"]}


def dcp_failure(error: BaseException) -> CheckpointException:
    """What DCP raises on every rank when one rank's write failed."""
    return CheckpointException("save failed", {1: (error, traceback.StackSummary())})


def state():
    model = torch.nn.Linear(4, 2)
    return {"model": {name: p.detach() for name, p in model.named_parameters()}}


def test_the_cause_is_named_in_words_through_dcps_wrapping():
    assert describe_failure(dcp_failure(OSError(errno.ENOSPC, "No space left on device"))) == (
        "no space left on device", errno.ENOSPC)
    assert describe_failure(PermissionError(errno.EACCES, "Permission denied", "/ckpt")) == (
        "permission denied", errno.EACCES)
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system")
    assert describe_failure(wrapped) == ("read-only file system", errno.EROFS)
    assert describe_failure(dcp_failure(ValueError("bad shard\nmore"))) == ("ValueError: bad shard", None)


def test_a_save_broken_by_a_rank_that_went_away_is_told_from_a_storage_failure():
    """gloo's words (a plain RuntimeError) and torch's typed errors, wrapped by DCP or chained."""
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:38558. This is typically caused by a remote worker crashing.")
    assert lost_peer(dcp_failure(gloo)) and lost_peer(torch.distributed.DistBackendError("NCCL error"))
    chained = OSError(errno.EIO, "write failed")
    chained.__context__ = torch.distributed.DistNetworkError("Connection reset by peer")
    assert lost_peer(chained)
    assert not lost_peer(dcp_failure(OSError(errno.ENOSPC, "No space left on device")))
    assert not lost_peer(dcp_failure(RuntimeError("CUDA out of memory")))


@pytest.mark.parametrize("use_async", [True, False])
def test_a_checkpoint_exception_is_reported_and_the_partial_save_removed(tmp_path, monkeypatch, use_async):
    error = dcp_failure(OSError(errno.ENOSPC, "No space left on device"))

    def failing_async_save(state_dict, *, checkpoint_id, **kwargs):
        (tmp_path / checkpoint_id.rsplit("/", 1)[-1] / "__0_0.distcp").write_bytes(b"partial")
        future: Future = Future()
        future.set_exception(error)
        return future

    def failing_save(state_dict, *, checkpoint_id, **kwargs):
        raise error

    monkeypatch.setattr(checkpointer_module.dcp, "async_save", failing_async_save)
    monkeypatch.setattr(checkpointer_module.dcp, "save", failing_save)
    failures = []
    saver = Checkpointer(tmp_path, Topology(), generation=1, run_id="ab", use_async=use_async,
                         on_failure=lambda path, step, exc: failures.append((step, exc)))
    saver.save(10, state(), FIELDS)
    assert saver.wait() is None  # no exception: training goes on
    saver.save(20, state(), FIELDS)  # and the next save is attempted as usual
    saver.close()
    assert [step for step, _ in failures] == [10, 20]
    assert all(isinstance(exc, CheckpointException) for _, exc in failures)
    assert list(tmp_path.iterdir()) == []  # rank 0 removed the uncommitted directories


def test_a_keyboard_interrupt_during_a_save_still_stops_the_process(tmp_path, monkeypatch):
    def interrupted(state_dict, *, checkpoint_id, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpointer_module.dcp, "save", interrupted)
    saver = Checkpointer(tmp_path, Topology(), generation=1, run_id="ab", use_async=False)
    with pytest.raises(KeyboardInterrupt):
        saver.save(10, state(), FIELDS)
    saver.close()


def test_an_unwritable_directory_fails_the_save_not_the_training(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory should be")
    failures = []
    saver = Checkpointer(blocker / "ckpt", Topology(), generation=1, run_id="ab",
                         on_failure=lambda path, step, exc: failures.append(describe_failure(exc)))
    saver.save(5, state(), FIELDS)
    assert saver.wait() is None
    saver.close()
    assert len(failures) == 1 and failures[0][1] == errno.ENOTDIR
