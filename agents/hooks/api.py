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

With ``accumulation_steps=K`` a *step* is still one optimizer update: ``batches`` hands out K
micro-batches per step (under DDP the first K-1 inside ``no_sync``), ``step(loss)`` is called after
each backward and updates on the K-th. Checkpoints, reports, ``step_count`` and ``max_steps`` count
updates, so a checkpoint always lies on a window boundary and a resume replays the interrupted
window's micro-batches from its first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from agents.hooks import inprocess, resume, snapshot, state
from agents.hooks.checkpointer import Checkpointer, Commit, describe_failure, lost_peer
from agents.hooks.data import GlobalCursorSampler, epoch_aware, is_stateful, pipeline_parts
from agents.hooks.guards import GradientGuard, GuardSettings, LossWatch
from agents.hooks.settings import Environment
from agents.hooks.snapshot import Lineage, SnapshotCommit, Snapshotter
from agents.hooks.snapshot_store import SnapshotStore, default_root, job_key
from agents.hooks.staging import stable_tensors
from agents.hooks.telemetry import Exchange, Telemetry
from agents.hooks.topology import discover, side_group
from agents.protocol.hooks import EXIT_PAUSED, EXIT_RESUME_REFUSED, EXIT_STALE_GENERATION

log = logging.getLogger("nightwatch.hooks")

#: In-memory snapshots every this many steps unless the script or NIGHTWATCH_SNAPSHOT_EVERY says
#: otherwise (docs/benchmarks/snapshot.md has the measured cost behind it).
DEFAULT_SNAPSHOT_EVERY = 0
#: At most one ``snapshot_committed`` event per this many seconds (``_snapshot_committed``).
SNAPSHOT_EVENT_INTERVAL_S = 30.0
#: The snapshot group's timeout: a partner that stops answering fails the copy, not training.
_SNAPSHOT_GROUP_TIMEOUT_S = 300.0


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
    """What ``Hooks.step`` did: the step number now completed, and what the guards saw.

    ``accumulating``: this call only accumulated a micro-batch's gradients (no update yet);
    ``step`` is then the number of updates done so far, ``loss`` this micro-batch's and
    ``grad_norm`` NaN (not measured). On the window's last micro-batch ``loss`` is the sum of the
    losses passed over the window, which is the loss the accumulated gradient belongs to.
    """

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    spike: bool
    nan: bool
    inconsistent: bool
    accumulating: bool = False


class Hooks:
    """Verified checkpoints, exact resume, guards and reporting around one training loop.

    Construct it on every rank after the process group (if any) exists and the model is wrapped
    (DDP, ...): it creates its own gloo groups, picks and restores the checkpoint to resume from.
    The data comes either from ``dataset`` (map-style) and the per-rank ``batch_size``, read in the
    order of a ``GlobalCursorSampler`` (the default: exact even across a world-size change), or
    from the script's own pipeline: ``loader=`` (any iterable of batches, e.g. a ``DataLoader`` or
    torchdata's ``StatefulDataLoader``) or ``sampler=`` (with ``dataset`` and ``batch_size``). Its
    position is checkpointed through ``state_dict()``/``load_state_dict()`` and its epoch set
    with ``set_epoch``. ``accumulation_steps`` micro-batches make one step; ``scheduler`` is
    stepped per step, ``epoch_scheduler`` per data epoch (``ReduceLROnPlateau`` with
    ``epoch_metric()`` or the epoch's mean loss). ``config`` holds whatever makes a checkpoint
    incompatible; ``env`` defaults to the NIGHTWATCH_* variables (see ``settings.py``).
    ``snapshot_every``: an in-memory snapshot, copied to a partner rank, every N steps (0: off;
    see ``snapshot.py``); NIGHTWATCH_SNAPSHOT_EVERY wins.
    docs/hooks.md is the user's guide.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, dataset: Any = None,
                 batch_size: int | None = None, loader: Any = None, sampler: Any = None,
                 accumulation_steps: int = 1, scheduler: Any = None, epoch_scheduler: Any = None,
                 epoch_metric: Callable[[], float] | None = None, scaler: Any = None,
                 ckpt_dir: str | None = None,
                 checkpoint_every: int | None = None, config: Mapping[str, Any] | None = None, seed: int = 0,
                 shuffle: bool = True, max_grad_norm: float | None = None,
                 guards: GuardSettings | None = None, async_save: bool = True,
                 loader_options: Mapping[str, Any] | None = None, tokens_per_sample: int = 0,
                 flops_per_token: float | None = None, snapshot_every: int | None = None,
                 env: Environment | None = None):
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be at least 1, not {accumulation_steps}")
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.epoch_scheduler, self.epoch_metric = epoch_scheduler, epoch_metric
        self.accumulation_steps = accumulation_steps
        self.loader = _user_loader(loader, sampler, dataset, batch_size, loader_options)
        if self.loader is None and (dataset is None or batch_size is None):
            raise ValueError("pass dataset= and batch_size=, or your own loader= (or sampler=)")
        self.dataset = dataset if dataset is not None else getattr(self.loader, "dataset", None)
        self.batch_size = batch_size or getattr(self.loader, "batch_size", None) or 1
        self.seed, self.shuffle = seed, shuffle
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
        self.epoch = 0  # the data epoch of the batch being trained
        self.micro_step = 0  # micro-batches of the current accumulation window already stepped
        self.resumed_from: str | None = None
        self._data_parts = pipeline_parts(self.loader) if self.loader is not None else (
            {"dataset": dataset} if is_stateful(dataset) else {})
        self._epoch_aware = epoch_aware(self.loader if self.loader is not None else dataset)
        self._told_epoch: int | None = None
        self._epoch_loss = [0.0, 0]  # this rank's sum of step losses and steps in the current epoch
        self._window_loss = 0.0
        self._calls = 0  # step() calls, micro-steps included
        self._iterator: Iterator[Any] | None = None  # the script's own loader, across batches() calls
        self._batches_in_epoch = 0  # batches the loader handed out in this epoch
        self._replay = 0  # batches to re-read after a resume (a loader that has no state_dict)
        self._restored = False
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._grad_guard = GradientGuard(self.guard_settings)
        self._loss_watch = LossWatch(self.guard_settings.detection, speaks_for_job=self.topology.rank == 0)
        self._last_saved_step: int | None = None
        self._committed_step: int | None = None  # rank 0: the newest checkpoint committed
        self._finished_on_disk = False  # the loop ended at max_steps with that step's checkpoint committed
        self._last_loss = math.nan
        self._grads_ready = 0.0  # when this rank's last gradient bucket was ready (DDP)
        self._time_gradients(model)
        self._inconsistent = False
        self._closed = False
        self._end_announced = False
        self.telemetry = Telemetry(self.env, self.topology, self.guard_settings)
        run_id = self.topology.broadcast_from_rank0(os.urandom(3).hex())  # names this run's checkpoints
        self.checkpointer = (
            Checkpointer(self.ckpt_dir, self.topology, generation=self.env.generation, run_id=run_id,
                         use_async=async_save, on_commit=self._committed, on_failure=self._save_failed)
            if self.ckpt_dir else None)
        self.snapshot_every = next(v for v in (self.env.snapshot_every, snapshot_every, DEFAULT_SNAPSHOT_EVERY)
                                   if v is not None)
        self.snapshotter = self._start_snapshots(run_id) if self.snapshot_every > 0 else None
        self.last_snapshot: SnapshotCommit | None = None
        self._snapshot_reported_at: float | None = None
        self._resume()
        self.parameter_count = parameter_count(model)
        self._report_model(flops_per_token)
        self.sampler = None if self.loader is not None else GlobalCursorSampler(
            len(dataset), self.batch_size, rank=self.topology.rank, world_size=self.topology.world_size,
            seed=seed, shuffle=shuffle, start_cursor=self.data_cursor, skip=self.env.skip_data)
        if self.loader is not None and self.env.skip_data:
            log.warning("a rollback asked to skip global samples %s, which only the default sampler can do: "
                        "your own loader reads them", self.env.skip_data)

    # -- the training loop ---------------------------------------------------------------------

    def batches(self, max_steps: int | None = None) -> Iterator[Any]:
        """This rank's batches from the current data position until ``max_steps`` steps are done.

        Call ``step(loss)`` exactly once per batch (per micro-batch with ``accumulation_steps``).
        At ``max_steps`` a final checkpoint is saved and committed before the loop ends.
        """
        if self.sampler is not None:
            self._iterator = self._cursor_batches()
        while max_steps is None or self.step_count < max_steps:
            started = time.perf_counter()
            batch = self._next_batch()
            self.telemetry.begin_step(input_s=time.perf_counter() - started, continuing=self.micro_step > 0)
            expected_calls = self._calls + 1
            # Under DDP, the window's earlier micro-batches only accumulate: no gradient all-reduce.
            last_of_window = self.micro_step + 1 == self.accumulation_steps
            no_sync = getattr(self.model, "no_sync", None)
            with nullcontext() if last_of_window or no_sync is None else no_sync():
                yield batch
            if self._calls != expected_calls:
                raise RuntimeError("call nw.step(loss) exactly once for every batch from nw.batches()")
        self._announce_end(max_steps)
        if self.checkpointer and self._last_saved_step != self.step_count:
            self._save()
        if self.checkpointer:
            self.checkpointer.wait()
            if self.snapshotter:  # every rank asks rank 0, which alone knows whether the commit held
                self._finished_on_disk = self.topology.broadcast_from_rank0(self._committed_step == self.step_count)

    def batch_indices(self) -> list[int]:
        """Dataset indices of the batch being trained on (this rank), e.g. to log what was seen.

        Call it before ``step``: ``step`` moves the data position on to the next batch."""
        if self.sampler is None:
            raise RuntimeError("batch_indices() needs the hooks' own sampler; with loader= or sampler= your "
                               "pipeline knows which samples it handed out")
        return self.sampler.indices_at(self.sampler.next_cursor(self.data_cursor))

    # -- the data pipeline ---------------------------------------------------------------------

    def _cursor_batches(self) -> Iterator[Any]:
        """Batches in GlobalCursorSampler order from the current cursor (the default pipeline)."""
        assert self.sampler is not None and self.dataset is not None
        options = {"num_workers": 0, **self.loader_options}
        # A generator of its own: iter(DataLoader) otherwise draws from the global torch RNG,
        # which would shift every random stream after a resume.
        generator = torch.Generator().manual_seed(self.seed * 7919 + self.data_cursor)
        self.sampler.start_cursor = self.data_cursor
        return iter(DataLoader(self.dataset, batch_sampler=self.sampler, generator=generator, **options))

    def _next_batch(self) -> Any:
        if self.sampler is not None:
            # The epoch of the batch about to be read, told before the dataset reads it.
            position = self.sampler.next_cursor(self.data_cursor)
            self._enter_epoch(position // self.sampler.dataset_size)
            assert self._iterator is not None
            return next(self._iterator)
        empty = 0
        while True:
            if self._iterator is None:
                self._enter_epoch(self.epoch)
                self._iterator = self._open_loader()
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                empty = empty + 1 if self._batches_in_epoch == 0 else 0
                if empty > 1:
                    raise RuntimeError("the loader handed out no batch in a whole epoch") from None
                self._enter_epoch(self.epoch + 1)
                continue
            self._batches_in_epoch += 1
            return batch

    def _open_loader(self) -> Iterator[Any]:
        """iter(loader); after a resume without drawing from the global RNG (an uninterrupted run
        made this iterator at the epoch's start, from an RNG state long gone), and re-reading the
        batches already trained when the loader has no state of its own."""
        if not self._restored:
            return iter(self.loader)
        self._restored = False
        with torch.random.fork_rng(devices=[]):
            iterator = iter(self.loader)
            for _ in range(self._replay):
                next(iterator)
        self._replay = 0
        return iterator

    def _enter_epoch(self, epoch: int) -> None:
        """Step the per-epoch scheduler for every epoch that ended, tell the pipeline the epoch."""
        while self.epoch < epoch:
            self._epoch_ended()
            self.epoch += 1
            self._batches_in_epoch = 0
        if self._told_epoch != epoch:
            for part in self._epoch_aware:
                part.set_epoch(epoch)
            self._told_epoch = epoch

    def _epoch_ended(self) -> None:
        total, steps = self._epoch_loss
        self._epoch_loss = [0.0, 0]
        if self.epoch_scheduler is None:
            return
        if isinstance(self.epoch_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            if self.epoch_metric is not None:
                metric = float(self.epoch_metric())
            else:  # the epoch's mean step loss over all ranks: the same decision everywhere
                rows = self.topology.all_gather_floats([total, float(steps)])
                metric = sum(r[0] for r in rows) / max(1.0, sum(r[1] for r in rows))
            self.epoch_scheduler.step(metric)
        else:
            self.epoch_scheduler.step()

    def _loop_state(self) -> dict[str, Any]:
        """This rank's training-loop state, checkpointed beside the model (``loop.rank<r>``)."""
        return {"epoch": self.epoch, "epoch_loss": list(self._epoch_loss), "batches_in_epoch": self._batches_in_epoch,
                "data": {name: part.state_dict() for name, part in self._data_parts.items()}}

    def _load_loop_state(self, saved: dict[str, Any]) -> None:
        self._epoch_loss = [float(saved["epoch_loss"][0]), int(saved["epoch_loss"][1])]
        self._batches_in_epoch = int(saved["batches_in_epoch"])
        # The saved epoch first (a sampler's set_epoch may reset its position), then the position.
        self._enter_epoch(self.epoch)
        data = saved.get("data", {})
        missing = sorted(set(self._data_parts) - set(data))
        if missing:
            raise ValueError(f"the checkpoint holds no state for {missing} of the data pipeline")
        for name, part in self._data_parts.items():
            part.load_state_dict(data[name])
        if self.loader is not None and not self._data_parts:
            self._replay = self._batches_in_epoch  # re-read this epoch's order up to the position
        self._restored = True

    def step(self, loss: torch.Tensor) -> StepOutcome:
        """Guard, apply the update, exchange with the other ranks, checkpoint if due, report.

        Call it after ``loss.backward()`` for every batch. With ``accumulation_steps=K`` the first
        K-1 calls of a window only count the micro-batch (``accumulating``); the K-th does all the
        rest with the loss summed over the window. On a pause or a stale generation it raises
        ``StopTraining`` after the checkpoint, so the code after ``step`` does not run that time.
        """
        self._calls += 1
        self._advance_data()
        if self.micro_step + 1 < self.accumulation_steps:
            self.micro_step += 1
            value = float(loss.detach())
            self._window_loss += value
            return StepOutcome(self.step_count, value, math.nan, False, False, not math.isfinite(value),
                               self._inconsistent, accumulating=True)
        self.micro_step = 0
        if self._params and self._params[0].is_cuda:
            torch.cuda.synchronize()  # so queued GPU work counts as compute, not as the next phase
        entered = time.perf_counter()
        compute_s = self.telemetry.compute_done(entered)
        # Under DDP the end of backward waits for the slowest rank in the all-reduce: that wait is
        # communication, not this rank's compute (a straggler is told apart by its compute).
        waited = entered - self._grads_ready if 0.0 < entered - self._grads_ready <= compute_s else 0.0
        self._grads_ready = 0.0
        compute_s -= waited
        loss_value, self._window_loss = self._window_loss + float(loss.detach()), 0.0
        grad_norm = self._gradient_norm()
        decision = self._grad_guard.judge(grad_norm)
        nan = not math.isfinite(loss_value) or (self.scaler is None and not math.isfinite(grad_norm))
        skip = decision.skip and self.guard_settings.skip_bad_steps
        lr = self._learning_rate()  # the rate this step was taken with: a restart is expected, not a fault
        skipped = self._update(skip, loss_value)
        verdict = self._loss_watch.observe(loss_value, lr=lr, skipped=skipped)
        self.step_count += 1
        self.telemetry.judged(self.step_count, verdict, loss_value)
        if math.isfinite(loss_value):
            self._epoch_loss = [self._epoch_loss[0] + loss_value, self._epoch_loss[1] + 1]
        self._last_loss = loss_value
        exchange = None
        if self.step_count % self.guard_settings.check_every == 0:
            exchange = self.telemetry.exchange(self.step_count, loss_value, grad_norm,
                                               self._loss_watch.take_window_mean())
            self._inconsistent = exchange.consistency.inconsistent
            if exchange.checkpoint_interval:
                self.checkpoint_every = exchange.checkpoint_interval
        before_checkpoint = time.perf_counter()
        checkpoint_due, snapshot_due = self._checkpoint_due(exchange), self._snapshot_due()
        if checkpoint_due or snapshot_due:
            captured = self._capture()
            if checkpoint_due:
                self._save(captured)
            if snapshot_due:
                self._snapshot(captured)
        checkpoint_s = time.perf_counter() - before_checkpoint
        optimizer_s = before_checkpoint - entered + waited
        outcome = StepOutcome(self.step_count, loss_value, grad_norm, skipped, verdict.spike, nan, self._inconsistent)
        self.telemetry.step_done(outcome, decision, verdict, compute_s=compute_s,
                                 optimizer_s=optimizer_s, checkpoint_s=checkpoint_s,
                                 data_cursor=self.data_cursor, samples=self.batch_size * self.accumulation_steps,
                                 tokens=self.batch_size * self.accumulation_steps * self.tokens_per_sample)
        if exchange:
            self._obey(exchange)
        return outcome

    def _advance_data(self) -> None:
        """Move the data position past the batch just trained (global samples, all ranks)."""
        if self.sampler is None:
            self.data_cursor += self.topology.world_size * self.batch_size
            return
        trained_at = self.sampler.next_cursor(self.data_cursor)
        if trained_at != self.data_cursor:
            self.telemetry.event(self.step_count + 1, "data_skipped", f"skipped global samples {self.data_cursor}-"
                                 f"{trained_at} as the rollback asked",
                                 {"from": self.data_cursor, "to": trained_at})
        self.data_cursor = trained_at + self.sampler.step_size

    def close(self) -> None:
        """Wait for the checkpoint in flight to commit, then flush reports. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.snapshotter:
            self.snapshotter.close()
            if self._finished_on_disk:
                # The final checkpoint is on disk, so nothing will restore these, and the tmpfs
                # they fill is host memory. A pause or a crash keeps them: the next generation's.
                self.snapshotter.discard()
        if self.checkpointer:
            self.checkpointer.close()
        self.telemetry.close()

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self._announce_end(None)
        self.close()

    def _announce_end(self, max_steps: int | None) -> None:
        """Tell the control plane at once that the loop is done (``run_ending``), before the final
        save, its commit and the reports' flush, which take seconds; the ranks exit after them. Its
        hang sweep waits for the end then (``jobs.progress``): without this word, a fast job's 2 s
        progress timeout ran out in that quiet and a finished run was declared hung. Once; never
        after an exception (a crash is not an end)."""
        if self._end_announced:
            return
        self._end_announced = True
        self.telemetry.event(self.step_count, "run_ending", f"training loop done at step {self.step_count}",
                             {"step": self.step_count, "max_steps": max_steps}, level=logging.DEBUG)

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

    def _update(self, skip: bool, loss: float) -> bool:
        """Apply (or skip) the optimizer and scheduler step; True when the update was not applied."""
        applied = not skip
        if self.checkpointer:
            self.checkpointer.before_update()  # a checkpoint still copying these tensors goes first
        if self.snapshotter:
            self.snapshotter.before_update()  # and so does a snapshot
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            if not skip:
                self.scaler.step(self.optimizer)
            self.scaler.update()
            applied = applied and self.scaler.get_scale() >= scale  # a lowered scale = overflow, skipped
        elif applied:
            self.optimizer.step()
        if applied and isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(loss)
        elif applied and self.scheduler is not None:
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

    def _snapshot_due(self) -> bool:
        return self.snapshotter is not None and self.step_count % self.snapshot_every == 0

    def _capture(self) -> dict[str, Any]:
        """The state a checkpoint or a snapshot holds, as of now (live tensors, fresh blobs)."""
        progress = state.Progress(self.step_count, self.data_cursor, self.topology.world_size,
                                  self.env.generation, self.epoch)
        return state.collect_state(self.model, self.optimizer, scheduler=self.scheduler,
                                   scaler=self.scaler, progress=progress, rank=self.topology.rank,
                                   epoch_scheduler=self.epoch_scheduler, loop=self._loop_state())

    def _snapshot(self, captured: dict[str, Any]) -> None:
        assert self.snapshotter is not None
        fields = {"job": self.env.job, "config_hash": self.config_hash, "world_size": self.topology.world_size,
                  "data_cursor": self.data_cursor, "base": self.resumed_from or ""}
        self.snapshotter.take(self.step_count, captured, fields, stable=stable_tensors(self.model, self.optimizer))

    def _save(self, captured: dict[str, Any] | None = None) -> None:
        if self.checkpointer is None:
            return
        captured = captured if captured is not None else self._capture()
        fields = {"loss": self._last_loss if math.isfinite(self._last_loss) else None,
                  "config_hash": self.config_hash, "world_size": self.topology.world_size,
                  "data_cursor": self.data_cursor, "generation": self.env.generation, "job": self.env.job,
                  "parts": state.saved_parts(set(captured)),
                  # The registry then requires the grad scaler's state in the checkpoint.
                  "amp": self.scaler is not None}
        self._last_saved_step = self.step_count
        self.checkpointer.save(self.step_count, captured, fields, stable=stable_tensors(self.model, self.optimizer))

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
        if self.loader is not None and choice.world_size not in (None, self.topology.world_size):
            self._stop(EXIT_RESUME_REFUSED, f"{choice.path} was written by {choice.world_size} ranks: a job with its "
                       f"own data loader resumes only on that many (its sampler's state is per rank); the "
                       f"default sampler continues on any world size")
        if self._resume_from_snapshot(choice):
            return
        if choice.path is None:
            log.info("no verified checkpoint to resume from: starting at step 0")
            if inprocess.current() is not None:  # the control plane still hears of the restart
                self.telemetry.event(0, "resumed", "restarted in process at step 0: nothing to restore",
                                     {"step": 0, "checkpoint": None, "world_size": self.topology.world_size,
                                      **_in_process()})
            return
        progress, parts = resume.restore(choice.path, self.topology, self.model, self.optimizer,
                                         scheduler=self.scheduler, scaler=self.scaler,
                                         epoch_scheduler=self.epoch_scheduler, loop=self._restore_loop)
        self.step_count, self.data_cursor, self.epoch = progress.step, progress.data_cursor, progress.epoch
        self._last_saved_step = progress.step
        self.resumed_from = choice.path
        self.telemetry.event(progress.step, "resumed",
                             f"resumed from step {progress.step} (checkpoint {choice.path})",
                             {"step": progress.step, "checkpoint": choice.path, "parts": parts,
                              "world_size": self.topology.world_size,
                              "previous_world_size": progress.world_size, **_in_process()})
        if progress.world_size != self.topology.world_size:
            self.telemetry.event(progress.step, "world_size_change",
                                 f"world size changed from {progress.world_size} to "
                                 f"{self.topology.world_size}; continuing at global sample {progress.data_cursor}",
                                 {"previous": progress.world_size, "current": self.topology.world_size,
                                  "data_cursor": progress.data_cursor})

    def _start_snapshots(self, run_id: str) -> Snapshotter:
        store = SnapshotStore(default_root(self.env.snapshot_dir), job_key(self.env.job, self.ckpt_dir))
        group = side_group(self.topology, _SNAPSHOT_GROUP_TIMEOUT_S)
        return Snapshotter(store, self.topology, group, generation=self.env.generation, run_id=run_id,
                           on_commit=self._snapshot_committed)

    def _resume_from_snapshot(self, choice: resume.ResumeChoice) -> bool:
        """Restore the newest snapshot every rank can, if it is newer than the disk checkpoint
        chosen and of this lineage (``snapshot.choose_snapshot``); False: the disk checkpoint stands.

        Either way the job's snapshots on this node are this run's from now on: all but the one
        restored are removed (older ones are history, newer ones a branch this run does not follow).
        """
        if self.snapshotter is None:
            return False
        store, rank = self.snapshotter.store, self.topology.rank
        branch = self.env.branch_generation
        lineage = Lineage(job=self.env.job, config_hash=self.config_hash, world_size=self.topology.world_size,
                          generation=self.env.generation,
                          min_generation=self.env.generation if branch is None else branch,
                          after_step=choice.step or 0)
        found = snapshot.choose_snapshot(store, self.topology, self.snapshotter.group, lineage)
        for path, reason in found.rejected:  # logged as each was turned down
            self.telemetry.event(0, "checkpoint_rejected", f"not restoring snapshot {path}: {reason}",
                                 {"path": path, "reason": reason}, level=None, local=True)
        store.keep_places(snapshot.node_places(self.topology), found.key)
        if found.snapshot is None or found.key is None:
            return False
        progress, parts = state.apply_state(snapshot.load(found.snapshot), self.model, self.optimizer,
                                            scheduler=self.scheduler, scaler=self.scaler, rank=rank,
                                            epoch_scheduler=self.epoch_scheduler, loop=self._restore_loop)
        self.step_count, self.data_cursor, self.epoch = progress.step, progress.data_cursor, progress.epoch
        self.resumed_from = str(found.snapshot.path)
        where = f"rank {self.topology.snapshot_partner}'s copy" if found.from_partner else "this node's memory"
        self.telemetry.event(progress.step, "resumed",
                             f"resumed from step {progress.step} (snapshot {found.key.dirname}, {where}; "
                             f"newer than the disk checkpoint {choice.path or 'none'})",
                             {"step": progress.step, "checkpoint": choice.path, "snapshot": found.key.dirname,
                              "from_partner": found.from_partner, "parts": parts,
                              "world_size": self.topology.world_size, "previous_world_size": progress.world_size,
                              **_in_process()},
                             local=found.from_partner)
        return True

    def _snapshot_committed(self, commit: SnapshotCommit) -> None:
        """From the snapshot thread: both copies are committed. Reported (from rank 0) only when the
        last report is ``SNAPSHOT_EVENT_INTERVAL_S`` old: with ``snapshot_every`` 1 a commit follows
        every step, and an event per step would flood the job's timeline and its event table for a
        fact the next commit makes stale anyway. The control plane learns the snapshots are being
        taken, how big they are and, within that interval, how far they have got."""
        self.last_snapshot = commit
        log.debug("snapshot of step %d committed on both copies (%s, %d bytes, blocked %.4f s, %.3f s in all)",
                  commit.step, commit.path, commit.size_bytes, commit.blocking_s, commit.total_s)
        now = time.monotonic()
        if self._snapshot_reported_at is not None and now - self._snapshot_reported_at < SNAPSHOT_EVENT_INTERVAL_S:
            return
        self._snapshot_reported_at = now
        self.telemetry.event(commit.step, "snapshot_committed",
                             f"snapshot of step {commit.step} committed on both copies",
                             {"step": commit.step, "generation": self.env.generation, "size_bytes": commit.size_bytes},
                             level=None)

    def _restore_loop(self, saved: dict[str, Any]) -> None:
        """Called by ``resume.restore`` before the RNG states are put back."""
        self.epoch = int(saved["epoch"])
        with torch.random.fork_rng(devices=[]):  # whatever the pipeline draws leaves no trace
            self._load_loop_state(saved)

    def _report_model(self, flops_per_token: float | None) -> None:
        """Once per process: what the control plane needs for MFU (FLOPs per token defaults to
        6 × parameters there; pass ``flops_per_token`` for a sharded or unusual model)."""
        detail: dict[str, Any] = {"parameters": self.parameter_count, "tokens_per_sample": self.tokens_per_sample}
        if flops_per_token:
            detail["flops_per_token"] = float(flops_per_token)
        self.telemetry.event(self.step_count, "model", f"model: {self.parameter_count:,} parameters, "
                             f"{self.tokens_per_sample} tokens per sample", detail, level=logging.DEBUG)

    def _committed(self, commit: Commit) -> None:
        self._committed_step = commit.step
        self.telemetry.checkpoint_committed(commit, self.config_hash)

    def _save_failed(self, path: str, step: int, error: BaseException) -> None:
        """A save failed (any exception, DCP's ``CheckpointException`` included): say why, and
        train on; the previous checkpoint stands (``Checkpointer`` removed the partial files).
        ``peer_lost``: another rank went away in the middle of the save's collectives, so the
        storage is not to blame (``lost_peer``)."""
        reason, code = describe_failure(error)
        self.telemetry.event(step, "checkpoint_failed",
                             f"checkpoint at step {step} failed: {reason}; training goes on from the previous "
                             f"checkpoint ({path})",
                             {"path": path, "reason": reason, "errno": code, "error": str(error)[:500],
                              "peer_lost": lost_peer(error)},
                             level=logging.ERROR)


def _user_loader(loader: Any, sampler: Any, dataset: Any, batch_size: int | None,
                 options: Mapping[str, Any] | None) -> Any:
    """The script's own pipeline: ``loader`` as given, or a DataLoader around its ``sampler``."""
    if loader is not None and (sampler is not None or dataset is not None):
        raise ValueError("pass either loader= or dataset= (with sampler= or the default sampler), not both")
    if sampler is not None:
        if dataset is None or batch_size is None:
            raise ValueError("sampler= needs dataset= and batch_size=")
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, **{"num_workers": 0, **(options or {})})
    if loader is None:
        return None
    # A plain DataLoader's workers prefetch: its sampler's state_dict() would run ahead of training.
    parts = pipeline_parts(loader)
    if isinstance(loader, DataLoader) and not is_stateful(loader) and parts and loader.num_workers > 0:
        raise ValueError("a DataLoader with num_workers > 0 reads its sampler ahead of training, so the "
                         "sampler's state_dict() is not the position trained: use torchdata's "
                         "StatefulDataLoader, which accounts for prefetching, or num_workers=0")
    return loader


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


def _in_process() -> dict[str, Any]:
    """The ``resumed`` event's word on an in-process restart (``inprocess``): round, when this rank
    saw the last round break, the error; nothing after a launch."""
    restart = inprocess.current()
    return {"in_process": restart.detail()} if restart is not None else {}


def _default_logging(rank: int) -> None:
    """Make the hooks' log lines visible when the training script configured no logging at all."""
    logger = logging.getLogger("nightwatch")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[nightwatch rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
