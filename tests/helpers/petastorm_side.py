"""Petastorm's own writing and reading for the tests' ground truth. Runs BY PATH with the python of
the petastorm side environment (dtf.sideenv), which holds Petastorm's old stack (pyarrow 14, numpy
1.x): it imports only numpy, pyspark and petastorm (never dtf, torch or the tests' helpers).

    <petastorm env>/bin/python tests/helpers/petastorm_side.py JOBS.json

JOBS.json: {"spark_master": "local[2]", "write": [...], "read": [...]}; the writes first (in one
Spark session, started only if there are any), then the reads:

- write {"kind": "unischema", "directory", "schema_name", "fields": [FIELD, ...], "columns": npz,
  "writes": [{"start", "stop", "partitions", "coalesce"}], "row_group_size_mb", "block_bytes"}:
  the rows of `columns` (save_columns) encoded with dict_to_spark_row on the driver, each entry of
  "writes" one Spark write of rows[start:stop] (the first overwrites, the others append), all in
  materialize_dataset. FIELD: {"name", "dtype" (a numpy dtype name, or "str"), "shape" (null for
  a None dimension), "codec": ["scalar", SPARK TYPE NAME] | ["ndarray"] | ["compressed_ndarray"] |
  ["image", "png" | "jpeg", quality]}. block_bytes, if set, overrides Parquet's row group size
  (materialize_dataset takes whole MB) for several row groups per file in a small data set.
- write {"kind": "hello_world_example", "directory", "rows", "image_shape", "array_shape"}:
  Petastorm's examples/hello_world/petastorm_dataset/generate_petastorm_dataset.py, scaled down.
- write {"kind": "external_example", "directory", "rows"}: Petastorm's
  examples/hello_world/external_dataset/generate_external_dataset.py (plain Parquet by Spark).
- read {"path", "batch_reader", "fields", "out"}: what make_reader (batch_reader false: rows
  decoded by the Unischema's codecs) or make_batch_reader yields, with reader_pool_type='dummy',
  shuffle_row_groups=False, num_epochs=1, every field (or `fields`), in the order it yields
  them, saved per field (save_columns) to `out`.

save_columns / load_columns are also what the main environment's tests use (this module imports
nothing else at its top): a field whose values are numpy arrays or scalars of one shape and a
non-object dtype is one stacked array; any other (ragged arrays, bytes, Python objects) is a 1-d
object array, its values stored one by one, so nothing is pickled either way.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

WRITER = Path(__file__).resolve().parents[2] / "dtf" / "data" / "petastorm_writer.py"


def save_columns(path: Path, columns: dict[str, Any]) -> None:
    entries: dict[str, np.ndarray] = {}
    index: dict[str, Any] = {}
    for name, values in columns.items():
        stacked = _stacked(values)
        if stacked is not None:
            entries[f"c/{name}"] = stacked
            index[name] = "stacked"
            continue
        kinds = []
        for i, value in enumerate(values):
            if isinstance(value, (bytes, bytearray)):
                entries[f"r/{name}/{i}"], kind = np.frombuffer(bytes(value), dtype=np.uint8), "bytes"
            elif isinstance(value, str):
                entries[f"r/{name}/{i}"], kind = np.array(value), "str"
            else:
                entries[f"r/{name}/{i}"], kind = np.asarray(value), "array"
            if entries[f"r/{name}/{i}"].dtype == object:
                raise TypeError(f"{name}[{i}]: {type(value).__name__} is not stored (it would be pickled)")
            kinds.append(kind)
        index[name] = kinds
    np.savez(path, __index__=np.array(json.dumps(index)), **entries)


def load_columns(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as stored:  # allow_pickle=False: nothing in it is a pickle
        index = json.loads(str(stored["__index__"]))
        columns: dict[str, np.ndarray] = {}
        for name, kinds in index.items():
            if kinds == "stacked":
                columns[name] = stored[f"c/{name}"]
                continue
            values = np.empty(len(kinds), dtype=object)
            for i, kind in enumerate(kinds):
                value = stored[f"r/{name}/{i}"]
                values[i] = value.tobytes() if kind == "bytes" else str(value) if kind == "str" else value
            columns[name] = values
    return columns


def _stacked(values: Any) -> np.ndarray | None:
    if isinstance(values, np.ndarray) and values.dtype != object:
        return values
    items = list(values)
    numeric = all(isinstance(v, (np.ndarray, np.generic)) and v.dtype != object for v in items)
    if items and numeric and len({(v.shape, v.dtype) for v in items}) == 1:
        return np.stack([np.asarray(v) for v in items])
    return None


def _writer_module() -> Any:
    """dtf's Petastorm writer (its Spark session, its quieting of Petastorm), loaded by path: dtf
    itself is not installed here."""
    spec = importlib.util.spec_from_file_location("petastorm_writer", WRITER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _field(spec: dict[str, Any]) -> Any:
    import pyspark.sql.types as spark_types
    from petastorm.codecs import CompressedImageCodec, CompressedNdarrayCodec, NdarrayCodec, ScalarCodec
    from petastorm.unischema import UnischemaField

    kind, *args = spec["codec"]
    if kind == "scalar":
        codec = ScalarCodec(getattr(spark_types, args[0])())
    elif kind == "ndarray":
        codec = NdarrayCodec()
    elif kind == "compressed_ndarray":
        codec = CompressedNdarrayCodec()
    elif kind == "image":
        codec = CompressedImageCodec(*args)
    else:
        raise ValueError(f"unknown codec {spec['codec']}")
    dtype = np.str_ if spec["dtype"] == "str" else np.dtype(spec["dtype"]).type
    return UnischemaField(spec["name"], dtype, tuple(spec["shape"]), codec, spec.get("nullable", False))


def write_unischema(spark: Any, job: dict[str, Any]) -> None:
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, dict_to_spark_row

    fields = [_field(f) for f in job["fields"]]
    schema = Unischema(job["schema_name"], fields)
    columns = load_columns(Path(job["columns"]))
    num_rows = len(next(iter(columns.values())))
    # Encoded on the driver (Petastorm's examples map them on the executors: the same bytes either way)
    rows = [dict_to_spark_row(schema, {f.name: columns[f.name][i] for f in fields}) for i in range(num_rows)]
    url = Path(job["directory"]).resolve().as_uri()
    with materialize_dataset(spark, url, schema, row_group_size_mb=job.get("row_group_size_mb", 1)):
        if job.get("block_bytes"):
            hadoop = spark.sparkContext._jsc.hadoopConfiguration()
            hadoop.setInt("parquet.block.size", job["block_bytes"])
            # Parquet checks the row group's size first after this many rows (100 by default); the
            # setting materialize_dataset makes for that, parquet.block.size.row.check.min, is older
            hadoop.setInt("parquet.page.size.row.check.min", 3)
        for k, part in enumerate(job["writes"]):
            chunk = rows[part["start"] : part["stop"]]
            frame = spark.createDataFrame(
                spark.sparkContext.parallelize(chunk, part["partitions"]), schema.as_spark_schema()
            )
            if part.get("coalesce"):
                frame = frame.coalesce(part["coalesce"])
            frame.write.mode("overwrite" if k == 0 else "append").parquet(url)


def write_hello_world_example(spark: Any, job: dict[str, Any]) -> None:
    """generate_petastorm_dataset.py of Petastorm's hello_world example: its schema and row
    generator (seeded per row here, for failures that reproduce), smaller images and arrays."""
    from petastorm.codecs import CompressedImageCodec, NdarrayCodec, ScalarCodec
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
    from pyspark.sql.types import IntegerType

    image_shape, array_shape = tuple(job["image_shape"]), tuple(job["array_shape"])
    schema = Unischema(
        "HelloWorldSchema",
        [
            UnischemaField("id", np.int32, (), ScalarCodec(IntegerType()), False),
            UnischemaField("image1", np.uint8, image_shape, CompressedImageCodec("png"), False),
            UnischemaField("array_4d", np.uint8, (None, *array_shape[1:3], None), NdarrayCodec(), False),
        ],
    )

    def row_generator(x: int) -> dict[str, Any]:
        rng = np.random.RandomState(x)
        return {
            "id": x,
            "image1": rng.randint(0, 255, dtype=np.uint8, size=image_shape),
            "array_4d": rng.randint(0, 255, dtype=np.uint8, size=array_shape),
        }

    url = Path(job["directory"]).resolve().as_uri()
    rowgroup_size_mb = 256
    with materialize_dataset(spark, url, schema, rowgroup_size_mb):
        rows_rdd = (
            spark.sparkContext.parallelize(range(job["rows"]))
            .map(row_generator)
            .map(lambda x: dict_to_spark_row(schema, x))
        )
        spark.createDataFrame(rows_rdd, schema.as_spark_schema()).coalesce(10).write.mode("overwrite").parquet(url)


def write_external_example(spark: Any, job: dict[str, Any]) -> None:
    """generate_external_dataset.py of Petastorm's hello_world example (plain Parquet, no Petastorm)."""
    from pyspark.sql import Row

    def row_generator(x: int) -> Any:
        rng = random.Random(x)
        return Row(id=x, value1=rng.randint(-255, 255), value2=rng.randint(-255, 255))

    rows_rdd = spark.sparkContext.parallelize(range(job["rows"])).map(row_generator)
    spark.createDataFrame(rows_rdd).write.mode("overwrite").parquet(Path(job["directory"]).resolve().as_uri())


WRITERS = {
    "unischema": write_unischema,
    "hello_world_example": write_hello_world_example,
    "external_example": write_external_example,
}


def read(job: dict[str, Any]) -> None:
    from petastorm import make_batch_reader, make_reader

    make = make_batch_reader if job["batch_reader"] else make_reader
    options: dict[str, Any] = {"reader_pool_type": "dummy", "shuffle_row_groups": False, "num_epochs": 1}
    if job.get("fields"):
        options["schema_fields"] = job["fields"]
    columns: dict[str, list[Any]] = {}
    with make(Path(job["path"]).resolve().as_uri(), **options) as reader:
        for item in reader:
            for name, value in item._asdict().items():
                # a batch holds a column of values; make_reader's item is one row
                columns.setdefault(name, []).extend(list(value) if job["batch_reader"] else [value])
    save_columns(Path(job["out"]), columns)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    jobs = json.loads(Path(argv[0]).read_text())
    writer = _writer_module()
    writer.quiet_petastorm()
    if jobs.get("write"):
        spark = writer.spark_session(jobs.get("spark_master", "local[2]"), app_name="dtf tests: Petastorm datasets")
        try:
            for job in jobs["write"]:
                WRITERS[job["kind"]](spark, job)
        finally:
            spark.stop()
    for job in jobs.get("read", []):
        read(job)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
