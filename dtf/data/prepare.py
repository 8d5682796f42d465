"""Write dtf's built-in data sets to disk, so every recipe can also run on Parquet (`data=parquet`).

    python -m dtf.data.prepare scalar_field digits fake_images --out data [--format both] [--rows-per-group 512]

For each data set, its train and test splits exactly as the in-memory path builds them
(from conf/data/<name>.yaml and its seed) are written with two columns, `features`
and `label`:

- parquet:   <out>/<name>/parquet/{train,test}/part-00000.parquet, plain Parquet written by
             pyarrow; array columns are list<float> with their per-row shape in the file's
             metadata.
- petastorm: <out>/<name>/petastorm/{train,test}, a Petastorm dataset with a Unischema (arrays
             NdarrayCodec-encoded), written through Spark and materialize_dataset by Petastorm
             itself, in the environment of its own that `python -m dtf.sideenv petastorm` makes
             (dtf/data/petastorm_writer.py runs there).

Row groups hold --rows-per-group rows (Spark splits the rows evenly over its files, so
there a row group holds about that many).
"""

from __future__ import annotations

import argparse
import errno
import importlib.resources
import json
import math
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset, TensorDataset

from dtf import sideenv
from dtf.data.loader import split_datasets
from dtf.data.parquet.source import SHAPES_KEY
from dtf.errors import UserError

# The config tree: conf/ of a checkout, or dtf/conf/ of an installed wheel (the package dtf.conf).
CONF_DATA = Path(str(importlib.resources.files("dtf.conf"))) / "data"
FORMATS = ("parquet", "petastorm")


def builtin_names() -> list[str]:
    """The data options whose YAML builds a dataset object (those a Parquet copy can be made of)."""
    return sorted(p.stem for p in CONF_DATA.glob("*.yaml") if "dataset" in OmegaConf.load(p))


def build_splits(name: str, overrides: Sequence[str] = ()) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{'train': (features, labels), 'test': ...} of a built-in data set, as the in-memory path builds it."""
    node = OmegaConf.load(CONF_DATA / f"{name}.yaml").dataset
    for override in overrides:
        key = override.split("=", 1)[0]
        if key not in node:
            known = ", ".join(k for k in map(str, node) if k != "_target_")
            raise UserError(f"--set {override}: {key} is not a parameter of the {name} data set (it has: {known})")
    node = OmegaConf.merge(node, OmegaConf.from_dotlist(list(overrides)))
    train, test = split_datasets(node)
    splits = {"train": _arrays(train)}
    if test is not None:
        splits["test"] = _arrays(test)
    return splits


def _arrays(ds: Dataset) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(ds, TensorDataset) and len(ds.tensors) == 2:
        x, y = ds.tensors
    else:
        items = [ds[i] for i in range(len(ds))]  # type: ignore[arg-type]
        x, y = torch.stack([torch.as_tensor(a) for a, _ in items]), torch.stack([torch.as_tensor(b) for _, b in items])
    return x.numpy(), y.numpy()


def write_parquet(features: np.ndarray, labels: np.ndarray, directory: Path, rows_per_group: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"features": features, "label": labels}
    arrays, shapes = {}, {}
    for name, values in columns.items():
        if values.ndim == 1:
            arrays[name] = pa.array(values)
            continue
        # Parquet holds flat lists; the per-row shape (e.g. 1x28x28) travels in the file's metadata.
        width = math.prod(values.shape[1:])
        offsets = pa.array(np.arange(len(values) + 1, dtype=np.int32) * width)
        arrays[name] = pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1)))
        shapes[name] = list(values.shape[1:])
    table = pa.table(arrays).replace_schema_metadata({SHAPES_KEY: json.dumps(shapes).encode()})
    # Written beside the directory first, and swapped in once whole: a write that fails (a full disk)
    # leaves what the directory held before as it was.
    partial = directory.with_name(f".{directory.name}.partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        pq.write_table(table, partial / "part-00000.parquet", row_group_size=rows_per_group)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if directory.exists():
        shutil.rmtree(directory)
    partial.rename(directory)
    return directory / "part-00000.parquet"


WRITER = Path(__file__).with_name("petastorm_writer.py")


def petastorm_python() -> Path:
    """The petastorm side environment's python; one line saying how to make it if it is not there."""
    from dtf.machine import require_java

    require_java("--format petastorm (written with Spark)")
    python = sideenv.find("petastorm")
    if python is None:
        raise UserError(
            "--format petastorm writes with Petastorm, which needs an environment of its own (pyarrow 14, "
            f"numpy 1.x; not made yet at {sideenv.default_dir('petastorm')}): make it once with "
            "`python -m dtf.sideenv petastorm`, then run this again"
        )
    return python


def write_with_petastorm(python: Path, jobs: list[dict[str, Any]], spark_master: str, scratch: Path) -> None:
    """Each job's arrays (an .npz) written as a Petastorm dataset by petastorm_writer.py in the side
    environment, all in one Spark session."""
    manifest = scratch / "jobs.json"
    manifest.write_text(json.dumps({"spark_master": spark_master, "datasets": jobs}))
    proc = subprocess.run(
        [str(python), str(WRITER), str(manifest)], capture_output=True, text=True, env=sideenv.environment()
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise WriterFailed(f"the Petastorm writer ({python} {WRITER}) failed (exit status {proc.returncode}):\n{tail}")


class WriterFailed(RuntimeError):
    """Petastorm or Spark failed in the side environment (not the user's input: exit status 1)."""


def experiment_for(dataset: str) -> str | None:
    """The built-in experiment that trains on this data set (its model fits the data's shape), if any."""
    from omegaconf import OmegaConf

    for path in sorted((CONF_DATA.parent / "experiment").glob("*.yaml")):
        defaults = OmegaConf.to_container(OmegaConf.load(path)).get("defaults", [])  # type: ignore[union-attr]
        if any(isinstance(d, dict) and d.get("override /data") == dataset for d in defaults):
            return path.stem
    return None


def main(argv: Sequence[str] | None = None) -> int:
    names = builtin_names()
    parser = argparse.ArgumentParser(prog="python -m dtf.data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("datasets", nargs="+", choices=names, metavar="DATASET", help=f"one or more of {names}")
    parser.add_argument("--out", type=Path, default=Path("data"), help="output directory (default: data)")
    parser.add_argument("--format", choices=(*FORMATS, "both"), default="parquet", help="default: parquet")
    parser.add_argument("--rows-per-group", type=int, default=1024, help="rows per Parquet row group (default: 1024)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a parameter of the data set's builder, e.g. --set num_points=2000",
    )
    parser.add_argument("--spark-master", default="local[2]", help="Spark master for --format petastorm")
    args = parser.parse_args(argv)
    if args.rows_per_group < 1:
        parser.error("--rows-per-group must be 1 or more")
    formats = FORMATS if args.format == "both" else (args.format,)
    try:
        python = petastorm_python() if "petastorm" in formats else None
        with tempfile.TemporaryDirectory(prefix="dtf-prepare-") as scratch:
            jobs: list[dict[str, Any]] = []  # the Petastorm ones: written together, in one Spark session
            written: list[str] = []
            for name in args.datasets:
                for split, (x, y) in build_splits(name, args.set).items():
                    for fmt in formats:
                        directory = args.out / name / fmt / split
                        line = f"{directory}: {len(x)} rows, features {list(x.shape[1:])} {x.dtype}, label {y.dtype}"
                        if fmt == "parquet":
                            write_parquet(x, y, directory, args.rows_per_group)
                            print(line)
                            continue
                        arrays = Path(scratch) / f"{len(jobs)}.npz"
                        np.savez(arrays, features=x, label=y)
                        where = {"arrays": str(arrays), "directory": str(directory.resolve())}
                        jobs.append({**where, "name": name, "rows_per_group": args.rows_per_group})
                        written.append(line)
            if jobs:
                assert python is not None
                write_with_petastorm(python, jobs, args.spark_master, Path(scratch))
                print(*written, sep="\n")
    except UserError as e:
        print(f"dtf: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output folder: a full disk, no permission, ...
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            why = f"no space left on the device of {args.out}"
            fix = "free space there, or give --out a folder on a larger disk"
        else:
            why = f"{e.strerror or e} ({e.filename or args.out})"
            fix = "give --out a folder you can write"
        print(f"dtf: error: --out {args.out}: {why}; nothing is left half written: {fix}", file=sys.stderr)
        return 2
    except WriterFailed as e:
        print(f"dtf: error: {e}", file=sys.stderr)
        return 1
    for name in args.datasets:
        experiment = experiment_for(name)
        for fmt in formats:
            base = args.out / name / fmt
            print(
                f"train on it: python -m dtf {f'+experiment={experiment} ' if experiment else ''}"
                f"data=parquet data.path={base / 'train'} data.test_path={base / 'test'}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
