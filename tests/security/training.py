"""The victim of the attacks on running jobs: a CPU training job that keeps stepping until stopped."""

from __future__ import annotations

from pathlib import Path

from tests.ports import free_port


def long_training_spec(name: str, tmp_path: Path) -> dict:
    """A 1-node, 2-rank job of examples/train.py that steps every 50 ms and never finishes by itself."""
    return {"name": name, "entrypoint": "examples/train.py", "nnodes": 1, "nproc_per_node": 2,
            "accelerator": "cpu", "rdzv_port": free_port(),
            "args": ["--steps", "100000", "--ckpt-every", "1000", "--dataset-size", "256", "--min-step-time", "0.05"],
            "checkpoint_policy": {"dir": str(tmp_path / "checkpoints" / "ckpt")},
            "recovery_policy": {"backoff_seconds": 0}}
