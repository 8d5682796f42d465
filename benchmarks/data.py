"""dtf's Petastorm pipeline against Petastorm's own readers and the in-memory DataLoader, in one run.

    .venv/bin/python benchmarks/data.py [--data fake_images] [--rows 16384] [--rows-per-group 1024]
                                        [--batch-size 64] [--workers 2] [--repeats 5]
    .venv/bin/python benchmarks/data.py --images [--rows 4096] [--image-size 64] [--rows-per-group 256] ...

Columns (default): the data set (a built-in one, its train split repeated up to --rows rows) is
written once as plain Parquet (as `python -m dtf.data.prepare` writes it). Then, alternating so
that machine load hits all alike, each pipeline reads one full epoch in this process:

- petastorm: iterating `make_batch_reader` directly (one numpy batch per row group), with
  its row-group and in-row-group shuffling on, as dtf's;
- dtf: `data=petastorm`'s training data (planned shares, rows reordered, torch batches of
  --batch-size) on rank 0 of 1;
- memory: the in-memory path (`data=<name>`: DataLoader + DistributedSampler) on the same rows,
  fetched per sample (torch's default) and by batch (`data.fetch`, dtf's default here).

It prints rows/s per pipeline (median over repeats) and the ratios; target: dtf >= 0.95 x petastorm.

Per rank, against another checkout (--baseline DIR, e.g. `git worktree add /tmp/old <commit>`):

    .venv/bin/python benchmarks/data.py --world-size 2 --baseline /tmp/old [--rows ...]

reads each rank's epochs of `data=petastorm` (rank r of --world-size, one rank at a time) in child
processes, one per (checkout, rank), alternating between this checkout and the baseline within
every repeat, and prints rows/s per rank (median over repeats) and the ratio. A repeat times
--epochs epochs read back to back, as training reads them, after one untimed epoch. A process
keeps its speed for its life (thread placement), which varies by a few percent between processes:
--runs runs, each with fresh processes, and the median of their ratios.

Images (--images): a Petastorm dataset in the style of Petastorm's hello_world (a Unischema with a
PNG image field of --image-size^2 x 3 random uint8 pixels and an int label, written by Spark through
materialize_dataset). Every pipeline decodes every image (Petastorm's CompressedImageCodec, OpenCV)
and yields torch batches of --batch-size; each is read with reader_pool_type thread and process:

- petastorm: `petastorm.pytorch.DataLoader(make_reader(...))`, row groups shuffled;
- dtf: `data=petastorm`'s training data on rank 0 of 1 (one rank's decoded samples/s).
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
from dtf.data import loader
from dtf.data.parquet import data as parquet
from dtf.data.parquet.source import quiet_petastorm, to_url
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


def write_png_dataset(directory: Path, rows: int, size: int, rows_per_group: int) -> str:
    """A hello_world-style Petastorm dataset: a PNG image field and an int label, one row group per file."""
    from petastorm.codecs import CompressedImageCodec, ScalarCodec
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
    from pyspark.sql.types import IntegerType

    from dtf.data.prepare import spark_session

    schema = Unischema(
        "BenchImages",
        [
            UnischemaField("image", np.uint8, (size, size, 3), CompressedImageCodec("png"), False),
            UnischemaField("label", np.int32, (), ScalarCodec(IntegerType()), False),
        ],
    )
    rng = np.random.default_rng(0)
    url = directory.resolve().as_uri()
    records = [
        dict_to_spark_row(
            schema,
            {"image": rng.integers(0, 255, size=(size, size, 3), dtype=np.uint8), "label": np.int32(i % 10)},
        )
        for i in range(rows)
    ]
    spark = spark_session("local[2]")
    try:
        with materialize_dataset(spark, url, schema, row_group_size_mb=256):
            num_files = max(1, rows // rows_per_group)
            frame = spark.createDataFrame(spark.sparkContext.parallelize(records, num_files), schema.as_spark_schema())
            frame.write.mode("overwrite").parquet(url)
    finally:
        spark.stop()
    return url


def petastorm_loader_epoch(url: str, pool: str, workers: int, batch_size: int) -> Iterable[int]:
    from petastorm import make_reader
    from petastorm.pytorch import DataLoader

    with make_reader(
        url,
        schema_fields=["image", "label"],
        reader_pool_type=pool,
        workers_count=workers,
        num_epochs=1,
        shuffle_row_groups=True,
        seed=0,
    ) as reader:
        for batch in DataLoader(reader, batch_size=batch_size):
            yield len(batch["label"])


def image_case(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        url = write_png_dataset(Path(tmp) / "images", args.rows, args.image_size, args.rows_per_group)
        dtf_data = {}
        for pool in ("thread", "process"):
            cfg = OmegaConf.structured(
                PetastormDataConfig(
                    path=url,
                    feature_columns=["image"],
                    batch_size=args.batch_size,
                    workers_count=args.workers,
                    reader_pool_type=pool,  # type: ignore[arg-type]
                    shuffle_rows=False,  # as Petastorm's loader (whose make_reader would shuffle within a row group)
                )
            )
            dtf_data[pool], _ = parquet.build(cfg, ENV, seed=0)
        names = [f"{kind}/{pool}" for pool in ("thread", "process") for kind in ("petastorm", "dtf")]
        results: dict[str, list[float]] = {name: [] for name in names}
        for i in range(args.repeats + 1):  # the first round warms caches and imports; not counted
            for pool in ("thread", "process"):
                rates = {
                    f"petastorm/{pool}": rows_per_sec(
                        lambda pool=pool: petastorm_loader_epoch(url, pool, args.workers, args.batch_size)
                    ),
                    f"dtf/{pool}": rows_per_sec(lambda pool=pool, i=i: dtf_epoch(dtf_data[pool], i)),
                }
                if i:
                    for name, rate in rates.items():
                        results[name].append(rate)
    med = {name: statistics.median(v) for name, v in results.items()}
    print(
        f"PNG images: {args.rows} rows of {args.image_size}x{args.image_size}x3 uint8, ~{args.rows_per_group} rows per "
        f"row group, batch {args.batch_size}, {args.workers} reader workers, decoded samples/s on one rank, "
        f"median of {args.repeats}"
    )
    for name, rate in med.items():
        print(f"  {name:<18} {rate:>10,.0f} samples/s")
    for pool in ("thread", "process"):
        print(f"  dtf / petastorm ({pool}) = {med[f'dtf/{pool}'] / med[f'petastorm/{pool}']:.2f}")


# A child process of --baseline: the training data of rank `rank` of `world` with the dtf it imports
# (PYTHONPATH). Per line "<first epoch> <epochs>" read from stdin, it reads epochs back to back as a
# training run does, the first one untimed (it warms what the pause before it cooled), and prints
# "<rows> <seconds>" of the others. Where the checkout reads the next epoch ahead (set_epoch's
# read_ahead), it is asked to as the trainer asks: for every epoch but the last (unless read_ahead
# is 0). Else only API that all checkouts share.
_RANK_READER = """
import inspect, sys, time, torch
from omegaconf import OmegaConf
from dtf.config.schema import PetastormDataConfig
from dtf.data.parquet import data as parquet
from dtf.data.parquet.source import quiet_petastorm
from dtf.dist.env import DistEnv
quiet_petastorm()
torch.set_num_threads(1)
path, rank, world, batch, workers, read_ahead = sys.argv[1], *map(int, sys.argv[2:7])
cfg = OmegaConf.structured(PetastormDataConfig(path=path, batch_size=batch, workers_count=workers))
data, _ = parquet.build(cfg, DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu")), seed=0)
read_ahead = read_ahead and "read_ahead" in inspect.signature(data.set_epoch).parameters
for line in sys.stdin:
    first, count = map(int, line.split())
    rows = 0
    for epoch in range(first, first + count + 1):
        if epoch == first + 1:
            t0, rows = time.perf_counter(), 0
        last = epoch == first + count
        data.set_epoch(epoch, **({"read_ahead": not last} if read_ahead else {}))
        rows += sum(len(labels) for _, labels in data)
    print(rows, time.perf_counter() - t0, flush=True)
"""


def write_rows(args: argparse.Namespace, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """--rows rows of --data (its training split, repeated), written as Parquet at path with
    --rows-per-group rows per row group; returns them (features, labels)."""
    x, y = build_splits(args.data)["train"]
    reps = -(-args.rows // len(x))
    x, y = np.concatenate([x] * reps)[: args.rows], np.concatenate([y] * reps)[: args.rows]
    write_parquet(x, y, path, args.rows_per_group)
    return x, y


def per_rank_run(args: argparse.Namespace, checkouts: dict[str, str], path: Path) -> dict[tuple[str, int], float]:
    """One run: fresh child processes, --repeats alternating repeats; rows/s per (checkout, rank), medians."""
    import os
    import subprocess
    import sys

    procs = {}
    for name, root in checkouts.items():
        env = dict(os.environ, PYTHONPATH=root)
        for rank in range(args.world_size):
            cmd = [sys.executable, "-c", _RANK_READER, str(path), str(rank), str(args.world_size)]
            cmd += [str(args.batch_size), str(args.workers), str(int(not args.no_read_ahead))]
            # cwd: not a checkout, whose dtf would come before PYTHONPATH's
            procs[(name, rank)] = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=path.parent
            )
    results: dict[tuple[str, int], list[float]] = {key: [] for key in procs}
    try:
        for i in range(args.repeats + 1):  # the first round warms caches and imports; not counted
            order = list(procs) if i % 2 else list(reversed(procs))
            for key in order:
                proc = procs[key]
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(f"{i * (args.epochs + 1)} {args.epochs}\n")
                proc.stdin.flush()
                rows, seconds = proc.stdout.readline().split()
                if i:
                    results[key].append(int(rows) / float(seconds))
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait()
    return {key: statistics.median(v) for key, v in results.items()}


def per_rank_case(args: argparse.Namespace) -> None:
    checkouts = {"this": str(Path(__file__).resolve().parents[1]), "baseline": str(Path(args.baseline).resolve())}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train"
        x, _ = write_rows(args, path)
        print(
            f"{args.data}: {args.rows} rows of {list(x.shape[1:])}, {args.rows_per_group} rows per row group, "
            f"batch {args.batch_size} per rank, rank r of {args.world_size} read one at a time, {args.workers} "
            f"reader workers, {args.epochs} epochs back to back per repeat, medians of {args.repeats} alternating "
            f"repeats, {args.runs} runs of fresh processes; this = {checkouts['this']}, "
            f"baseline = {checkouts['baseline']}"
        )
        ratios = []
        for run in range(args.runs):
            med = per_rank_run(args, checkouts, path)
            ranks = ", ".join(
                f"rank {r} {med[('this', r)]:,.0f} vs {med[('baseline', r)]:,.0f}" for r in range(args.world_size)
            )
            mean = {name: statistics.mean(med[(name, r)] for r in range(args.world_size)) for name in checkouts}
            ratios.append(mean["this"] / mean["baseline"])
            print(f"  run {run + 1}: rows/s this vs baseline: {ranks}; this / baseline = {ratios[-1]:.3f}")
    print(
        f"  this / baseline, rows/s per rank: median of runs {statistics.median(ratios):.3f} "
        f"(runs {', '.join(f'{r:.3f}' for r in sorted(ratios))}; target >= 0.95)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="fake_images", choices=["fake_images", "digits", "scalar_field"])
    p.add_argument("--images", action="store_true", help="the PNG image case (a Petastorm dataset)")
    p.add_argument("--image-size", type=int, default=64, help="--images: pixels per side")
    p.add_argument("--rows", type=int, default=None, help="default: 16384, with --images 4096")
    p.add_argument("--rows-per-group", type=int, default=None, help="default: 1024, with --images 256")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="Petastorm reader workers (both pipelines)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world-size", type=int, default=1, help="with --baseline: ranks whose epochs are read")
    p.add_argument("--baseline", default=None, help="another dtf checkout: rows/s per rank, this one vs it")
    p.add_argument("--epochs", type=int, default=3, help="with --baseline: epochs read back to back per repeat")
    p.add_argument("--no-read-ahead", action="store_true", help="with --baseline: no set_epoch(read_ahead=True)")
    p.add_argument("--runs", type=int, default=5, help="with --baseline: runs, each with fresh processes")
    args = p.parse_args()
    quiet_petastorm()
    torch.set_num_threads(1)
    if args.images:
        args.rows = args.rows or 4096
        args.rows_per_group = args.rows_per_group or 256
        image_case(args)
        return
    args.rows = args.rows or 16384
    args.rows_per_group = args.rows_per_group or 1024
    if args.baseline:
        per_rank_case(args)
        return

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train"
        x, y = write_rows(args, path)
        url = to_url(str(path))
        cfg = OmegaConf.structured(
            PetastormDataConfig(path=str(path), batch_size=args.batch_size, workers_count=args.workers)
        )
        dtf_data, _ = parquet.build(cfg, ENV, seed=0)
        # The in-memory path's training data over the very same rows, fetched as data.fetch says:
        # per sample (torch's default) and by batch (dtf's default for a TensorDataset).
        rows = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        mem = {}
        for fetch in ("per_sample", "batched"):
            mem_cfg = OmegaConf.create(
                {"batch_size": args.batch_size, "eval_batch_size": None, "shuffle": True, "drop_last": True}
                | {"num_workers": 0, "pin_memory": False, "fetch": fetch}
            )
            mem[fetch], _ = loader.from_datasets(rows, None, mem_cfg, ENV, seed=0)
        results: dict[str, list[float]] = {"petastorm": [], "dtf": [], "memory per sample": [], "memory batched": []}
        for i in range(args.repeats + 1):  # the first round warms caches and imports; not counted
            rates = {
                "petastorm": rows_per_sec(lambda: petastorm_epoch(url, args.workers)),
                "dtf": rows_per_sec(lambda i=i: dtf_epoch(dtf_data, i)),
                "memory per sample": rows_per_sec(lambda i=i: dtf_epoch(mem["per_sample"], i)),
                "memory batched": rows_per_sec(lambda i=i: dtf_epoch(mem["batched"], i)),
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
        print(f"  {name:<18} {rate:>12,.0f} rows/s")
    print(f"  dtf / petastorm            = {med['dtf'] / med['petastorm']:.2f}  (target >= 0.95)")
    print(f"  dtf / memory per sample    = {med['dtf'] / med['memory per sample']:.2f}")
    print(f"  dtf / memory batched       = {med['dtf'] / med['memory batched']:.2f}")


if __name__ == "__main__":
    main()
