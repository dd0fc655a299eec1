"""``agents.hooks.inprocess`` without processes: which errors are a peer's death, which round a
process joins, a round that does not form, and what ``run`` restarts. The real thing, with torchrun,
a zygote and killed ranks, is tests/agent/test_inprocess_restart.py."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from agents.hooks import inprocess
from tests.ports import free_port

GLOO_RESET = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:32979: Connection reset "
              "by peer. This is typically caused by a remote worker hanging or bugs in the application.")


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    """A real TCPStore, as torchrun's agent hosts it for its workers."""
    yield dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=5))


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inprocess, "_state", inprocess._State())
    for name in (inprocess.ENV_RESTARTS, inprocess.ENV_REPLACEMENT, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)


def caused_by(error: BaseException) -> RuntimeError:
    try:
        raise RuntimeError("the step failed") from error
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(("error", "peer"), [
    (RuntimeError(GLOO_RESET), True),
    (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:3466"), True),
    (dist.DistBackendError("NCCL communicator was aborted on rank 1"), True),
    (caused_by(RuntimeError(GLOO_RESET)), True),  # wrapped by the script or a library
    (RuntimeError("injected deterministic failure at step 6"), False),  # the script's own bug
    (ValueError("Connection reset by peer"), False),  # not from a collective
    (SystemExit(85), False),  # StopTraining: the hooks stopped on purpose
    (KeyboardInterrupt(), False),
    (inprocess.RoundNotFormed("round 2 did not form"), False),  # no replacement came: end it
])
def test_only_a_collective_broken_by_a_peer_is_a_peer_failure(error: BaseException, peer: bool) -> None:
    assert inprocess.peer_failure(error) is peer


def test_a_survivor_a_replacement_and_a_first_process_each_know_their_round(
        store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    assert inprocess._round_to_join(store, rank=1) == 0  # the slot's first process
    inprocess._arrive(store, 0, rank=1, world_size=1, timeout_s=1)
    inprocess._state.round = 3  # a survivor: the round after the one it was in, set by run()
    assert inprocess._round_to_join(store, rank=1) == 3
    inprocess._state.round = None
    monkeypatch.setenv(inprocess.ENV_REPLACEMENT, "1")  # the replacement of rank 1, whose predecessor was in 0
    assert inprocess._round_to_join(store, rank=1) == 1
    assert inprocess._round_to_join(store, rank=0) == 0  # nothing recorded for rank 0: the first round


def test_a_round_opens_when_the_last_rank_arrives_and_not_before(store: dist.TCPStore) -> None:
    with pytest.raises(inprocess.RoundNotFormed, match=r"round 4 .* 1 of 2 ranks arrived"):
        inprocess._arrive(store, 4, rank=0, world_size=2, timeout_s=0.3)
    store.add(f"{inprocess.PREFIX}/5/arrived", 1)  # rank 0 is there already
    inprocess._arrive(store, 5, rank=1, world_size=2, timeout_s=1)  # the last: opens, returns at once
    assert store.get(f"{inprocess.PREFIX}/member/1") == b"5"


def test_run_calls_again_only_for_a_peer_failure_and_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(inprocess.ENV_RESTARTS, "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    calls: list[int] = []

    def train(fail_times: int, error: BaseException) -> str:
        inprocess._state.round = inprocess._state.round or 0  # what init_process_group records
        calls.append(inprocess.round_number())
        if len(calls) <= fail_times:
            raise error
        return "done"

    assert inprocess.run(train, 2, RuntimeError(GLOO_RESET)) == "done"
    assert calls == [0, 1, 2]
    restart = inprocess.current()
    assert restart is not None and restart.round == 2 and restart.restarts == 2 and not restart.replacement
    assert "Connection reset by peer" in restart.error and restart.failed_at

    calls.clear()
    monkeypatch.setattr(inprocess, "_state", inprocess._State())
    with pytest.raises(RuntimeError, match="Connection reset"):
        inprocess.run(train, 3, RuntimeError(GLOO_RESET))  # a third failure: the budget (2) is spent
    assert calls == [0, 1, 2]

    calls.clear()
    monkeypatch.setattr(inprocess, "_state", inprocess._State())
    with pytest.raises(RuntimeError, match="deterministic"):
        inprocess.run(train, 1, RuntimeError("injected deterministic failure"))
    assert calls == [0]


def test_without_the_budget_or_the_agent_store_everything_is_the_plain_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(inprocess.ENV_RESTARTS, "2")
    assert not inprocess.enabled()  # torchrun's store not shared (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert inprocess.enabled()
    monkeypatch.setenv(inprocess.ENV_RESTARTS, "0")
    assert not inprocess.enabled()

    def fails() -> None:
        inprocess._state.round = 0
        raise RuntimeError(GLOO_RESET)

    with pytest.raises(RuntimeError):
        inprocess.run(fails)
