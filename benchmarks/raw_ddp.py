"""The hand-written PyTorch DDP loop a user would otherwise write (Horovod's 8 steps, minus
checkpointing): the baseline of benchmarks/overhead.py. Run it under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/raw_ddp.py --out /tmp/raw.json

It trains the same model on the same data with the same seed, batch size and LR as dtf's
default run, and times every optimizer step the way dtf does (wall time between step ends).

With --floor it is the compute floor instead: the same work with nothing but torch, each batch
cut out of the tensors with one indexing op per tensor (the DistributedSampler's own indices, so
the very same batches), no DataLoader.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dtf.data.datasets import scalar_field
from dtf.models.approximator import Approximator


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    p.add_argument("--out", required=True)
    p.add_argument("--floor", action="store_true", help="batches by indexing the tensors: no DataLoader")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu, or cuda (one GPU per rank, NCCL)")
    args = p.parse_args()

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DDP(Approximator().to(device), device_ids=[device.index] if cuda else None)
    train, test = scalar_field()
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)  # linear LR scaling
    loss_fn = torch.nn.MSELoss()
    times: list[float] = []
    train_seconds = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, dtype=torch.float64, device=device)
        t_epoch = t_last = time.perf_counter()
        for x, y in floor_batches(train, sampler, args.batch_size) if args.floor else loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # as a user's loop does
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64, device=device)
            now = time.perf_counter()
            times.append(now - t_last)
            t_last = now
        train_seconds += t_last - t_epoch
        dist.all_reduce(total)
        with torch.no_grad():  # every rank evaluates the whole test set: simple, and what many loops do
            x, y = (t.to(device) for t in test[:])
            test_loss = loss_fn(model.module(x), y).item()
        if rank == 0:
            print(
                f"epoch {epoch + 1}: train loss {total[0].item() / total[1].item():.6g} test loss {test_loss:.6g}",
                flush=True,
            )
    if rank == 0:
        result = {
            "step_time_s": statistics.median(times[args.skip :]),
            "final_train_loss": (total[0] / total[1]).item(),
            "final_test_loss": test_loss,
            "train_seconds": train_seconds,
            "num_steps": len(times),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    # Every rank done before any tears down: gloo aborts a rank ("terminate called without an
    # active exception") whose peer destroys the group while its own last collective is in flight.
    dist.barrier()
    dist.destroy_process_group()


def floor_batches(data: TensorDataset, sampler: DistributedSampler, batch_size: int) -> Iterator[list[torch.Tensor]]:
    """The sampler's batches, each tensor indexed once per batch (what the DataLoader's batches hold)."""
    indices = torch.as_tensor(list(sampler), dtype=torch.long)
    for first in range(0, len(indices), batch_size):
        rows = indices[first : first + batch_size]
        yield [t[rows] for t in data.tensors]


if __name__ == "__main__":
    main()
