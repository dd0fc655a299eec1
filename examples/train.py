"""A small transformer language model on synthetic tokens, trained with the Nightwatch hooks.

Runs unchanged as ``python -m examples.train`` (one process), under ``torchrun`` on CPU (gloo) or
on GPUs (nccl)::

    torchrun --nproc-per-node=2 -m examples.train --steps 200 --ckpt-dir /tmp/ckpt --ckpt-every 20

The hooks are the three marked lines in ``train``; everything else is an ordinary loop. The fault
flags exist so tests can break things on purpose.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from agents.hooks import GuardSettings, Hooks, inprocess


class SyntheticTokens(Dataset):
    """Sample ``i`` is an arithmetic token sequence drawn from (seed, i): deterministic, learnable,
    and it carries its own id so a test can tell exactly which samples each rank trained on."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int):
        self.size, self.seq_len, self.vocab, self.seed = size, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start, stride = torch.randint(0, self.vocab, (2,), generator=generator).tolist()
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
        return {"id": torch.tensor(index), "tokens": tokens}


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:length]
        x = self.blocks(x, mask=self.causal[:length, :length], is_causal=True)
        return self.head(self.norm(x))


class Faults:
    """Deliberate failures for the tests, keyed on the step being computed (1-based)."""

    def __init__(self, args: argparse.Namespace, rank: int):
        self.args, self.rank = args, rank
        # Neither torchrun's restart nor an in-process replacement of the rank crashes again.
        self.first_attempt = (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
                              and not os.environ.get(inprocess.ENV_REPLACEMENT))

    def maybe_slow(self, step: int) -> None:
        """A straggler: ``--slow-rank`` busy-computes ``--slow-ms`` more per step from ``--slow-from``
        on, before its backward pass (as a slower GPU would), so its peers wait in the all-reduce."""
        if self.rank == self.args.slow_rank and step >= self.args.slow_from and self.args.slow_ms > 0:
            until = time.perf_counter() + self.args.slow_ms / 1000.0
            while time.perf_counter() < until:
                pass

    def corrupt_batch(self, step: int, tokens: torch.Tensor) -> torch.Tensor:
        """Corrupted data on every rank (a bad shard upstream): from ``--corrupt-batch-at`` for
        ``--corrupt-steps`` steps, a ``--corrupt-fraction`` of each batch's tokens is replaced by random
        ones, so the model's real loss on them jumps (bench/real_traces.py records it)."""
        start = self.args.corrupt_batch_at
        if start is None or not start <= step < start + self.args.corrupt_steps:
            return tokens
        generator = torch.Generator().manual_seed(self.args.seed * 31 + step)
        noise = torch.randint(0, self.args.vocab, tokens.shape, generator=generator)
        replace = torch.rand(tokens.shape, generator=generator) < self.args.corrupt_fraction
        return torch.where(replace, noise, tokens)

    def corrupt_loss(self, step: int, loss: torch.Tensor, sample_ids: list[int]) -> torch.Tensor:
        if step == self.args.inject_nan_at and self.rank == self.args.fault_rank:
            loss = loss * math.nan
        if self.args.poison_sample is not None and self.args.poison_sample in sample_ids:
            loss = loss * math.nan  # bad data: whenever this sample is trained on, at any step
        if step == self.args.inject_grad_explosion_at:
            loss = loss * 1e6
        if self.rank == self.args.perturb_loss_rank:
            loss = loss * self.args.perturb_factor
        if self.ordered_nan(step):
            loss = loss * math.nan
        return loss

    def ordered_nan(self, step: int) -> bool:
        """A one-shot NaN ordered while the job runs (bench/chaos.py) through ``--fault-file``: the
        file holds ``{"nan_at_step": N, "rank": R}`` and fires on rank R at step N or the first step
        after it. Firing renames it to ``PATH.done``, so a resumed run does not fire it again."""
        path = self.args.fault_file
        if not path or not os.path.exists(path):
            return False
        try:
            order = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return False  # being replaced right now: look again next step
        if int(order.get("rank", 0)) != self.rank or step < int(order.get("nan_at_step", 0)):
            return False
        os.replace(path, f"{path}.done")
        return True

    def maybe_raise(self, step: int) -> None:
        if step == self.args.raise_at and self.rank == self.args.fault_rank:
            raise RuntimeError(f"injected deterministic failure at step {step}")

    def maybe_crash(self, step: int) -> None:
        # Mid-step, after backward and before the update: the nastiest place to die.
        if step == self.args.crash_at and self.rank == self.args.crash_rank and self.first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)


def train(args: argparse.Namespace) -> None:
    distributed = "WORLD_SIZE" in os.environ
    device = torch.device("cpu")
    if distributed:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        # In-process restarts (when the job asks for them) re-form the group here, round by round.
        inprocess.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0

    shape = {"vocab": args.vocab, "dim": args.dim, "layers": args.layers, "heads": args.heads,
             "seq_len": args.seq_len, "dropout": args.dropout}
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model: nn.Module = TinyLM(**shape).to(device)
    if distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    torch.manual_seed(args.seed + 1 + rank)  # dropout differs per rank (and is checkpointed per rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    dataset = SyntheticTokens(args.dataset_size, args.seq_len, args.vocab, args.seed)
    faults = Faults(args, rank)
    sample_log = _open_sample_log(args.log_samples, rank)

    config = {**shape, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
              "dataset_size": args.dataset_size}
    guards = GuardSettings(min_history=args.guard_min_history, check_every=args.check_every)
    nw = Hooks(model, optimizer, scheduler=scheduler, dataset=dataset, batch_size=args.batch_size,  # hooks 1/3
               ckpt_dir=args.ckpt_dir, checkpoint_every=args.ckpt_every, config=config, seed=args.seed,
               max_grad_norm=args.max_grad_norm, guards=guards, async_save=not args.sync_save,
               tokens_per_sample=args.seq_len, snapshot_every=args.snapshot_every)
    restored = nw.resumed_from  # named in the first sample line of the run (or round): what it resumed from
    with nw:
        for batch in nw.batches(max_steps=args.steps):  # hooks 2/3
            step = nw.step_count + 1
            started = time.monotonic()
            tokens = faults.corrupt_batch(step, batch["tokens"]).to(device)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            loss = faults.corrupt_loss(step, loss, batch["id"].tolist())
            faults.maybe_raise(step)
            faults.maybe_slow(step)
            loss.backward()
            _pad_compute(started, args.min_step_time)
            faults.maybe_crash(step)
            nw.step(loss)  # hooks 3/3
            if sample_log:
                record = {"step": step, "rank": rank, "world_size": nw.topology.world_size,
                          "attempt": nw.topology.restart_count, "round": inprocess.round_number(),
                          "ids": batch["id"].tolist()}
                if restored is not None:
                    record["restored"], restored = restored, None
                sample_log.write(json.dumps(record) + "\n")
                sample_log.flush()

    if args.final_state:
        _dump_final_state(Path(args.final_state), rank, model, optimizer, scheduler, nw.step_count)
    if distributed:
        # Every rank leaves together: a rank that tears its groups down while a peer is still
        # finishing (rank 0 commits the last checkpoint in close()) can abort in gloo's teardown.
        dist.barrier()
        dist.destroy_process_group()


def _pad_compute(started: float, min_step_time: float) -> None:
    remaining = min_step_time - (time.monotonic() - started)
    if remaining > 0:
        time.sleep(remaining)


def _open_sample_log(directory: str | None, rank: int):
    if not directory:
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    return open(Path(directory) / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - lives for the run


def _dump_final_state(directory: Path, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: object, step: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    bare = model.module if isinstance(model, DistributedDataParallel) else model
    torch.save({"step": step, "model": bare.state_dict(), "optim": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, directory / f"rank{rank}.pt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--steps", type=int, default=100, help="train until this many optimizer steps are done")
    add("--ckpt-dir", help="checkpoint directory (NIGHTWATCH_CKPT_DIR wins when set)")
    add("--ckpt-every", type=int, default=20, help="checkpoint every N steps (0: only at the end)")
    add("--sync-save", action="store_true", help="synchronous checkpoints instead of async_save")
    add("--snapshot-every", type=int, help="in-memory snapshot (copied to a partner rank) every N steps; "
        "0: off (NIGHTWATCH_SNAPSHOT_EVERY wins)")
    add("--batch-size", type=int, default=4, help="samples per rank per step")
    add("--dataset-size", type=int, default=512)
    add("--seq-len", type=int, default=32)
    add("--vocab", type=int, default=64)
    add("--dim", type=int, default=32)
    add("--layers", type=int, default=2)
    add("--heads", type=int, default=2)
    add("--dropout", type=float, default=0.1)
    add("--lr", type=float, default=3e-3)
    add("--warmup", type=int, default=10)
    add("--seed", type=int, default=0)
    add("--max-grad-norm", type=float, default=1.0)
    add("--guard-min-history", type=int, default=10, help="steps before the grad-norm median rule applies")
    add("--check-every", type=int, default=10, help="steps between cross-rank consistency checks")
    add("--min-step-time", type=float, default=0.0,
        help="pad each step's compute to this many seconds, as if the model were bigger (demo, tests)")
    add("--log-samples", help="directory for per-rank JSON lines of the sample ids trained at each step")
    add("--final-state", help="directory where each rank saves its final model/optimizer state")
    faults = parser.add_argument_group("fault injection (for tests)")
    faults.add_argument("--inject-nan-at", type=int, help="make the loss NaN at this step on --fault-rank")
    faults.add_argument("--fault-rank", type=int, default=0)
    faults.add_argument("--poison-sample", type=int, help="the loss is NaN whenever this sample id is trained on")
    faults.add_argument("--inject-grad-explosion-at", type=int, help="scale the loss by 1e6 at this step")
    faults.add_argument("--corrupt-batch-at", type=int, help="corrupt every rank's batch from this step on")
    faults.add_argument("--corrupt-steps", type=int, default=1, help="for this many steps")
    faults.add_argument("--corrupt-fraction", type=float, default=0.5, help="the part of the tokens replaced")
    faults.add_argument("--perturb-loss-rank", type=int, help="this rank's loss is scaled by --perturb-factor")
    faults.add_argument("--perturb-factor", type=float, default=3.0)
    faults.add_argument("--slow-rank", type=int, help="this rank computes --slow-ms longer every step (a straggler)")
    faults.add_argument("--slow-ms", type=float, default=0.0)
    faults.add_argument("--slow-from", type=int, default=1, help="the first step the straggler is slow")
    faults.add_argument("--crash-at", type=int, help="SIGKILL --crash-rank mid-step (first attempt only)")
    faults.add_argument("--crash-rank", type=int, default=1)
    faults.add_argument("--fault-file", help="a one-shot fault ordered at run time: {\"nan_at_step\": N, \"rank\": R}")
    faults.add_argument("--raise-at", type=int, help="raise the same exception at this step on --fault-rank, "
                                                      "on every attempt (a deterministic bug)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    inprocess.run(train, parse_args())  # train(args), again after a peer's in-process restart
