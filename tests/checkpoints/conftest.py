"""Real DCP checkpoints for the registry tests, written once per session by the example job.

Four runs of ``examples/train.py`` (one process each, standalone hooks, no control plane) build a
lineage the way the control plane would have asked for it:

    A  generation 1, from scratch          steps 2, 4, 6
    B  generation 2, resumed from A/6      steps 8, 10
    C  generation 3, resumed from B/8      steps 10, 12     (B/10 turned out corrupt)
    D  generation 4, resumed from A/4      steps 6, 8       (a rollback)
    F  a foreign run: another seed, hence another config hash, step 2

Tests never modify these: ``copy_runs`` gives each test its own copy to damage or delete.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from agents.hooks.manifest import MANIFEST, write_manifest
from agents.protocol.hooks import CheckpointCommit

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_ARGS = ["--ckpt-every", "2", "--dataset-size", "256"]


@dataclass(frozen=True)
class Runs:
    root: Path

    def path(self, run: str, step: int) -> Path:
        (found,) = (self.root / run).glob(f"step-{step:08d}-*")
        return found


def _train(directory: Path, steps: int, *, generation: int, resume_from: Path | None = None,
           extra: tuple[str, ...] = ()) -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTWATCH_")}
    environment.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NIGHTWATCH_GENERATION": str(generation),
                        "NIGHTWATCH_SPOOL_DIR": str(directory.parent / "spool")})
    if resume_from is not None:
        environment["NIGHTWATCH_RESUME_FROM"] = str(resume_from)
    command = [sys.executable, "-m", "examples.train", "--steps", str(steps), "--ckpt-dir", str(directory),
               *EXAMPLE_ARGS, *extra]
    done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    if resume_from is not None:
        assert f"resumed from step {_manifest(resume_from)['step']}" in done.stdout + done.stderr


@pytest.fixture(scope="session")
def example_runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("example-runs")
    runs = Runs(root)
    # Two at a time: the independent runs of each wave share the two cores.
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda f: f(), [lambda: _train(root / "A", 6, generation=1),
                                      lambda: _train(root / "F", 2, generation=1, extra=("--seed", "1"))]))
        list(pool.map(lambda f: f(), [lambda: _train(root / "B", 10, generation=2, resume_from=runs.path("A", 6)),
                                      lambda: _train(root / "D", 8, generation=4, resume_from=runs.path("A", 4))]))
    _train(root / "C", 12, generation=3, resume_from=runs.path("B", 8))
    return runs


@pytest.fixture
def runs(example_runs, tmp_path) -> Runs:
    """This test's own copy of the example runs (safe to corrupt and delete)."""
    shutil.copytree(example_runs.root, tmp_path / "runs", ignore=shutil.ignore_patterns("spool"))
    return Runs(tmp_path / "runs")


def _manifest(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def commit_for(job, path: Path, *, generation: int | None = None, blocking_s: float = 0.05,
               total_s: float = 1.0) -> CheckpointCommit:
    """The commit report the hooks send for the checkpoint at ``path`` (the manifest's own fields)."""
    manifest = _manifest(path)
    return CheckpointCommit(
        job=str(job.pk), generation=manifest["generation"] if generation is None else generation,
        step=manifest["step"], path=str(path), loss=manifest["loss"], config_hash=manifest["config_hash"],
        data_cursor=manifest["data_cursor"], world_size=manifest["world_size"],
        size_bytes=sum(f["size"] for f in manifest["files"]), blocking_s=blocking_s, total_s=total_s,
        manifest=manifest,
    )


def recommit(source: Path, target: Path, *, step: int, generation: int) -> Path:
    """A new committed checkpoint at ``target`` sharing ``source``'s DCP files (hard links).

    The hooks' own ``write_manifest`` commits it for ``step``: a cheap way to have hundreds of
    real, distinct, verifiable checkpoints (their DCP progress blob still says the source step,
    which only the optional load test reads).
    """
    target.mkdir(parents=True)
    manifest = _manifest(source)
    for entry in manifest["files"]:
        os.link(source / entry["name"], target / entry["name"])
    fields = {k: v for k, v in manifest.items() if k not in ("format", "files")}
    write_manifest(target, {**fields, "step": step, "data_cursor": step * 4, "generation": generation})
    return target


def flip_byte(path: Path, offset: int = 4096) -> None:
    with path.open("r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(autouse=True)
def _roots_in_tmp_path(settings, tmp_path):
    """The checkpoint root is this test's directory (its runs, built checkpoints and the job's
    directory all lie inside); replicas may go under ``replica/`` (and CHECKPOINT_REPLICA_ROOT)."""
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "CHECKPOINT_ROOT": str(tmp_path),
                           "REPLICA_ROOTS": [str(tmp_path / "replica")]}


@pytest.fixture
def ckjob(cast, tmp_path):
    """cast.job on CPU with a checkpoint policy and a restart budget, started: generation 1 on gpu-01.

    Its checkpoint directory is the test's directory, so the example runs copied there are its own."""
    from jobs import services
    from jobs.models import Job

    Job.objects.filter(pk=cast.job.pk).update(
        accelerator="cpu",
        checkpoint_policy={"dir": str(tmp_path), "interval": "fixed", "interval_steps": 2, "keep_last": 3,
                           "permanent_every_hours": 12},
        recovery_policy={"max_restarts": 100, "window_minutes": 60, "backoff_seconds": 0, "allow_shrink": False,
                         "progress_timeout_s": None, "loss_spike_limit": 3},
    )
    job = Job.objects.get(pk=cast.job.pk)
    services.start_job(job, actor="test")
    job.refresh_from_db()
    return job


def crash_and_restart(job) -> None:
    """gpu-01 reports its ranks died; the orchestrator quiesces and relaunches (restore_point inside)."""
    from jobs import orchestrator

    orchestrator.handle_exit(job.pk, job.generation, "gpu-01",
                             {"exit_code": 1, "signature": "signal", "ranks": [{"rank": 0, "signal": 9}]})
    assert orchestrator.advance_recovery(job.pk)  # quiescing -> recovering
    assert orchestrator.advance_recovery(job.pk)  # recovering -> initializing, next generation
    job.refresh_from_db()


def register(job, path: Path, **kwargs):
    """Record the commit of ``path`` for the job's current generation and verify it, as the task would."""
    from checkpoints import services
    from jobs.checkpointing import commit_checkpoint

    checkpoint, created = commit_checkpoint(job, commit_for(job, path, generation=job.generation, **kwargs),
                                            actor="node:gpu-01")
    assert created
    return services.verify(checkpoint)


def build_checkpoint(directory: Path, *, step: int, data_cursor: int, config_hash: str, world_size: int = 1,
                     scheduler: bool = True, amp: bool = False, progress_blob: bytes | None = None,
                     parts: list[str] | None = None) -> Path:
    """A real DCP checkpoint committed with the hooks' own functions, for states the example job never
    writes: no LR scheduler, AMP without its scaler, a world of ``world_size`` ranks of which only
    rank 0's RNG was saved, a progress blob that does not unpickle, or a forged parts list."""
    import torch
    import torch.distributed.checkpoint as dcp

    from agents.hooks import state as hook_state

    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0) if scheduler else None
    progress = hook_state.Progress(step=step, data_cursor=data_cursor, world_size=world_size, generation=1)
    snapshot = hook_state.collect_state(model, optimizer, scheduler=lr_scheduler, scaler=None, progress=progress,
                                        rank=0)
    if progress_blob is not None:
        snapshot["progress"] = progress_blob
    directory.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(snapshot, checkpoint_id=str(directory), no_dist=True)
    fields = {"loss": 1.5, "config_hash": config_hash, "world_size": world_size, "data_cursor": data_cursor,
              "generation": 1, "job": "test", "step": step,
              "parts": parts if parts is not None else hook_state.saved_parts(set(snapshot))}
    if amp:
        fields["amp"] = True
    write_manifest(directory, fields)
    return directory
