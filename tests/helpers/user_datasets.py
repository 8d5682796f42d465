"""Data sets as users already have them, written the way their tools write them (never by dtf):

- hello_world: a Petastorm dataset in the style of Petastorm's examples/hello_world (a Unischema
  with a PNG image field, an NdarrayCodec array with None dimensions and scalar fields, written
  by Spark through materialize_dataset, dict_to_spark_row and coalesce(k).write.parquet);
- hive: a Spark DataFrame with a VectorAssembler column (dense and sparse vectors) and a
  StandardScaler column, written with partitionBy("split", "bucket") (root/split=train/bucket=0,
  ..., and a _SUCCESS file);
- pandas: files of uneven sizes written by pandas.to_parquet, one of them empty (and first in
  sort order), whose integer and float columns differ in width from file to file;
- field: a regression (features x in [-3, 3]^2, label sin(x1) + cos(x0)) to train on, as plain
  Parquet written by pyarrow with skewed row groups, and as a Petastorm dataset written by Spark
  (files of uneven sizes);
- codecs: a Petastorm dataset with a field for every codec Petastorm has and the Spark types
  ScalarCodec takes (CODECS_FIELDS), in files of uneven sizes with several row groups each;
- Petastorm's own hello_world examples: generate_petastorm_dataset.py (smaller images) and
  generate_external_dataset.py (plain Parquet by Spark).

Petastorm cannot run beside dtf's stack (it needs pyarrow 14): the Petastorm datasets are written
by Petastorm itself in the petastorm side environment (dtf.sideenv), by tests/helpers/petastorm_side.py,
from columns computed here; `petastorm_reads` is what Petastorm's own readers yield for a data set,
read there too: the ground truth dtf's reader is checked against. The hive data set is written by
Spark here, in the main environment.

Every row carries its id (`id`), so a test can check which rows a rank read. Each data set is written
once per test session (per base); the side environment writes all of its ones in one run (one Spark
session) and reads them all back in the same run, while Spark writes the hive data set here.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dtf import sideenv
from dtf.data.petastorm_writer import spark_session
from tests.helpers.petastorm_side import load_columns, save_columns
from tests.helpers.side_venv import side_python

SIDE_SCRIPT = Path(__file__).with_name("petastorm_side.py")

HELLO_ROWS = 90
HELLO_FILES = 4
IMAGE_SHAPE = (16, 16, 3)
ARRAY_SHAPE = (2, 4, 3, 2)  # stored as (None, 4, 3, None)

HIVE_ROWS = 120
VECTOR_SIZE = 6

PANDAS_SIZES = (0, 37, 5, 58)  # rows per file; file 0 is empty
PIXELS = 12  # a 2x2x3 uint8 "image" per row, as a list column


def hello_image(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, size=IMAGE_SHAPE, dtype=np.uint8)


def hello_array(i: int) -> np.ndarray:
    return np.random.default_rng(10_000 + i).integers(0, 255, size=ARRAY_SHAPE, dtype=np.uint8)


def hive_inputs(i: int) -> list[float]:
    """The VectorAssembler's inputs of row i: every third row mostly zeros (assembled as a sparse vector)."""
    values = [float((i * 7 + j * 3) % 11) + 0.5 for j in range(VECTOR_SIZE)]
    if i % 3 == 0:
        values = [v if j in (1, 4) else 0.0 for j, v in enumerate(values)]
    return values


def hive_split(i: int) -> str:
    return "test" if i % 4 == 0 else "train"


def hive_bucket(i: int) -> int:
    return i % 2


def pandas_frame(file_index: int, first_id: int, rows: int) -> pd.DataFrame:
    ids = np.arange(first_id, first_id + rows)
    wide = file_index % 2 == 0  # files disagree in width: int32/float32 in some, int64/float64 in others
    pixels = [((ids[k] + np.arange(PIXELS)) % 256).astype(np.uint8) for k in range(rows)]
    frame = pd.DataFrame(
        {
            "id": ids.astype(np.int64),
            "pixels": pd.Series(pixels, dtype=object),
            "count": (ids % 17).astype(np.int64 if wide else np.int32),
            "ratio": (ids / 100).astype(np.float64 if wide else np.float32),
            "label": (ids % 3).astype(np.int64 if wide else np.int32),
        }
    )
    return frame


def scalar(name: str, dtype: str, spark_type: str) -> dict[str, Any]:
    """A Unischema field as petastorm_side.py describes one: a scalar (ScalarCodec)."""
    return {"name": name, "dtype": dtype, "shape": [], "codec": ["scalar", spark_type]}


def array(name: str, dtype: str, shape: tuple[int | None, ...], *codec: Any) -> dict[str, Any]:
    """A Unischema field of the given shape (None: any length) and codec (ndarray by default)."""
    return {"name": name, "dtype": dtype, "shape": list(shape), "codec": list(codec or ["ndarray"])}


HELLO_FIELDS = [
    scalar("id", "int32", "IntegerType"),
    scalar("label", "int32", "IntegerType"),
    scalar("weight", "float32", "FloatType"),
    array("image1", "uint8", IMAGE_SHAPE, "image", "png"),
    array("array_4d", "uint8", (None, 4, 3, None)),
]


def hello_columns() -> dict[str, Any]:
    ids = np.arange(HELLO_ROWS)
    return {
        "id": ids.astype(np.int32),
        "label": (ids % 4).astype(np.int32),
        "weight": (ids / 10).astype(np.float32),
        "image1": np.stack([hello_image(i) for i in ids]),
        "array_4d": np.stack([hello_array(i) for i in ids]),
    }


def write_hive(spark: Any, directory: Path) -> Path:
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    inputs = [f"x{j}" for j in range(VECTOR_SIZE)]
    rows = [(i, *hive_inputs(i), i % 3, float(i % 5), hive_split(i), hive_bucket(i)) for i in range(HIVE_ROWS)]
    frame = spark.createDataFrame(rows, ["id", *inputs, "label", "target", "split", "bucket"])
    assembled = VectorAssembler(inputCols=inputs, outputCol="features").transform(frame)
    scaled = StandardScaler(inputCol="features", outputCol="scaled", withMean=False).fit(assembled).transform(assembled)
    out = scaled.select("id", "features", "scaled", "label", "target", "split", "bucket")
    out.write.mode("overwrite").partitionBy("split", "bucket").parquet(directory.resolve().as_uri())
    return directory


def write_pandas(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    first_id = 0
    for k, rows in enumerate(PANDAS_SIZES):
        frame = pandas_frame(k, first_id, rows)
        # An empty frame's list column holds no values to type: pandas writes it as type null.
        frame.to_parquet(directory / f"part-{k}.parquet", row_group_size=20, index=False)
        first_id += rows
    return directory


FIELD_ROW_GROUPS = (700, 13, 290, 1, 500, 96, 400)  # plain Parquet: one file, skewed row groups
FIELD_FILES = (1200, 300, 500)  # the Petastorm dataset: rows per Spark write (one file each)


def field_rows(num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(20).uniform(-3, 3, size=(num_rows, 2)).astype(np.float32)
    return x, (np.sin(x[:, 1]) + np.cos(x[:, 0])).astype(np.float32)


def write_field_parquet(directory: Path) -> Path:
    """The field as pyarrow writes it: one file whose row groups hold FIELD_ROW_GROUPS rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    x, y = field_rows(sum(FIELD_ROW_GROUPS))
    offsets = pa.array(np.arange(len(x) + 1, dtype=np.int32) * 2)
    table = pa.table({"features": pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1))), "label": y})
    with pq.ParquetWriter(directory / "field.parquet", table.schema) as writer:
        start = 0
        for size in FIELD_ROW_GROUPS:
            writer.write_table(table.slice(start, size), row_group_size=size)
            start += size
    return directory


FIELD_FIELDS = [array("features", "float32", (2,)), scalar("label", "float32", "FloatType")]


def field_columns() -> dict[str, Any]:
    x, y = field_rows(sum(FIELD_FILES))
    return {"features": x, "label": y}


CODECS_ROWS = 60
CODECS_IMAGE = (12, 16)  # height, width
CODECS_FIELDS = [
    scalar("id", "int64", "LongType"),
    scalar("int32", "int32", "IntegerType"),
    scalar("int16", "int16", "ShortType"),
    scalar("int8", "int8", "ByteType"),
    scalar("float32", "float32", "FloatType"),
    scalar("float64", "float64", "DoubleType"),
    scalar("flag", "bool", "BooleanType"),
    scalar("text", "str", "StringType"),
    array("matrix", "float32", (3, 4)),
    array("ragged", "int16", (None, 3)),
    array("packed", "float64", (5, 6), "compressed_ndarray"),
    array("rgb_png", "uint8", (*CODECS_IMAGE, 3), "image", "png"),
    array("gray_png", "uint8", CODECS_IMAGE, "image", "png"),
    array("rgb_jpeg", "uint8", (*CODECS_IMAGE, 3), "image", "jpeg", 90),
]
CODECS_WRITES = [(0, 35, 2), (35, CODECS_ROWS, 1)]  # (start, stop, Spark partitions): files of 17, 18, 25 rows
CODECS_BLOCK_BYTES = 32768  # Parquet's row group size there: several row groups per file


def codecs_columns() -> dict[str, Any]:
    """The values of the codecs data set, row i's at [i]: extremes of each integer type, signed
    zeros and infinities, non-ASCII and empty strings, smooth images (what JPEG is for)."""
    n = CODECS_ROWS
    rng = np.random.default_rng(30)
    ids = np.arange(n, dtype=np.int64)

    def integers(dtype: Any) -> np.ndarray:
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype)
        values[:2] = info.min, info.max
        return values

    floats32 = (rng.standard_normal(n) * 1e3).astype(np.float32)
    floats64 = rng.standard_normal(n) * 1e-3
    for values in (floats32, floats64):
        values[:3] = -0.0, np.inf, -np.inf
    h, w = CODECS_IMAGE
    yy, xx = np.mgrid[0:h, 0:w]
    smooth = [  # half a period across the image, a phase per row: what JPEG keeps well
        np.stack(
            [
                128 + 60 * np.sin(2 * np.pi * (xx / (2 * w) + i / n)),
                128 + 60 * np.cos(2 * np.pi * (yy / (2 * h) + i / n)),
                128 + 40 * np.sin(2 * np.pi * ((xx + yy) / (2 * (w + h)) + 2 * i / n)),
            ],
            -1,
        ).round()
        for i in range(n)
    ]
    return {
        "id": ids,
        "int32": integers(np.int32),
        "int16": integers(np.int16),
        "int8": integers(np.int8),
        "float32": floats32,
        "float64": floats64,
        "flag": ids % 3 == 0,
        "text": np.array(["" if i % 7 == 0 else f"row {i} " + "äß€😀"[: i % 5] for i in range(n)]),
        "matrix": rng.standard_normal((n, 3, 4)).astype(np.float32),
        "ragged": [rng.integers(-1000, 1000, size=(1 + i % 4, 3)).astype(np.int16) for i in range(n)],
        "packed": rng.standard_normal((n, 5, 6)),
        "rgb_png": rng.integers(0, 256, size=(n, h, w, 3), dtype=np.uint8),
        "gray_png": rng.integers(0, 256, size=(n, h, w), dtype=np.uint8),
        "rgb_jpeg": np.stack(smooth).astype(np.uint8),
    }


EXAMPLE_ROWS = 10  # as in Petastorm's examples
EXAMPLE_IMAGE = (32, 64, 3)  # theirs: (128, 256, 3)
EXAMPLE_ARRAY = (4, 32, 6, 3)  # theirs: (4, 128, 30, 3)


class _Side:
    """One run of petastorm_side.py in the side environment, started in the background."""

    def __init__(self, jobs: dict[str, Any], scratch: Path) -> None:
        scratch.mkdir(parents=True, exist_ok=True)
        self.scratch = scratch
        (scratch / "jobs.json").write_text(json.dumps({"spark_master": "local[2]", **jobs}))
        self.log = open(scratch / "side.log", "w")  # noqa: SIM115 (closed in wait)
        self.proc = subprocess.Popen(
            [str(side_python("petastorm")), str(SIDE_SCRIPT), str(scratch / "jobs.json")],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=sideenv.environment(),
        )

    def wait(self) -> None:
        try:
            code = self.proc.wait(timeout=500)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        self.log.close()
        if code != 0:
            tail = "\n".join((self.scratch / "side.log").read_text().splitlines()[-30:])
            raise RuntimeError(f"petastorm_side.py in the petastorm side environment failed ({code}):\n{tail}")


def _unischema_job(
    directory: Path, name: str, fields: list[dict[str, Any]], columns: dict[str, Any], **how: Any
) -> dict[str, Any]:
    """petastorm_side.py's job for a data set of these fields and values."""
    stored = directory.parent / "petastorm_side" / f"{directory.name}.columns.npz"
    save_columns(stored, columns)
    job = {"kind": "unischema", "directory": str(directory), "schema_name": name, "fields": fields}
    return {**job, "columns": str(stored), **how}


_PETASTORM_WRITTEN: dict[Path, dict[str, Path]] = {}
_HIVE_WRITTEN: dict[Path, Path] = {}
_READS: dict[tuple[Path, bool, tuple[str, ...] | None], dict[str, np.ndarray]] = {}


def _petastorm_paths(base: Path) -> dict[str, Path]:
    return {name: base / name for name in ("hello_world", "field_petastorm", "codecs", "example", "external")}


def _start_petastorm(base: Path) -> tuple[_Side, list[dict[str, Any]]] | None:
    """Starts the side run that writes every data set Petastorm writes here, under base, and reads
    each back with Petastorm's readers; None if that was done already for base."""
    if base in _PETASTORM_WRITTEN:
        return None
    scratch = base / "petastorm_side"
    scratch.mkdir(parents=True, exist_ok=True)
    paths = _petastorm_paths(base)
    field_starts = np.cumsum([0, *FIELD_FILES[:-1]]).tolist()
    writes = [
        _unischema_job(
            paths["hello_world"],
            "HelloWorldSchema",
            HELLO_FIELDS,
            hello_columns(),
            writes=[{"start": 0, "stop": HELLO_ROWS, "partitions": 7, "coalesce": HELLO_FILES}],
        ),
        _unischema_job(
            paths["field_petastorm"],
            "FieldSchema",
            FIELD_FIELDS,
            field_columns(),
            writes=[
                {"start": a, "stop": a + n, "partitions": 1} for a, n in zip(field_starts, FIELD_FILES, strict=True)
            ],
        ),
        _unischema_job(
            paths["codecs"],
            "CodecsSchema",
            CODECS_FIELDS,
            codecs_columns(),
            writes=[{"start": a, "stop": b, "partitions": k} for a, b, k in CODECS_WRITES],
            block_bytes=CODECS_BLOCK_BYTES,
        ),
        {
            "kind": "hello_world_example",
            "directory": str(paths["example"]),
            "rows": EXAMPLE_ROWS,
            "image_shape": list(EXAMPLE_IMAGE),
            "array_shape": list(EXAMPLE_ARRAY),
        },
        {"kind": "external_example", "directory": str(paths["external"]), "rows": EXAMPLE_ROWS},
    ]
    reads = [
        {"path": str(path), "batch_reader": batch, "fields": None, "out": str(scratch / f"{name}.{batch}.npz")}
        for name, path in paths.items()
        for batch in ((True,) if name == "external" else (False, True))  # make_reader needs a Unischema
    ]
    return _Side({"write": writes, "read": reads}, scratch), reads


def _finish_petastorm(base: Path, started: tuple[_Side, list[dict[str, Any]]] | None) -> dict[str, Path]:
    if started is not None:
        side, reads = started
        side.wait()
        for job in reads:
            _READS[(Path(job["path"]).resolve(), job["batch_reader"], None)] = load_columns(Path(job["out"]))
        _PETASTORM_WRITTEN[base] = _petastorm_paths(base)
    return _PETASTORM_WRITTEN[base]


def _petastorm_written(base: Path) -> dict[str, Path]:
    return _finish_petastorm(base, _start_petastorm(base))


def _hive(base: Path) -> Path:
    if base not in _HIVE_WRITTEN:
        spark = spark_session("local[2]", app_name="dtf tests")  # a plain local session: Spark itself writes it
        try:
            _HIVE_WRITTEN[base] = write_hive(spark, base / "hive")
        finally:
            spark.stop()
    return _HIVE_WRITTEN[base]


def spark_datasets(base: Path) -> tuple[Path, Path]:
    """(hello_world, hive) under base, written on the first call (per base) of this test session
    (the hive one by Spark here while Petastorm writes its ones in the side environment)."""
    started = _start_petastorm(base)
    try:
        hive = _hive(base)
    finally:
        paths = _finish_petastorm(base, started)
    return paths["hello_world"], hive


def field_petastorm(base: Path) -> Path:
    """The field as a Petastorm dataset under base (written with the other Petastorm data sets)."""
    return _petastorm_written(base)["field_petastorm"]


def codecs_dataset(base: Path) -> Path:
    """The codecs data set under base (CODECS_FIELDS, values codecs_columns()), written with the
    other Petastorm data sets."""
    return _petastorm_written(base)["codecs"]


def hello_world_examples(base: Path) -> tuple[Path, Path]:
    """What Petastorm's hello_world examples write, under base: (petastorm_dataset, external_dataset)."""
    paths = _petastorm_written(base)
    return paths["example"], paths["external"]


def petastorm_reads(path: Path, *, batch_reader: bool, fields: list[str] | None = None) -> dict[str, np.ndarray]:
    """What Petastorm's own reader yields for the data set at path, per field, in the order it
    yields the rows: make_reader (rows decoded by the Unischema's codecs) or make_batch_reader, one
    pass, row groups in order, no shuffling (petastorm_side.py, in the side environment). Values of
    one shape come stacked in one array; others (ragged arrays, bytes) in a 1-d object array. The
    data sets of this module are read when they are written; any other on its first call."""
    key = (Path(path).resolve(), batch_reader, tuple(fields) if fields else None)
    if key not in _READS:
        with tempfile.TemporaryDirectory(prefix="dtf-petastorm-reads-") as scratch:
            out = Path(scratch) / "read.npz"
            job = {"path": str(key[0]), "batch_reader": batch_reader, "fields": fields, "out": str(out)}
            side = _Side({"read": [job]}, Path(scratch))
            side.wait()
            _READS[key] = load_columns(out)
    return dict(_READS[key])


def pandas_dataset(base: Path) -> Path:
    """The pandas files under base, written on the first call (per base)."""
    directory = base / "pandas"
    return directory if directory.exists() else write_pandas(directory)
