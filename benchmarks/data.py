"""dtf's Petastorm pipeline against Petastorm's own reader and against the in-memory DataLoader, in one run.

    .venv/bin/python benchmarks/data.py [--data fake_images] [--rows 16384] [--rows-per-group 1024]
                                        [--batch-size 64] [--workers 2] [--repeats 5]

The data set (a built-in one, its train split repeated up to --rows rows) is written once as
plain Parquet (as `python -m dtf.data.prepare` writes it). Then, alternating so that machine
load hits all alike, each pipeline reads one full epoch in this process:

- petastorm: iterating `make_batch_reader` directly (one numpy batch per row group), with
  its row-group and in-row-group shuffling on, as dtf's;
- dtf: `data=petastorm`'s training data (planned shares, rows reordered, torch batches of
  --batch-size) on rank 0 of 1;
- memory: the in-memory path (`data=<name>`: DataLoader + DistributedSampler) on the same rows.

It prints rows/s per pipeline (median over repeats) and the ratios; target: dtf >= 0.95 x petastorm.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from dtf.config.schema import PetastormDataConfig
from dtf.data import loader, parquet
from dtf.data.parquet_source import quiet_petastorm, to_url
from dtf.data.prepare import build_splits, write_parquet
from dtf.dist.env import DistEnv

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def rows_per_sec(rows: Callable[[], Iterable[int]]) -> float:
    t0 = time.perf_counter()
    total = sum(rows())
    return total / (time.perf_counter() - t0)


def petastorm_epoch(url: str, workers: int) -> Iterable[int]:
    from petastorm import make_batch_reader

    with make_batch_reader(
        url, num_epochs=1, workers_count=workers, shuffle_row_groups=True, shuffle_rows=True, seed=0
    ) as reader:
        for batch in reader:
            yield len(batch.label)


def dtf_epoch(data: Any, epoch: int) -> Iterable[int]:
    """Rows per batch of one epoch of a dtf TrainData (the Parquet one or the in-memory one)."""
    data.set_epoch(epoch)
    for _, labels in data:
        yield len(labels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="fake_images", choices=["fake_images", "digits", "scalar_field"])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--rows-per-group", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="Petastorm reader workers (both pipelines)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    quiet_petastorm()
    torch.set_num_threads(1)

    x, y = build_splits(args.data)["train"]
    reps = -(-args.rows // len(x))
    x, y = np.concatenate([x] * reps)[: args.rows], np.concatenate([y] * reps)[: args.rows]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train"
        write_parquet(x, y, path, args.rows_per_group)
        url = to_url(str(path))
        cfg = OmegaConf.structured(
            PetastormDataConfig(path=str(path), batch_size=args.batch_size, workers_count=args.workers)
        )
        dtf_data, _ = parquet.build(cfg, ENV, seed=0)
        mem_cfg = OmegaConf.create(
            {"batch_size": args.batch_size, "eval_batch_size": None, "shuffle": True, "drop_last": True}
            | {"num_workers": 0, "pin_memory": False}
        )
        # The in-memory path's training data over the very same rows.
        rows = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        mem_data, _ = loader.from_datasets(rows, None, mem_cfg, ENV, seed=0)
        results: dict[str, list[float]] = {"petastorm": [], "dtf": [], "memory": []}
        for i in range(args.repeats + 1):  # the first round warms caches and imports; not counted
            rates = {
                "petastorm": rows_per_sec(lambda: petastorm_epoch(url, args.workers)),
                "dtf": rows_per_sec(lambda i=i: dtf_epoch(dtf_data, i)),
                "memory": rows_per_sec(lambda i=i: dtf_epoch(mem_data, i)),
            }
            if i:
                for name, rate in rates.items():
                    results[name].append(rate)
    med = {name: statistics.median(v) for name, v in results.items()}
    print(
        f"{args.data}: {args.rows} rows of {list(x.shape[1:])}, {args.rows_per_group} rows per row group, "
        f"batch {args.batch_size}, {args.workers} reader workers, median of {args.repeats}"
    )
    for name, rate in med.items():
        print(f"  {name:<10} {rate:>12,.0f} rows/s")
    print(f"  dtf / petastorm = {med['dtf'] / med['petastorm']:.2f}  (target >= 0.95)")
    print(f"  dtf / memory    = {med['dtf'] / med['memory']:.2f}")


if __name__ == "__main__":
    main()
