"""Load a committed checkpoint on CPU: the load test, run on a node, never in the control plane.

    python -m agents.hooks.loadtest PATH --step N --data-cursor M

Hashes prove the files are the ones rank 0 committed; they cannot prove that what was committed
loads. This reads every tensor and every blob back through DCP exactly as a resume would (into
CPU buffers shaped from DCP's own metadata, so no model code is needed), unpickles the small
parts, and checks that the progress inside the checkpoint is the one the manifest claims and that
the model weights are finite. It prints one JSON line ``{"ok": bool, "reason": str|null, ...}``.

Loading unpickles what the training script wrote, so it must run where that script's code is
trusted anyway: on a node, as the user that owns the checkpoint (or in a sandbox), never in a
control-plane process. The control plane verifies from the manifest and hashes only
(``checkpoints.inspection``); every resume is itself a full load by the hooks.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from agents.hooks.state import from_blob

# A plain process has no process group; DCP warns on every load otherwise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


def load(path: str, *, step: int | None = None, data_cursor: int | None = None) -> dict[str, Any]:
    """Load everything under ``path``; returns the verdict as a plain dict."""
    metadata = FileSystemReader(path).read_metadata()
    target: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            target[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            target[key] = b""  # DCP replaces non-tensor leaves wholesale
    try:
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    except Exception as error:  # whatever DCP raises, the checkpoint does not load
        return {"ok": False, "reason": f"load test: DCP could not load it: {_short(error)}"}
    tensors = [value for value in target.values() if isinstance(value, torch.Tensor)]
    for name in sorted(k for k in target if k in ("progress", "scheduler", "scaler") or k.startswith("rng.rank")):
        try:
            target[name] = from_blob(target[name])
        except Exception as error:  # a blob that does not unpickle cannot be restored
            return {"ok": False, "reason": f"load test: the {name} part does not unpickle: {_short(error)}"}
    progress = target.get("progress")
    if not isinstance(progress, dict) or "step" not in progress or "data_cursor" not in progress:
        return {"ok": False, "reason": "load test: the progress part holds no step and data cursor"}
    if step is not None and progress["step"] != step:
        return {"ok": False, "reason": f"load test: the saved progress is at step {progress['step']}, "
                                       f"the manifest says {step}"}
    if data_cursor is not None and progress["data_cursor"] != data_cursor:
        return {"ok": False, "reason": f"load test: the saved data cursor is {progress['data_cursor']}, "
                                       f"the manifest says {data_cursor}"}
    bad = sorted(key for key, value in target.items()
                 if key.startswith("model.") and isinstance(value, torch.Tensor) and value.is_floating_point()
                 and not bool(torch.isfinite(value).all()))
    if bad:
        return {"ok": False, "reason": f"load test: non-finite model weights in {bad[:5]}"}
    return {"ok": True, "reason": None, "tensors": len(tensors),
            "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors)}


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:297] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--step", type=int)
    parser.add_argument("--data-cursor", type=int)
    args = parser.parse_args(argv)
    try:
        verdict = load(args.path, step=args.step, data_cursor=args.data_cursor)
    except Exception as error:  # unreadable metadata and the like: still one JSON line
        verdict = {"ok": False, "reason": f"load test: {_short(error)}"}
    print(json.dumps(verdict))
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
