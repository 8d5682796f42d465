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
  (files of uneven sizes).

Every row carries its id (`id`), so a test can check which rows a rank read. `spark_datasets`
and `pandas_dataset` write them once per test session (one Spark session for both Spark ones).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dtf.data.prepare import spark_session

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


def write_hello_world(spark: Any, directory: Path) -> Path:
    from petastorm.codecs import CompressedImageCodec, NdarrayCodec, ScalarCodec
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
    from pyspark.sql.types import FloatType, IntegerType

    schema = Unischema(
        "HelloWorldSchema",
        [
            UnischemaField("id", np.int32, (), ScalarCodec(IntegerType()), False),
            UnischemaField("label", np.int32, (), ScalarCodec(IntegerType()), False),
            UnischemaField("weight", np.float32, (), ScalarCodec(FloatType()), False),
            UnischemaField("image1", np.uint8, IMAGE_SHAPE, CompressedImageCodec("png"), False),
            UnischemaField("array_4d", np.uint8, (None, 4, 3, None), NdarrayCodec(), False),
        ],
    )

    def row(i: int) -> dict[str, Any]:
        return {
            "id": np.int32(i),
            "label": np.int32(i % 4),
            "weight": np.float32(i / 10),
            "image1": hello_image(i),
            "array_4d": hello_array(i),
        }

    url = directory.resolve().as_uri()
    # The rows are encoded here (the example maps them on the executors): the same bytes either way.
    rows = [dict_to_spark_row(schema, row(i)) for i in range(HELLO_ROWS)]
    with materialize_dataset(spark, url, schema, row_group_size_mb=1):
        frame = spark.createDataFrame(spark.sparkContext.parallelize(rows, 7), schema.as_spark_schema())
        frame.coalesce(HELLO_FILES).write.mode("overwrite").parquet(url)
    return directory


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


def write_field_petastorm(spark: Any, directory: Path) -> Path:
    """The field as a Petastorm dataset (a Unischema: features NdarrayCodec, label a float), one
    Spark write per entry of FIELD_FILES, so its files differ in size."""
    from petastorm.codecs import NdarrayCodec, ScalarCodec
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
    from pyspark.sql.types import FloatType

    schema = Unischema(
        "FieldSchema",
        [
            UnischemaField("features", np.float32, (2,), NdarrayCodec(), False),
            UnischemaField("label", np.float32, (), ScalarCodec(FloatType()), False),
        ],
    )
    x, y = field_rows(sum(FIELD_FILES))
    rows = [dict_to_spark_row(schema, {"features": x[i], "label": np.float32(y[i])}) for i in range(len(x))]
    url = directory.resolve().as_uri()
    with materialize_dataset(spark, url, schema, row_group_size_mb=1):
        start = 0
        for k, size in enumerate(FIELD_FILES):
            part = spark.createDataFrame(
                spark.sparkContext.parallelize(rows[start : start + size], 1), schema.as_spark_schema()
            )
            part.write.mode("overwrite" if k == 0 else "append").parquet(url)
            start += size
    return directory


_SPARK_WRITTEN: dict[Path, tuple[Path, Path, Path]] = {}


def _spark_written(base: Path) -> tuple[Path, Path, Path]:
    if base not in _SPARK_WRITTEN:
        spark = spark_session("local[2]")  # a plain local session; the data are written by Spark itself
        try:
            _SPARK_WRITTEN[base] = (
                write_hello_world(spark, base / "hello_world"),
                write_hive(spark, base / "hive"),
                write_field_petastorm(spark, base / "field_petastorm"),
            )
        finally:
            spark.stop()
    return _SPARK_WRITTEN[base]


def spark_datasets(base: Path) -> tuple[Path, Path]:
    """(hello_world, hive) under base, written on the first call (per base) of this test session."""
    return _spark_written(base)[:2]


def field_petastorm(base: Path) -> Path:
    """The field as a Petastorm dataset under base (written with the other Spark data sets)."""
    return _spark_written(base)[2]


def pandas_dataset(base: Path) -> Path:
    """The pandas files under base, written on the first call (per base)."""
    directory = base / "pandas"
    return directory if directory.exists() else write_pandas(directory)
