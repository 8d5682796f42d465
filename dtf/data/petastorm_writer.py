"""Writes Petastorm datasets with Petastorm and Spark. Runs BY PATH with the python of the
petastorm side environment (dtf.sideenv), which holds Petastorm's old stack (pyarrow 14, numpy 1.x):
it imports only numpy, pyspark and petastorm, never dtf or torch.

    <petastorm env>/bin/python dtf/data/petastorm_writer.py JOBS.json

JOBS.json: {"spark_master": "local[2]", "datasets": [{"arrays": "x.npz", "directory": "...",
"name": "digits", "rows_per_group": 1024}, ...]}. Each .npz holds `features` and `label` (as
`python -m dtf.data.prepare --format petastorm` builds them in dtf's own environment); each is
written as a Petastorm dataset (a Unischema: NdarrayCodec for arrays, ScalarCodec for scalars)
through Spark and materialize_dataset, all in one Spark session. It prints one line per dataset.

spark_session() is also what the tests start a local Spark with, in either environment.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np


def spark_session(master: str, app_name: str = "dtf.data.prepare") -> Any:
    """A Spark session on this machine only, its Python workers this interpreter, without UI or progress bars."""
    from pyspark.sql import SparkSession

    # Spark's Python workers must be this interpreter (this venv), not whatever `python` is on PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # this machine only; no warning about the hostname
    spark = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def quiet_petastorm() -> None:
    """Petastorm runs on pyarrow's legacy dataset API, which warns on every call, and logs at INFO:
    nothing a user can act on."""
    logging.getLogger("petastorm").setLevel(logging.WARNING)
    for module in (r"petastorm(\..*)?", r"pyarrow(\..*)?"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)


def write_petastorm(
    spark: Any, features: np.ndarray, labels: np.ndarray, directory: Path, rows_per_group: int, name: str
) -> None:
    from petastorm.codecs import NdarrayCodec, ScalarCodec
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
    from pyspark.sql.types import DoubleType, FloatType, IntegerType, LongType

    spark_types = {
        np.dtype(np.float32): FloatType(),
        np.dtype(np.float64): DoubleType(),
        np.dtype(np.int64): LongType(),
        np.dtype(np.int32): IntegerType(),
    }

    def field(column: str, values: np.ndarray) -> Any:
        if values.ndim == 1:
            return UnischemaField(column, values.dtype.type, (), ScalarCodec(spark_types[values.dtype]), False)
        return UnischemaField(column, values.dtype.type, tuple(values.shape[1:]), NdarrayCodec(), False)

    schema = Unischema(f"dtf_{name}", [field("features", features), field("label", labels)])
    url = "file://" + str(directory.resolve())
    rows = [
        dict_to_spark_row(schema, {"features": x if x.ndim else x.item(), "label": y if y.ndim else y.item()})
        for x, y in zip(features, labels, strict=True)
    ]
    # One Spark partition per row group: each writes its own file of about rows_per_group rows,
    # and a block size of twice the file's raw size keeps it one row group (a block size far
    # beyond that only makes Parquet's memory manager shrink it, with warnings).
    num_files = max(1, math.ceil(len(rows) / rows_per_group))
    raw_bytes_per_row = features[0].nbytes + labels[0].nbytes + 256  # + NdarrayCodec's header
    block_mb = max(1, math.ceil(2 * raw_bytes_per_row * math.ceil(len(rows) / num_files) / 2**20))
    with materialize_dataset(spark, url, schema, row_group_size_mb=block_mb):
        frame = spark.createDataFrame(spark.sparkContext.parallelize(rows, num_files), schema.as_spark_schema())
        frame.write.mode("overwrite").parquet(url)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    jobs = json.loads(Path(argv[0]).read_text())
    quiet_petastorm()
    spark = spark_session(jobs["spark_master"])
    try:
        for job in jobs["datasets"]:
            with np.load(job["arrays"]) as arrays:
                features, labels = arrays["features"], arrays["label"]
            write_petastorm(spark, features, labels, Path(job["directory"]), job["rows_per_group"], job["name"])
            print(job["directory"], flush=True)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
