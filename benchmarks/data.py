"""dtf's Parquet reader against the floor (the same reading with nothing but pyarrow and torch),
against another checkout per rank, and, for images, against Petastorm's own reader.

    .venv/bin/python benchmarks/data.py [--data scalar_field] [--rows 200000] [--rows-per-group 1024]
                                        [--batch-size 64] [--workers N] [--repeats 7] [--epochs 3]
    .venv/bin/python benchmarks/data.py --world-size 2 --baseline DIR [--baseline-python PY] [--runs 5]
    .venv/bin/python benchmarks/data.py --images [--rows 4096] [--image-size 64] [--rows-per-group 256]
    .venv/bin/python benchmarks/data.py --s3 [--delay-ms 20] [--files 16] [--rows 1000000] [--repeats 5]

Floor (default): the data set (a built-in one, its train split repeated up to --rows rows) is
written once as plain Parquet (as `python -m dtf.data.prepare` writes it). Then, alternating so
that machine load hits all alike, each pipeline reads --epochs epochs back to back in this
process, one rank's worth (rank 0 of 1), per repeat:

- floor: one thread, no framework: each row group in a seeded random order is read with
  pyarrow, its columns become numpy arrays, its rows are permuted, and torch tensors are made of
  every --batch-size slice;
- dtf: `data=parquet`'s training data with --workers reader workers (default: auto), reading the
  next epoch ahead as the trainer asks;
- memory: the in-memory path (DataLoader + DistributedSampler) on the same rows, fetched per
  sample (torch's default) and by batch (`data.fetch`, dtf's default here).

It prints rows/s per pipeline (median over repeats) and dtf / floor (target >= 0.8).

Per rank, against another checkout (--baseline DIR, e.g. `git worktree add /tmp/old <commit>`):
reads each rank's epochs (rank r of --world-size, one rank at a time) in child processes, one per
(checkout, rank), alternating within every repeat, and prints rows/s per rank and the ratio
(target >= 1.0). A checkout that needs another environment (one that read through Petastorm needs
pyarrow < 15) runs with --baseline-python. A process keeps its speed for its life (thread
placement), which varies by a few percent between processes: --runs runs, each with fresh
processes, and the median of their ratios.

S3 (--s3): the rows (--files files of them) in a bucket of scripts/local-s3.sh's S3 server, read
through benchmarks/delay_proxy.py, which adds --delay-ms to each direction of every exchange (tc
netem's delay; this kernel has no netem). Alternating, per repeat: dtf on the local files; dtf's
first epoch from S3 into an empty data.cache_dir; its next epoch, from the cache; and the first
epoch with no cache. It prints rows/s of each and the ratios to local (targets: from the cache
>= 0.9, the first epoch >= 0.5).

Images (--images): a Petastorm dataset in the style of Petastorm's hello_world (a Unischema with a
PNG image field of --image-size^2 x 3 random uint8 pixels and an int label), written by Petastorm
through Spark in Petastorm's own environment (dtf.sideenv). dtf decodes every image (OpenCV, as
Petastorm's CompressedImageCodec) with reader_pool_type thread and process; Petastorm's own
`petastorm.pytorch.DataLoader(make_reader(...))` reads the same files in a child process of that
environment, with the same pool type and workers. Both yield torch batches of --batch-size. It
prints decoded samples/s on one rank and dtf / petastorm (target >= 1.0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from dtf.config.schema import ParquetDataConfig
from dtf.data import loader
from dtf.data.parquet import data as parquet
from dtf.data.prepare import build_splits, write_parquet
from dtf.dist.env import DistEnv

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def rate(read: Callable[[], Iterable[int]]) -> float:
    t0 = time.perf_counter()
    total = sum(read())
    return total / (time.perf_counter() - t0)


def floor_epochs(files: list[Path], first: int, epochs: int, batch_size: int) -> Iterable[int]:
    """The floor: one thread reading every row group, in a seeded order, into permuted torch batches."""
    readers = [pq.ParquetFile(f) for f in files]
    groups = [(k, g) for k, r in enumerate(readers) for g in range(r.metadata.num_row_groups)]
    for epoch in range(first, first + epochs):
        rng = np.random.default_rng(epoch)
        for i in rng.permutation(len(groups)):
            k, g = groups[i]
            table = readers[k].read_row_group(g, use_threads=False)
            columns = [_numpy(c) for c in table.columns]
            order = rng.permutation(table.num_rows)
            columns = [c[order] for c in columns]
            for s in range(0, table.num_rows - batch_size + 1, batch_size):
                batch = [torch.from_numpy(c[s : s + batch_size]) for c in columns]
                yield len(batch[-1])


def _numpy(column: Any) -> np.ndarray:
    arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if hasattr(arr, "values"):  # a list column: its values, one row per list
        return arr.values.to_numpy().reshape(len(arr), -1)
    return arr.to_numpy()


def dtf_epochs(data: Any, first: int, epochs: int) -> Iterable[int]:
    """Epochs of a dtf TrainData back to back, the next read ahead where it can be (Parquet), as the trainer asks."""
    for epoch in range(first, first + epochs):
        if isinstance(data, parquet.ParquetTrainData):
            data.set_epoch(epoch, read_ahead=epoch < first + epochs - 1)
        else:
            data.set_epoch(epoch)
        for _, labels in data:
            yield len(labels)


def write_rows(args: argparse.Namespace, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """--rows rows of --data (its training split, repeated), written as Parquet at path with
    --rows-per-group rows per row group; returns them (features, labels)."""
    x, y = build_splits(args.data)["train"]
    reps = -(-args.rows // len(x))
    x, y = np.concatenate([x] * reps)[: args.rows], np.concatenate([y] * reps)[: args.rows]
    write_parquet(x, y, path, args.rows_per_group)
    return x, y


def floor_case(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train"
        x, y = write_rows(args, path)
        files = sorted(path.glob("*.parquet"))
        cfg = ParquetDataConfig(path=str(path), batch_size=args.batch_size, workers_count=args.workers or "auto")
        dtf_data, _ = parquet.build(OmegaConf.structured(cfg), ENV, seed=0)
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
        pipelines: dict[str, Callable[[int], Iterable[int]]] = {
            "floor": lambda first: floor_epochs(files, first, args.epochs, args.batch_size),
            "dtf": lambda first: dtf_epochs(dtf_data, first, args.epochs),
            "memory per sample": lambda first: dtf_epochs(mem["per_sample"], first, args.epochs),
            "memory batched": lambda first: dtf_epochs(mem["batched"], first, args.epochs),
        }
        results: dict[str, list[float]] = {name: [] for name in pipelines}
        for i in range(args.repeats + 1):  # the first round warms caches and imports; not counted
            order = list(pipelines) if i % 2 else list(reversed(pipelines))
            for name in order:
                measured = rate(lambda name=name, i=i: pipelines[name](i * args.epochs))
                if i:
                    results[name].append(measured)
    med = {name: statistics.median(v) for name, v in results.items()}
    ratios = [d / f for d, f in zip(results["dtf"], results["floor"], strict=True)]
    print(
        f"{args.data}: {args.rows} rows of {list(x.shape[1:])}, {args.rows_per_group} rows per row group, batch "
        f"{args.batch_size}, rank 0 of 1, {args.workers or 'auto'} reader workers, {args.epochs} epochs per repeat, "
        f"median of {args.repeats} alternating repeats"
    )
    for name, value in med.items():
        print(f"  {name:<18} {value:>12,.0f} rows/s")
    print(
        f"  dtf / floor                = {statistics.median(ratios):.2f}  (median of the repeats' ratios, "
        f"{min(ratios):.2f}-{max(ratios):.2f}; target >= 0.8)"
    )
    print(f"  dtf / memory per sample    = {med['dtf'] / med['memory per sample']:.2f}")
    print(f"  dtf / memory batched       = {med['dtf'] / med['memory batched']:.2f}")


# A child process of --baseline: the training data of rank `rank` of `world` with the dtf it imports
# (PYTHONPATH). Per line "<first epoch> <epochs>" read from stdin, it reads epochs back to back as a
# training run does, the first one untimed (it warms what the pause before it cooled), and prints
# "result <rows> <seconds>" of the others. Where the checkout reads the next epoch ahead (set_epoch's
# read_ahead), it is asked to as the trainer asks: for every epoch but the last (unless read_ahead
# is 0). Else only API that all checkouts share (a checkout before data=parquet names its config
# PetastormDataConfig).
_RANK_READER = """
import inspect, logging, sys, time, warnings, torch
from omegaconf import OmegaConf
from dtf.config import schema
from dtf.data.parquet import data as parquet
from dtf.dist.env import DistEnv
logging.getLogger("petastorm").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=FutureWarning)
torch.set_num_threads(1)
path, rank, world, batch, workers, read_ahead = sys.argv[1], *map(int, sys.argv[2:7])
config = getattr(schema, "ParquetDataConfig", None) or schema.PetastormDataConfig
cfg = OmegaConf.structured(config(path=path, batch_size=batch, **({"workers_count": workers} if workers else {})))
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
    print("result", rows, time.perf_counter() - t0, flush=True)  # Petastorm prints lines of its own
"""


def _result(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """A child's next "result <rows> <seconds>" line (Petastorm prints lines of its own)."""
    assert proc.stdout is not None
    line = ""
    while not line.startswith("result "):
        line = proc.stdout.readline()
        assert line, "the child process ended (its error is above)"
    rows, seconds = line.split()[1:]
    return rows, seconds


def per_rank_run(args: argparse.Namespace, checkouts: dict[str, tuple[str, str]], path: Path) -> dict[Any, float]:
    """One run: fresh child processes, --repeats alternating repeats; rows/s per (checkout, rank), medians."""
    procs = {}
    for name, (root, python) in checkouts.items():
        env = dict(os.environ, PYTHONPATH=root)
        for rank in range(args.world_size):
            cmd = [python, "-c", _RANK_READER, str(path), str(rank), str(args.world_size)]
            cmd += [str(args.batch_size), str(args.workers or 0), str(int(not args.no_read_ahead))]
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
                rows, seconds = _result(proc)
                if i:
                    results[key].append(int(rows) / float(seconds))
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait()
    return {key: statistics.median(v) for key, v in results.items()}


def per_rank_case(args: argparse.Namespace) -> None:
    checkouts = {
        "this": (str(Path(__file__).resolve().parents[1]), sys.executable),
        "baseline": (str(Path(args.baseline).resolve()), args.baseline_python or sys.executable),
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train"
        x, _ = write_rows(args, path)
        print(
            f"{args.data}: {args.rows} rows of {list(x.shape[1:])}, {args.rows_per_group} rows per row group, "
            f"batch {args.batch_size} per rank, rank r of {args.world_size} read one at a time, "
            f"{args.workers or 'default'} reader workers, {args.epochs} epochs back to back per repeat, medians of "
            f"{args.repeats} alternating repeats, {args.runs} runs of fresh processes; this = {checkouts['this']}, "
            f"baseline = {checkouts['baseline'][0]} ({checkouts['baseline'][1]})"
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
        f"(runs {', '.join(f'{r:.3f}' for r in sorted(ratios))}; target >= 1.0)"
    )


# In Petastorm's own environment: write a hello_world-style dataset (a PNG image field and an int
# label, one row group per file) through Spark, as Petastorm's examples do.
_WRITE_PNG_DATASET = """
import sys, numpy as np
from petastorm.codecs import CompressedImageCodec, ScalarCodec
from petastorm.etl.dataset_metadata import materialize_dataset
from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
from pyspark.sql import SparkSession
from pyspark.sql.types import IntegerType
url, rows, size, rows_per_group = sys.argv[1], *map(int, sys.argv[2:5])
schema = Unischema("BenchImages", [
    UnischemaField("image", np.uint8, (size, size, 3), CompressedImageCodec("png"), False),
    UnischemaField("label", np.int32, (), ScalarCodec(IntegerType()), False),
])
rng = np.random.default_rng(0)
records = [dict_to_spark_row(schema, {"image": rng.integers(0, 255, size=(size, size, 3), dtype=np.uint8),
                                      "label": np.int32(i % 10)}) for i in range(rows)]
spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
         .config("spark.ui.enabled", "false").getOrCreate())
with materialize_dataset(spark, url, schema, row_group_size_mb=256):
    frame = spark.createDataFrame(spark.sparkContext.parallelize(records, max(1, rows // rows_per_group)),
                                  schema.as_spark_schema())
    frame.write.mode("overwrite").parquet(url)
spark.stop()
"""

# In Petastorm's own environment: per line "<first epoch> <epochs>", read that many epochs with
# petastorm.pytorch.DataLoader(make_reader(...)) and print "result <rows> <seconds>".
_PETASTORM_READER = """
import logging, sys, time, warnings
logging.getLogger("petastorm").setLevel(logging.WARNING)
warnings.filterwarnings("ignore")
url, pool, workers, batch, torch_site = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
# Petastorm's environment has no torch: the main one's, found last (this environment's numpy and pyarrow first).
sys.path.append(torch_site)
from petastorm import make_reader
from petastorm.pytorch import DataLoader
for line in sys.stdin:
    first, count = map(int, line.split())
    t0, rows = time.perf_counter(), 0
    for epoch in range(first, first + count):
        with make_reader(url, schema_fields=["image", "label"], reader_pool_type=pool, workers_count=workers,
                         num_epochs=1, shuffle_row_groups=True, seed=epoch) as reader:
            for b in DataLoader(reader, batch_size=batch):
                rows += len(b["label"])
    print("result", rows, time.perf_counter() - t0, flush=True)  # Petastorm prints lines of its own
"""


def image_case(args: argparse.Namespace) -> None:
    from dtf import sideenv

    side = str(sideenv.ensure("petastorm"))
    # Spark's Python workers run the side environment's interpreter too (they unpickle Petastorm's rows).
    env = dict(sideenv.environment(), SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=side)
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "petastorm.log", "w+") as log:
        url = (Path(tmp) / "images").as_uri()
        write = [side, "-c", _WRITE_PNG_DATASET, url, str(args.rows), str(args.image_size), str(args.rows_per_group)]
        subprocess.run(write, check=True, capture_output=True, env=env, cwd=tmp)
        dtf_data = {}
        petastorm = {}
        for pool in ("thread", "process"):
            cfg = ParquetDataConfig(
                path=url,
                feature_columns=["image"],
                batch_size=args.batch_size,
                workers_count=args.workers,
                reader_pool_type=pool,  # type: ignore[arg-type]
                shuffle_rows=False,  # as Petastorm's loader (whose make_reader would shuffle within a row group)
            )
            dtf_data[pool], _ = parquet.build(OmegaConf.structured(cfg), ENV, seed=0)
            torch_site = str(Path(torch.__file__).parent.parent)
            cmd = [side, "-c", _PETASTORM_READER, url, pool, str(args.workers), str(args.batch_size), torch_site]
            # Petastorm's deprecation warnings (hundreds a run) to a file, shown if its reader fails.
            petastorm[pool] = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=tmp, env=env
            )
        names = [f"{kind}/{pool}" for pool in ("thread", "process") for kind in ("petastorm", "dtf")]
        results: dict[str, list[float]] = {name: [] for name in names}
        try:
            for i in range(args.repeats + 1):  # the first round warms caches and imports; not counted
                for pool in ("thread", "process"):
                    first = i * args.epochs
                    proc = petastorm[pool]
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(f"{first} {args.epochs}\n")
                    proc.stdin.flush()
                    rows, seconds = _result(proc)
                    measured = {
                        f"petastorm/{pool}": int(rows) / float(seconds),
                        f"dtf/{pool}": rate(
                            lambda pool=pool, first=first: dtf_epochs(dtf_data[pool], first, args.epochs)
                        ),
                    }
                    if i:
                        for name, value in measured.items():
                            results[name].append(value)
        except AssertionError:
            log.seek(0)
            print(log.read()[-5000:], file=sys.stderr)
            raise
        finally:
            for proc in petastorm.values():
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait()
    med = {name: statistics.median(v) for name, v in results.items()}
    print(
        f"PNG images: {args.rows} rows of {args.image_size}x{args.image_size}x3 uint8, ~{args.rows_per_group} rows per "
        f"row group, batch {args.batch_size}, {args.workers} reader workers, decoded samples/s on one rank, "
        f"{args.epochs} epochs per repeat, median of {args.repeats}; Petastorm in {side}"
    )
    for name, value in med.items():
        print(f"  {name:<18} {value:>10,.0f} samples/s")
    for pool in ("thread", "process"):
        print(f"  dtf / petastorm ({pool}) = {med[f'dtf/{pool}'] / med[f'petastorm/{pool}']:.2f}  (target >= 1.0)")


ROOT = Path(__file__).resolve().parents[1]


def s3_case(args: argparse.Namespace) -> None:
    import s3fs

    with tempfile.TemporaryDirectory() as tmp:
        server_env = dict(os.environ, DTF_S3_DIR=f"{tmp}/s3")
        started = subprocess.run(
            ["bash", str(ROOT / "scripts" / "local-s3.sh"), "start"], env=server_env, capture_output=True, text=True
        )
        if started.returncode != 0:
            sys.exit(f"benchmarks/data.py: scripts/local-s3.sh start failed: {started.stderr.strip()}")
        exports = dict(line[7:].split("=", 1) for line in started.stdout.splitlines() if line.startswith("export "))
        endpoint = exports["AWS_ENDPOINT_URL"]
        delay = ["--delay-ms", str(args.delay_ms)]
        proxy = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "delay_proxy.py"), "--to", endpoint.split("//", 1)[1], *delay],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proxy.stdout is not None
            delayed = f"http://127.0.0.1:{proxy.stdout.readline().split()[1]}"
            keys = {"key": exports["AWS_ACCESS_KEY_ID"], "secret": exports["AWS_SECRET_ACCESS_KEY"]}
            _s3_rounds(args, Path(tmp), endpoint, delayed, keys, s3fs)
        finally:
            proxy.terminate()
            proxy.wait()
            subprocess.run(["bash", str(ROOT / "scripts" / "local-s3.sh"), "stop"], env=server_env, capture_output=True)


def _s3_rounds(
    args: argparse.Namespace, tmp: Path, endpoint: str, delayed: str, keys: dict[str, str], s3fs: Any
) -> None:
    x, y = build_splits(args.data)["train"]
    reps = -(-args.rows // len(x))
    x, y = np.concatenate([x] * reps)[: args.rows], np.concatenate([y] * reps)[: args.rows]
    local = tmp / "train"
    local.mkdir()
    for i in range(args.files):  # each file as prepare writes one, then gathered in one folder
        part = slice(i * len(x) // args.files, (i + 1) * len(x) // args.files)
        written = write_parquet(x[part], y[part], tmp / f"file{i}", args.rows_per_group)
        written.rename(local / f"part-{i:05d}.parquet")  # prepare returns the file it wrote
    size = sum(f.stat().st_size for f in local.iterdir())
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, **keys).put(f"{local}/", "bench/train/", recursive=True)
    options = {"client_kwargs": {"endpoint_url": delayed}, **keys}

    def build(path: str, cache: Path | None = None) -> Any:
        cfg = ParquetDataConfig(
            path=path,
            batch_size=args.batch_size,
            workers_count=args.workers or "auto",
            storage_options=options if path.startswith("s3://") else {},
            cache_dir=str(cache) if cache else None,
        )
        return parquet.build(OmegaConf.structured(cfg), ENV, seed=0)[0]

    results: dict[str, list[float]] = {"local": [], "s3, first epoch": [], "s3, from the cache": [], "s3, no cache": []}
    local_data = build(str(local))
    for i in range(args.repeats + 1):  # the first round warms imports and connections; not counted
        cached = build("s3://bench/train", tmp / f"cache{i}")
        uncached = build("s3://bench/train")
        rounds = {  # pipeline: (its data, the epoch it reads)
            "local": (local_data, i),
            "s3, first epoch": (cached, 0),
            "s3, from the cache": (cached, 1),
            "s3, no cache": (uncached, 0),
        }
        names = list(rounds)
        order = names if i % 2 else [names[3], names[0], names[1], names[2]]  # the cached epochs in their order
        for name in order:
            data, epoch = rounds[name]
            measured = rate(lambda data=data, epoch=epoch: dtf_epochs(data, epoch, 1))
            if i:
                results[name].append(measured)
    med = {name: statistics.median(v) for name, v in results.items()}
    print(
        f"{args.data}: {args.rows} rows in {args.files} files ({size / 1e6:.1f} MB), {args.rows_per_group} rows per "
        f"row group, batch {args.batch_size}, {args.workers or 'auto'} reader workers, S3 through a proxy adding "
        f"{args.delay_ms:g} ms each way, one epoch per pipeline, median of {args.repeats} alternating repeats"
    )
    for name, value in med.items():
        print(f"  {name:<20} {value:>12,.0f} rows/s   ({min(results[name]):,.0f}-{max(results[name]):,.0f})")
    for name, target in (("s3, from the cache", 0.9), ("s3, first epoch", 0.5), ("s3, no cache", None)):
        ratios = [a / b for a, b in zip(results[name], results["local"], strict=True)]
        aim = f"; target >= {target}" if target else ""
        print(
            f"  {name} / local = {statistics.median(ratios):.2f}  (median of the repeats' ratios, "
            f"{min(ratios):.2f}-{max(ratios):.2f}{aim})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="scalar_field", choices=["fake_images", "digits", "scalar_field"])
    p.add_argument("--images", action="store_true", help="the PNG image case (a Petastorm dataset)")
    p.add_argument("--image-size", type=int, default=64, help="--images: pixels per side")
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        help="default: 200000 (scalar_field), 16384, with --images 4096, with --s3 1000000",
    )
    p.add_argument("--rows-per-group", type=int, default=None, help="default: 1024, with --images 256")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--workers", type=int, default=None, help="reader workers (default: dtf's auto; with --images 2 for both)"
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--epochs", type=int, default=3, help="epochs read back to back per repeat")
    p.add_argument("--world-size", type=int, default=1, help="with --baseline: ranks whose epochs are read")
    p.add_argument("--baseline", default=None, help="another dtf checkout: rows/s per rank, this one vs it")
    p.add_argument("--baseline-python", default=None, help="with --baseline: the Python it runs with")
    p.add_argument("--no-read-ahead", action="store_true", help="with --baseline: no set_epoch(read_ahead=True)")
    p.add_argument("--runs", type=int, default=5, help="with --baseline: runs, each with fresh processes")
    p.add_argument("--s3", action="store_true", help="read from a local S3 server through a delaying proxy")
    p.add_argument("--delay-ms", type=float, default=20.0, help="with --s3: added to each direction")
    p.add_argument("--files", type=int, default=16, help="with --s3: files the rows are written in")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.images:
        args.workers = args.workers or 2  # what dtf's auto takes for PNG images: Petastorm gets as many
        args.rows = args.rows or 4096
        args.rows_per_group = args.rows_per_group or 256
        image_case(args)
        return
    args.rows = args.rows or (1_000_000 if args.s3 else 200_000 if args.data == "scalar_field" else 16_384)
    args.rows_per_group = args.rows_per_group or 1024
    if args.baseline:
        per_rank_case(args)
        return
    if args.s3:
        s3_case(args)
        return
    floor_case(args)


if __name__ == "__main__":
    main()
