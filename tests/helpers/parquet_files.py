"""Small Parquet data sets for data=petastorm tests, written with pyarrow, whose rows say who they are.

Row i has label i and features [i, -i] / 1000 (so a row's features and label can be checked
to come from the same row), plus a scalar column `x` = i and a string column `name`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SKEWED = (1000, 10, 10, 1)


def rows_table(ids: np.ndarray) -> pa.Table:
    features = np.stack([ids, -ids], axis=1).astype(np.float32) / 1000
    offsets = pa.array(np.arange(len(ids) + 1, dtype=np.int32) * 2)
    return pa.table(
        {
            "features": pa.ListArray.from_arrays(offsets, pa.array(features.reshape(-1))),
            "label": pa.array(ids.astype(np.int64)),
            "x": pa.array(ids.astype(np.float32)),
            "name": pa.array([f"row{i}" for i in ids]),
        }
    )


def write_row_groups(directory: Path, files: Sequence[Sequence[int]], first_id: int = 0) -> Path:
    """One Parquet file per entry of files, with row groups of the given sizes; ids run on across them."""
    directory.mkdir(parents=True, exist_ok=True)
    next_id = first_id
    for i, sizes in enumerate(files):
        table = rows_table(np.arange(next_id, next_id + sum(sizes)))
        with pq.ParquetWriter(directory / f"part-{i:05d}.parquet", table.schema) as writer:
            offset = 0
            for size in sizes:
                writer.write_table(table.slice(offset, size), row_group_size=max(1, size))
                offset += size
        next_id += sum(sizes)
    return directory


def write_skewed(directory: Path) -> Path:
    """Row groups of 1000, 10, 10 and 1 rows, over two files."""
    return write_row_groups(directory, [SKEWED[:2], SKEWED[2:]])
