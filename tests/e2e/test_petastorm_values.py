"""dtf's values for datasets Petastorm itself wrote, against what Petastorm's own readers yield for
them, bit for bit (both read in their environments: dtf here, Petastorm in dtf.sideenv's).

Every field of a dataset that covers every codec and the Spark types ScalarCodec takes, Petastorm's
hello_world example dataset, and the regression field's dataset, through dtf's row-group reader
(the code every batch comes from), with the codecs decoded (make_reader) and as stored
(make_batch_reader); then the same rows through data=parquet's batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dtf.config.schema import ParquetDataConfig
from dtf.data.parquet import data as parquet
from dtf.data.parquet.reader import RowGroupReader
from dtf.data.parquet.source import inspect
from dtf.dist.env import DistEnv
from tests.helpers import user_datasets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.getbasetemp() / "user_datasets"
    example, external = user_datasets.hello_world_examples(base)
    return {
        "codecs": user_datasets.codecs_dataset(base),
        "hello_world": user_datasets.spark_datasets(base)[0],
        "example": example,
        "external": external,
        "field": user_datasets.field_petastorm(base),
    }


def dtf_reads(path: Path, decoded: bool, fields: list[str] | None = None) -> dict[str, np.ndarray]:
    """Every row group in order through dtf's reader, every field (or those named)."""
    source = inspect(str(path))
    names = fields or list(source.column_types)
    unischema = source.unischema.fields if decoded and source.unischema is not None else {}
    reader = RowGroupReader(source, tuple(names), {n: unischema[n] for n in names if n in unischema})
    pieces = [piece for piece in range(len(source.pieces)) if source.piece_rows[piece]]
    read = reader(pieces)
    parts = [read[piece] for piece in pieces]
    return {name: _concatenate([p[name] for p in parts]) for name in names}


def _concatenate(arrays: list[np.ndarray]) -> np.ndarray:
    if all(a.dtype != object for a in arrays):
        return np.concatenate(arrays)
    out = np.empty(sum(len(a) for a in arrays), dtype=object)
    out[:] = [v for a in arrays for v in a]
    return out


def assert_same(got: np.ndarray, expected: np.ndarray, name: str) -> None:
    assert len(got) == len(expected), name
    if expected.dtype == object or got.dtype == object:
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            g, e = np.asarray(g), np.asarray(e)
            assert g.dtype == e.dtype and g.shape == e.shape, (name, i, g.dtype, e.dtype, g.shape, e.shape)
            assert g.tobytes() == e.tobytes(), (name, i)
        return
    assert got.dtype == expected.dtype and got.shape == expected.shape, (name, got.dtype, expected.dtype)
    assert got.tobytes() == expected.tobytes(), name  # bit for bit: -0.0, inf and NaN payloads too


@pytest.mark.parametrize("name", ["codecs", "hello_world", "example", "field"])
def test_every_decoded_value_is_what_petastorms_make_reader_yields(written: dict[str, Path], name: str) -> None:
    expected = user_datasets.petastorm_reads(written[name], batch_reader=False)
    got = dtf_reads(written[name], decoded=True, fields=list(expected))
    assert set(got) == set(expected)
    for field in expected:
        assert_same(got[field], expected[field], f"{name}.{field}")


def test_plain_parquet_by_spark_is_what_petastorms_make_batch_reader_yields(written: dict[str, Path]) -> None:
    # Petastorm's hello_world external_dataset: plain Parquet that Spark wrote, no Unischema.
    expected = user_datasets.petastorm_reads(written["external"], batch_reader=True)
    got = dtf_reads(written["external"], decoded=False, fields=[f for f in expected if f != "image1"])
    for field in got:
        assert_same(got[field], expected[field], f"external.{field}")


def test_the_codecs_values_are_the_values_written(written: dict[str, Path]) -> None:
    # Beside Petastorm's reader, the values the writer was given (lossless codecs: equal; JPEG: near).
    values = user_datasets.codecs_columns()
    got = dtf_reads(written["codecs"], decoded=True)
    order = np.argsort(got["id"])
    for name, column in values.items():
        mine = got[name][order]
        if name == "rgb_jpeg":
            assert np.abs(np.stack(list(mine)).astype(int) - column.astype(int)).mean() < 4, name
        elif name == "ragged":
            assert all(np.array_equal(a, b) for a, b in zip(mine, column, strict=True)), name
        else:
            assert np.array_equal(np.stack(list(mine)) if mine.dtype == object else mine, column), name


def test_batches_of_a_petastorm_dataset_carry_the_decoded_rows(written: dict[str, Path]) -> None:
    # data=parquet in stored order (one partition, no shuffling) on one rank: features and labels
    # as the model gets them, row for row what Petastorm's reader decodes.
    expected = user_datasets.petastorm_reads(written["codecs"], batch_reader=False)
    cfg = ParquetDataConfig(
        path=str(written["codecs"]),
        feature_columns=["matrix", "gray_png"],
        label_column="int16",
        batch_size=6,
        shuffle_rows=False,
        shuffle_row_groups=False,
        canonical_partitions=1,
        feature_dtype="float64",
    )
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    data, _ = parquet.build(cfg, env, seed=0)
    data.set_epoch(0)
    batches: list[Any] = list(data)
    x = torch.cat([b[0] for b in batches]).numpy()
    y = torch.cat([b[1] for b in batches]).numpy()
    n = len(y)
    assert n == len(expected["id"]) // 6 * 6
    flat = np.concatenate(
        [expected["matrix"].reshape(len(expected["id"]), -1), expected["gray_png"].reshape(len(expected["id"]), -1)], 1
    )
    assert np.array_equal(x, flat[:n].astype(np.float64)) and np.array_equal(y, expected["int16"][:n].astype(np.int64))
