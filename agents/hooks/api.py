"""``Hooks``: the few lines a training script adds to get verified checkpoints, exact resume,
guards and reporting.

    nw = Hooks(model, optimizer, scheduler=scheduler, dataset=dataset, batch_size=8,
               ckpt_dir="ckpt", checkpoint_every=100, config=vars(args))
    for batch in nw.batches(max_steps=10_000):
        loss = compute_loss(model, batch)
        loss.backward()
        nw.step(loss)          # guard, optimizer + scheduler step, report, checkpoint, control
    nw.close()

One step of the loop, as the hooks see it: ``batches`` times the *input* phase and hands out
the batch; user code runs the *compute* phase; ``step`` measures the gradient norm, applies or
skips the update, every ``check_every`` steps exchanges (loss, grad norm, control flags) with the
other ranks (*optimizer* phase), then checkpoints when due (*checkpoint* phase) and reports.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from agents.hooks import resume, state
from agents.hooks.checkpointer import Checkpointer, Commit, describe_failure
from agents.hooks.data import GlobalCursorSampler
from agents.hooks.guards import GradientGuard, GuardSettings, LossWatch
from agents.hooks.settings import Environment
from agents.hooks.staging import stable_tensors
from agents.hooks.telemetry import Exchange, Telemetry
from agents.hooks.topology import discover
from agents.protocol.hooks import EXIT_PAUSED, EXIT_RESUME_REFUSED, EXIT_STALE_GENERATION

log = logging.getLogger("nightwatch.hooks")


class StopTraining(SystemExit):
    """Raised by ``Hooks.step`` when training must end now (pause, stale generation, bad resume).

    A ``SystemExit``, so an uncaught one ends the process with ``code`` (see
    ``agents.protocol.hooks``) after the hooks have already closed cleanly.
    """

    def __init__(self, code: int, reason: str):
        super().__init__(code)
        self.reason = reason


@dataclass(frozen=True)
class StepOutcome:
    """What ``Hooks.step`` did: the step number now completed, and what the guards saw."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    spike: bool
    nan: bool
    inconsistent: bool


class Hooks:
    """Verified checkpoints, exact resume, guards and reporting around one training loop.

    Construct it on every rank after the process group (if any) exists and the model is wrapped
    (DDP, ...): it creates its own gloo groups, picks and restores the checkpoint to resume from,
    and builds the data loader from ``dataset`` (map-style) and the per-rank ``batch_size``.
    ``config`` holds whatever makes a checkpoint incompatible; ``env`` defaults to the
    NIGHTWATCH_* variables (see ``settings.py``). docs/hooks.md is the user's guide.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, dataset: Any,
                 batch_size: int, scheduler: Any = None, scaler: Any = None, ckpt_dir: str | None = None,
                 checkpoint_every: int | None = None, config: Mapping[str, Any] | None = None, seed: int = 0,
                 shuffle: bool = True, max_grad_norm: float | None = None,
                 guards: GuardSettings | None = None, async_save: bool = True,
                 loader_options: Mapping[str, Any] | None = None, tokens_per_sample: int = 0,
                 flops_per_token: float | None = None, env: Environment | None = None):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.max_grad_norm = max_grad_norm
        self.guard_settings = guards or GuardSettings()
        self.loader_options = dict(loader_options or {})
        self.tokens_per_sample = tokens_per_sample
        self.env = env or Environment.from_env()
        self.topology = discover()
        _default_logging(self.topology.rank)
        self.config_hash = config_fingerprint(model, config)
        self.ckpt_dir = self.env.ckpt_dir or ckpt_dir
        self.checkpoint_every = checkpoint_every
        self.step_count = 0
        self.data_cursor = 0
        self.resumed_from: str | None = None
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._grad_guard = GradientGuard(self.guard_settings)
        self._loss_watch = LossWatch(self.guard_settings.detection, speaks_for_job=self.topology.rank == 0)
        self._last_saved_step: int | None = None
        self._last_loss = math.nan
        self._grads_ready = 0.0  # when this rank's last gradient bucket was ready (DDP)
        self._time_gradients(model)
        self._inconsistent = False
        self._closed = False
        self.telemetry = Telemetry(self.env, self.topology, self.guard_settings)
        run_id = self.topology.broadcast_from_rank0(os.urandom(3).hex())  # names this run's checkpoints
        self.checkpointer = (
            Checkpointer(self.ckpt_dir, self.topology, generation=self.env.generation, run_id=run_id,
                         use_async=async_save, on_commit=self._committed, on_failure=self._save_failed)
            if self.ckpt_dir else None)
        self._resume()
        self.parameter_count = parameter_count(model)
        self._report_model(flops_per_token)
        self.sampler = GlobalCursorSampler(len(dataset), batch_size, rank=self.topology.rank,
                                           world_size=self.topology.world_size, seed=seed, shuffle=shuffle,
                                           start_cursor=self.data_cursor, skip=self.env.skip_data)

    # -- the training loop ---------------------------------------------------------------------

    def batches(self, max_steps: int | None = None) -> Iterator[Any]:
        """This rank's batches from the current data position until ``max_steps`` steps are done.

        Call ``step(loss)`` exactly once per batch. At ``max_steps`` a final checkpoint is saved
        and committed before the loop ends.
        """
        options = {"num_workers": 0, **self.loader_options}
        # A generator of its own: iter(DataLoader) otherwise draws from the global torch RNG,
        # which would shift every random stream after a resume.
        generator = torch.Generator().manual_seed(self.seed * 7919 + self.data_cursor)
        self.sampler.start_cursor = self.data_cursor
        iterator = iter(DataLoader(self.dataset, batch_sampler=self.sampler, generator=generator, **options))
        while max_steps is None or self.step_count < max_steps:
            started = time.perf_counter()
            batch = next(iterator)
            self.telemetry.begin_step(input_s=time.perf_counter() - started)
            expected_step = self.step_count + 1
            yield batch
            if self.step_count != expected_step:
                raise RuntimeError("call nw.step(loss) exactly once for every batch from nw.batches()")
        if self.checkpointer and self._last_saved_step != self.step_count:
            self._save()
        if self.checkpointer:
            self.checkpointer.wait()

    def batch_indices(self) -> list[int]:
        """Dataset indices of the batch being trained on (this rank), e.g. to log what was seen."""
        return self.sampler.indices_at(self.sampler.next_cursor(self.data_cursor))

    def step(self, loss: torch.Tensor) -> StepOutcome:
        """Guard, apply the update, exchange with the other ranks, checkpoint if due, report."""
        if self._params and self._params[0].is_cuda:
            torch.cuda.synchronize()  # so queued GPU work counts as compute, not as the next phase
        entered = time.perf_counter()
        compute_s = self.telemetry.compute_done(entered)
        # Under DDP the end of backward waits for the slowest rank in the all-reduce: that wait is
        # communication, not this rank's compute (a straggler is told apart by its compute).
        waited = entered - self._grads_ready if 0.0 < entered - self._grads_ready <= compute_s else 0.0
        self._grads_ready = 0.0
        compute_s -= waited
        loss_value = float(loss.detach())
        grad_norm = self._gradient_norm()
        decision = self._grad_guard.judge(grad_norm)
        nan = not math.isfinite(loss_value) or (self.scaler is None and not math.isfinite(grad_norm))
        skip = decision.skip and self.guard_settings.skip_bad_steps
        lr = self._learning_rate()  # the rate this step was taken with: a restart is expected, not a fault
        skipped = self._update(skip)
        verdict = self._loss_watch.observe(loss_value, lr=lr, skipped=skipped)
        self.step_count += 1
        trained_at = self.sampler.next_cursor(self.data_cursor)
        if trained_at != self.data_cursor:
            self.telemetry.event(self.step_count, "data_skipped", f"skipped global samples {self.data_cursor}-"
                                 f"{trained_at} as the rollback asked",
                                 {"from": self.data_cursor, "to": trained_at})
        self.data_cursor = trained_at + self.sampler.step_size
        self._last_loss = loss_value
        exchange = None
        if self.step_count % self.guard_settings.check_every == 0:
            exchange = self.telemetry.exchange(self.step_count, loss_value, grad_norm,
                                               self._loss_watch.take_window_mean())
            self._inconsistent = exchange.consistency.inconsistent
            if exchange.checkpoint_interval:
                self.checkpoint_every = exchange.checkpoint_interval
        before_checkpoint = time.perf_counter()
        if self._checkpoint_due(exchange):
            self._save()
        checkpoint_s = time.perf_counter() - before_checkpoint
        optimizer_s = before_checkpoint - entered + waited
        outcome = StepOutcome(self.step_count, loss_value, grad_norm, skipped, verdict.spike, nan, self._inconsistent)
        self.telemetry.step_done(outcome, decision, verdict, compute_s=compute_s,
                                 optimizer_s=optimizer_s, checkpoint_s=checkpoint_s,
                                 data_cursor=self.data_cursor, samples=self.batch_size,
                                 tokens=self.batch_size * self.tokens_per_sample)
        if exchange:
            self._obey(exchange)
        return outcome

    def close(self) -> None:
        """Wait for the checkpoint in flight to commit, then flush reports. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.checkpointer:
            self.checkpointer.close()
        self.telemetry.close()

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside a step -------------------------------------------------------------------------

    def _gradient_norm(self) -> float:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # measure (and clip) true gradients, not scaled ones
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return 0.0
        total = torch.nn.utils.get_total_norm(grads, foreach=True)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self._params, self.max_grad_norm, total, foreach=True)
        return float(total)

    def _time_gradients(self, model: torch.nn.Module) -> None:
        """Under DDP, note when this rank's last gradient bucket is ready, just before its all-reduce:
        the time until then is this rank's own compute, the rest of backward is waiting for peers.
        A script that registered its own communication hook keeps it (no split then)."""
        if not isinstance(model, DistributedDataParallel):
            return
        # Deferred: only DDP jobs need it, and it pulls in torch.distributed's algorithms package.
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def timed_allreduce(state: Any, bucket: Any) -> Any:
            self._grads_ready = time.perf_counter()
            return default_hooks.allreduce_hook(state, bucket)

        # DDP checks the hook's annotations against its own types; postponed ones are strings.
        timed_allreduce.__annotations__ = {}
        try:
            model.register_comm_hook(None, timed_allreduce)
        except Exception as error:  # noqa: BLE001 - timing is optional; training must not fail for it
            log.info("not timing gradient readiness: %s", error)

    def _learning_rate(self) -> float | None:
        groups = self.optimizer.param_groups
        lr = groups[0].get("lr") if groups else None
        return float(lr) if isinstance(lr, (int, float)) else None

    def _update(self, skip: bool) -> bool:
        """Apply (or skip) the optimizer and scheduler step; True when the update was not applied."""
        applied = not skip
        if self.checkpointer:
            self.checkpointer.before_update()  # a checkpoint still copying these tensors goes first
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            if not skip:
                self.scaler.step(self.optimizer)
            self.scaler.update()
            applied = applied and self.scaler.get_scale() >= scale  # a lowered scale = overflow, skipped
        elif applied:
            self.optimizer.step()
        if applied and self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return not applied

    def _checkpoint_due(self, exchange: Exchange | None) -> bool:
        if not self.checkpointer:
            return False
        if exchange and (exchange.checkpoint_now or exchange.pause):
            return True
        every = self.checkpoint_every
        return every is not None and every != 0 and self.step_count % every == 0

    def _save(self) -> None:
        if self.checkpointer is None:
            return
        progress = state.Progress(self.step_count, self.data_cursor, self.topology.world_size,
                                  self.env.generation)
        snapshot = state.collect_state(self.model, self.optimizer, scheduler=self.scheduler,
                                       scaler=self.scaler, progress=progress, rank=self.topology.rank)
        fields = {"loss": self._last_loss if math.isfinite(self._last_loss) else None,
                  "config_hash": self.config_hash, "world_size": self.topology.world_size,
                  "data_cursor": self.data_cursor, "generation": self.env.generation, "job": self.env.job,
                  "parts": state.saved_parts(set(snapshot)),
                  # The registry then requires the grad scaler's state in the checkpoint.
                  "amp": self.scaler is not None}
        self._last_saved_step = self.step_count
        self.checkpointer.save(self.step_count, snapshot, fields, stable=stable_tensors(self.model, self.optimizer))

    def _obey(self, exchange: Exchange) -> None:
        if exchange.stale:
            # Fenced off: another generation owns the job. Write nothing more, just leave.
            self._stop(EXIT_STALE_GENERATION, "the control plane says this generation is stale")
        if exchange.pause:
            commit = self.checkpointer.wait() if self.checkpointer else None
            self.telemetry.event(self.step_count, "pause_ack", "paused after a checkpoint",
                                 {"checkpoint": commit.path if commit else None})
            self._stop(EXIT_PAUSED, "pause requested by the control plane")

    def _stop(self, code: int, reason: str) -> None:
        log.warning("stopping training at step %d: %s (exit code %d)", self.step_count, reason, code)
        self.close()
        raise StopTraining(code, reason)

    # -- resume and commits --------------------------------------------------------------------

    def _resume(self) -> None:
        choice = None
        if self.topology.rank == 0:
            choice = resume.choose_checkpoint(self.env, self.ckpt_dir, self.config_hash)
        choice = self.topology.broadcast_from_rank0(choice)
        for path, reason in choice.rejected:  # rank 0 logged each one as it turned it down
            self.telemetry.event(0, "checkpoint_rejected", f"not restoring {path}: {reason}",
                                 {"path": path, "reason": reason}, level=None)
        if choice.refused:
            self._stop(EXIT_RESUME_REFUSED, f"checkpoint to resume from failed verification: {choice.refused}")
        if choice.path is None:
            log.info("no verified checkpoint to resume from: starting at step 0")
            return
        progress, parts = resume.restore(choice.path, self.topology, self.model, self.optimizer,
                                         scheduler=self.scheduler, scaler=self.scaler)
        self.step_count, self.data_cursor = progress.step, progress.data_cursor
        self._last_saved_step = progress.step
        self.resumed_from = choice.path
        self.telemetry.event(progress.step, "resumed",
                             f"resumed from step {progress.step} (checkpoint {choice.path})",
                             {"step": progress.step, "checkpoint": choice.path, "parts": parts,
                              "world_size": self.topology.world_size,
                              "previous_world_size": progress.world_size})
        if progress.world_size != self.topology.world_size:
            self.telemetry.event(progress.step, "world_size_change",
                                 f"world size changed from {progress.world_size} to "
                                 f"{self.topology.world_size}; continuing at global sample {progress.data_cursor}",
                                 {"previous": progress.world_size, "current": self.topology.world_size,
                                  "data_cursor": progress.data_cursor})

    def _report_model(self, flops_per_token: float | None) -> None:
        """Once per process: what the control plane needs for MFU (FLOPs per token defaults to
        6 × parameters there; pass ``flops_per_token`` for a sharded or unusual model)."""
        detail: dict[str, Any] = {"parameters": self.parameter_count, "tokens_per_sample": self.tokens_per_sample}
        if flops_per_token:
            detail["flops_per_token"] = float(flops_per_token)
        self.telemetry.event(self.step_count, "model", f"model: {self.parameter_count:,} parameters, "
                             f"{self.tokens_per_sample} tokens per sample", detail, level=logging.DEBUG)

    def _committed(self, commit: Commit) -> None:
        self.telemetry.checkpoint_committed(commit, self.config_hash)

    def _save_failed(self, path: str, step: int, error: BaseException) -> None:
        """A save failed (any exception, DCP's ``CheckpointException`` included): say why, and
        train on; the previous checkpoint stands (``Checkpointer`` removed the partial files)."""
        reason, code = describe_failure(error)
        self.telemetry.event(step, "checkpoint_failed",
                             f"checkpoint at step {step} failed: {reason}; training goes on from the previous "
                             f"checkpoint ({path})",
                             {"path": path, "reason": reason, "errno": code, "error": str(error)[:500]},
                             level=logging.ERROR)


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters of the model as this rank holds it (shared and tied ones once). Under DDP that is
    the whole model; under FSDP/tensor parallelism it is a shard: pass ``flops_per_token`` then."""
    return sum(p.numel() for p in model.parameters())


def config_fingerprint(model: torch.nn.Module, config: Mapping[str, Any] | None) -> str:
    """A short hash of what makes a checkpoint restorable: the user's config and the parameter shapes.

    World size is deliberately not part of it: resuming on another world size is supported.
    """
    shapes = sorted((name.removeprefix("module."), list(p.shape)) for name, p in model.named_parameters())
    blob = json.dumps({"config": config or {}, "parameters": shapes}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _default_logging(rank: int) -> None:
    """Make the hooks' log lines visible when the training script configured no logging at all."""
    logger = logging.getLogger("nightwatch")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[nightwatch rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
