"""A user's own DDP training script: a small CNN on synthetic images, with gradient accumulation,
bf16 autocast on CPU, a sharded shuffling sampler of its own and a cosine LR schedule.

plain_ddp.py is the script as its user wrote it; watched.py is the same script adapted to the
Nightwatch hooks (verified checkpoints, exact resume, guards, reporting), keeping its sampler,
its loader and its accumulation. tests/hooks/test_byo.py holds the diff between the two to at
most 15 changed lines. Run either with::

    torchrun --nproc-per-node=2 examples/byo/plain_ddp.py --epochs 3
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Sampler


class Stripes(Dataset):
    """1×8×8 images of 4 classes (a bright band of rows per class) in seeded noise."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = index % 4
        image = 0.5 * torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(index))
        image[0, 2 * label:2 * label + 2, :] += 1.0
        return image, label


class ShardedShuffleSampler(Sampler[int]):
    """Rank r reads every world_size-th sample of a seeded shuffle of each epoch, and can be resumed
    mid-epoch: ``state_dict()`` is the epoch and how many samples it handed out."""

    def __init__(self, size: int, rank: int, world_size: int, seed: int = 0):
        self.size, self.rank, self.world_size, self.seed = size, rank, world_size, seed
        self.epoch, self.yielded = 0, 0

    def __len__(self) -> int:
        return self.size // self.world_size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.yielded = epoch, 0

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        shard = order[self.rank:len(self) * self.world_size:self.world_size].tolist()
        while self.yielded < len(shard):
            self.yielded += 1
            yield shard[self.yielded - 1]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.yielded = state["epoch"], state["yielded"]


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dataset-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="where rank 0 saves the final model, optimizer and scheduler")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(SmallCNN())
    dataset = Stripes(args.dataset_size)
    sampler = ShardedShuffleSampler(len(dataset), rank, world_size, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = args.epochs * len(loader) // args.accum
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (images, labels) in enumerate(loader):
            with model.no_sync() if (i + 1) % args.accum else nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(images), labels) / args.accum
                loss.backward()
            if (i + 1) % args.accum == 0:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    if rank == 0:
        print(f"done: {steps} steps, last micro-batch loss {loss.item() * args.accum:.4f}")
        if args.out:
            torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
