"""In-process restart: when a rank dies, the others keep their interpreter and train on.

A rank killed on a healthy node (the OOM killer, a segfault, a SIGKILL) costs plain
``torchrun --max-restarts`` a new interpreter on every rank, the imports, the process group and a
checkpoint read from disk: 2-3 s on two CPU ranks, far more on a real job. Here the surviving ranks
catch the broken collective, tear their process groups down, and wait for the dead rank's
replacement, which the node's zygote forks with torch already imported
(``agents.supervisor.warm_client``); together they form the next *round* of the process group and
call the training function again, whose ``Hooks`` restore the newest in-memory snapshot every rank
holds (``snapshot.py``: its own copy in the node's tmpfs, or its partner's), or the disk checkpoint.
torchrun sees nothing: its generation, and so the control plane's generation and its fencing,
stay as they were; the control plane learns of the restart from the ``resumed`` event's
``in_process`` detail and records it as an incident.

The script opts in with two lines (``examples/train.py``)::

    def train(args):
        inprocess.init_process_group("gloo")     # instead of dist.init_process_group
        ...                                      # model, DDP, Hooks, the loop (``with nw:``)

    inprocess.run(train, args)

Without ``NIGHTWATCH_INPROCESS_RESTARTS`` (set by the agent's supervisor for a job whose restart
policy asks for in-process restarts, with warm workers) both are the plain calls.

Protocol (rounds rendezvous in torchrun's own store, which outlives every worker):

1. Round ``r`` forms under the store prefix ``nightwatch/inprocess/r/``. A rank first records the
   round it joins (``member/<rank>``), then arrives; the last to arrive opens the round, and the
   process group is made on the round's prefix (no key of an earlier round can be read: the
   collision PLATFORM-NOTES describes for torchrun's own restarts).
2. A rank whose training function raised a *peer failure* (a collective broken by a dead peer:
   ``torch.distributed.DistError``, or gloo's "connection reset/closed by peer") aborts its groups
   and joins ``r + 1``.
3. The dead rank's replacement (``NIGHTWATCH_INPROCESS_REPLACEMENT`` set) reads ``member/<rank>``,
   the round its predecessor was in, and joins the next one.

Anything else ends the process as before, and the generation with it (torchrun closes it, the agent
reports it, the control plane decides): the function's own exception (a deterministic bug, which a
restart would repeat), ``StopTraining``, a round that does not form within
``NIGHTWATCH_INPROCESS_TIMEOUT_S`` (no replacement came: the node was unhealthy, the budget spent,
the whole generation is being stopped), or the budget of restarts spent.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from agents.protocol.agent import INPROCESS_RESTARTS_ENV

log = logging.getLogger("nightwatch.hooks")

#: How many times a rank slot may be replaced in process within one generation (0 or unset: off).
ENV_RESTARTS = INPROCESS_RESTARTS_ENV
#: Set by the warm client on a replacement: how many replacements this rank slot has had.
ENV_REPLACEMENT = "NIGHTWATCH_INPROCESS_REPLACEMENT"
#: How long a round may take to form (every rank arrived) before the ranks give up on it.
ENV_TIMEOUT = "NIGHTWATCH_INPROCESS_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0
PREFIX = "nightwatch/inprocess"
#: What gloo and NCCL say when a peer's process is gone (their errors are plain RuntimeErrors).
PEER_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo/transport/tcp",
              "NCCL communicator was aborted", "NCCL error")

F = TypeVar("F")


class RoundNotFormed(RuntimeError):
    """The next round did not form in time: no replacement came. Not a peer failure (it ends the
    process, and torchrun the generation)."""


@dataclass
class Restart:
    """This process's last in-process restart, told in the next round's ``resumed`` event."""

    round: int
    restarts: int  # in-process restarts this process has been through (its own, as a survivor)
    failed_at: float | None  # when this rank saw the round break (wall clock); None: a replacement
    error: str
    replacement: bool  # this process is a dead rank's replacement

    def detail(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _State:
    round: int | None = None
    restarts: int = 0
    last: Restart | None = None


_state = _State()


def budget() -> int:
    try:
        return max(0, int(os.environ.get(ENV_RESTARTS, "0")))
    except ValueError:
        return 0


def enabled() -> bool:
    """In-process restarts are on: a budget, a distributed run, and torchrun's agent store to meet
    in (the supervisor leaves ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` unset for such a job)."""
    return (budget() > 0 and "WORLD_SIZE" in os.environ
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def current() -> Restart | None:
    """The restart that led to the round now running (None on the first round of a first process)."""
    if _state.last is None and _state.round and os.environ.get(ENV_REPLACEMENT):
        return Restart(round=_state.round, restarts=0, failed_at=None, error="", replacement=True)
    return _state.last


def round_number() -> int:
    """The round of the process group this process is in (0 without in-process restarts)."""
    return _state.round or 0


def peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective broken by a peer that went away."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, RoundNotFormed | SystemExit | KeyboardInterrupt):
            return False
        if isinstance(error, dist.DistError):
            return True
        if isinstance(error, RuntimeError) and any(sign in str(error) for sign in PEER_SIGNS):
            return True
        error = error.__cause__ or error.__context__
    return False


def _timeout_s() -> float:
    try:
        return float(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _agent_store(timeout_s: float) -> dist.Store:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def _round_to_join(store: dist.Store, rank: int) -> int:
    """A survivor joins the round after the one it was in; a replacement the round after the one
    its predecessor had joined (``member/<rank>``); the first process of a slot, round 0."""
    if _state.round is not None:
        return _state.round
    if os.environ.get(ENV_REPLACEMENT):
        key = f"{PREFIX}/member/{rank}"
        if store.check([key]):
            return int(store.get(key)) + 1
    return 0


def _arrive(store: dist.Store, number: int, rank: int, world_size: int, timeout_s: float) -> None:
    store.set(f"{PREFIX}/member/{rank}", str(number))
    prefix = f"{PREFIX}/{number}"
    if store.add(f"{prefix}/arrived", 1) == world_size:
        store.set(f"{prefix}/open", "1")
    try:
        store.wait([f"{prefix}/open"], timedelta(seconds=timeout_s))
    except dist.DistError as exc:  # the store's timeout
        raise RoundNotFormed(f"round {number} of the process group did not form within {timeout_s:.0f} s "
                             f"(rank {rank}; {int(store.add(f'{prefix}/arrived', 0))} of {world_size} "
                             f"ranks arrived): no replacement came") from exc


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """``dist.init_process_group(backend, **kwargs)``; with in-process restarts on, the group of the
    current round, made on its own prefix of torchrun's store once every rank has arrived."""
    if not enabled():
        dist.init_process_group(backend, **kwargs)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout_s = _timeout_s()
    store = _agent_store(timeout_s)
    number = _round_to_join(store, rank)
    started = time.monotonic()
    _arrive(store, number, rank, world_size, timeout_s)
    _state.round = number
    dist.init_process_group(backend, store=dist.PrefixStore(f"{PREFIX}/{number}/pg", store), rank=rank,
                            world_size=world_size, **kwargs)
    if number:
        log.info("in-process restart: round %d of the process group formed in %.2f s", number,
                 time.monotonic() - started)


def run(function: Callable[..., F], *args: Any, **kwargs: Any) -> F:
    """Call ``function(*args, **kwargs)``, again after each peer failure while the budget lasts."""
    while True:
        try:
            return function(*args, **kwargs)
        except BaseException as exc:
            if not (enabled() and _state.round is not None and peer_failure(exc)):
                raise
            if _state.restarts >= budget():
                log.error("in-process restart budget (%d) spent; ending this rank", budget())
                raise
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
            del exc  # its traceback holds the last round's model and optimizer
        _next_round(error)


def _next_round(error: str) -> None:
    failed_at = time.time()
    _abort_groups()
    _state.restarts += 1
    _state.round = (_state.round or 0) + 1
    _state.last = Restart(round=_state.round, restarts=_state.restarts, failed_at=failed_at, error=error,
                          replacement=bool(os.environ.get(ENV_REPLACEMENT)))
    log.warning("in-process restart %d of %d: a peer failed (%s); joining round %d of the process group",
                _state.restarts, budget(), error, _state.round)


def _abort_groups() -> None:
    """Drop every process group of the broken round without waiting on its dead peer."""
    if dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - a backend without abort: destroying is as good for gloo
            dist.destroy_process_group()
    gc.collect()

