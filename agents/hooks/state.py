"""What goes into a checkpoint, and how it is put back.

Model and optimizer go through torch.distributed.checkpoint's state-dict helpers, keyed by
parameter name, so DCP can reshard them when the job resumes on a different world size.
Everything else (progress, LR scheduler, AMP scaler, RNG) is small and travels as opaque blobs,
for three reasons learnt on torch 2.13:

- DCP keeps one copy of a key that every rank saves, so rank-local state (RNG) gets a
  rank-specific key (``rng.rank3``) or it is silently replaced by another rank's;
- ``dcp.load`` fills the state dict in sorted key order, so nothing is *applied* during the load:
  ``apply_state`` applies the parts afterwards in a fixed order (model and optimizer, scheduler,
  scaler, then RNG last so nothing after it draws random numbers);
- a blob is one leaf whatever its structure, so loading never depends on DCP flattening nested
  Python containers the same way twice.

The training loop's own rank-local state (the data pipeline's ``state_dict()``: a stateful
sampler, dataset or ``StatefulDataLoader``; the epoch's losses) is one more blob under a
rank-specific key (``loop.rank3``), written by the hooks and read back only by the hooks, after the
checkpoint's every file matched its sha256. The control plane reads ``manifest.json`` alone and
never unpickles anything a node wrote.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


@dataclass(frozen=True)
class Progress:
    """Where training stands: the same on every rank."""

    step: int = 0  # optimizer steps completed (skipped ones included: their batch was consumed)
    data_cursor: int = 0  # global sample positions consumed (see agents.hooks.data)
    world_size: int = 1  # world size that wrote the checkpoint
    generation: int = 0
    epoch: int = 0  # the data epoch of the last batch trained (0 before the first)


def rng_key(rank: int) -> str:
    return f"rng.rank{rank}"


def loop_key(rank: int) -> str:
    return f"loop.rank{rank}"


def capture_rng() -> dict[str, Any]:
    """This process's random number generators: python, numpy, torch CPU and every CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        # numpy is optional for a training script
        import numpy as np
    except ImportError:
        pass
    else:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        # present only if capture_rng found numpy, which a training script may not have
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def to_blob(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_blob(blob: bytes) -> Any:
    # weights_only=False: blobs hold numpy RNG arrays and scheduler internals. They come only from
    # a checkpoint whose every file matched its sha256 in the committed manifest (and DCP itself
    # unpickles non-tensor items the same way).
    return torch.load(io.BytesIO(blob), weights_only=False)  # noqa: S614


def collect_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any,
                  scaler: Any, progress: Progress, rank: int, epoch_scheduler: Any = None,
                  loop: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state dict this rank hands to DCP (``loop``: the training loop's rank-local state)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {
        "model": model_state,
        "optim": optim_state,
        "progress": to_blob(asdict(progress)),
        rng_key(rank): to_blob(capture_rng()),
    }
    if scheduler is not None:
        state["scheduler"] = to_blob(scheduler.state_dict())
    if scaler is not None:
        state["scaler"] = to_blob(scaler.state_dict())
    if epoch_scheduler is not None:
        state["epoch_scheduler"] = to_blob(epoch_scheduler.state_dict())
    if loop is not None:
        state[loop_key(rank)] = to_blob(loop)
    return state


def load_target(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, saved_keys: set[str],
                rank: int) -> dict[str, Any]:
    """A state dict for ``dcp.load`` to fill: live tensors for model/optimizer, placeholders else.

    Only parts present in the checkpoint are requested (``saved_keys`` are its top-level keys): a
    rank that did not exist when it was written (resume on more ranks) has no RNG entry.
    """
    model_state, optim_state = get_state_dict(model, optimizer)
    target: dict[str, Any] = {"model": model_state, "optim": optim_state}
    for key in ("progress", "scheduler", "scaler", "epoch_scheduler", rng_key(rank), loop_key(rank)):
        if key in saved_keys:
            target[key] = b""  # DCP replaces non-tensor leaves wholesale
    return target


def apply_state(loaded: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                scheduler: Any, scaler: Any, rank: int, epoch_scheduler: Any = None,
                loop: Callable[[dict[str, Any]], None] | None = None) -> tuple[Progress, list[str]]:
    """Put a loaded state dict back into the live objects; returns progress and the parts restored.

    ``loop`` receives this rank's training-loop state (when the checkpoint has it) before the RNG
    states are restored, so whatever it draws is overwritten.
    """
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    restored = ["model", "optim"]
    for name, target in (("scheduler", scheduler), ("scaler", scaler), ("epoch_scheduler", epoch_scheduler)):
        if target is not None and name in loaded:
            target.load_state_dict(from_blob(loaded[name]))
            restored.append(name)
    if loop is not None and loop_key(rank) in loaded:
        loop(from_blob(loaded[loop_key(rank)]))
        restored.append("loop")
    if rng_key(rank) in loaded:
        restore_rng(from_blob(loaded[rng_key(rank)]))
        restored.append("rng")
    return Progress(**from_blob(loaded["progress"])), restored


def saved_parts(keys: set[str]) -> list[str]:
    """The manifest's list of state parts, from a state dict's top-level keys."""
    return sorted({key.split(".rank")[0] if key.startswith(("rng.rank", "loop.rank")) else key for key in keys})
