"""data=petastorm on data that users already have, written by pyarrow, pandas and Spark (not by dtf).

Batches are checked against the files as pyarrow or pandas read them. The Spark-written data
sets are written once per test session (tests/helpers/user_datasets.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from dtf.config.schema import PetastormDataConfig
from dtf.data.parquet import data as parquet
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from tests.helpers import user_datasets
from tests.helpers.parquet_files import write_row_groups
from tests.helpers.user_datasets import PIXELS


def config(path: Path | str, **settings: Any) -> PetastormDataConfig:
    return PetastormDataConfig(path=str(path), **settings)


def env(rank: int = 0, world: int = 1) -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))


def epoch_labels(cfg: PetastormDataConfig, number: int, world: int = 1) -> list[list[int]]:
    """Each rank's labels in epoch `number`, in the order they are trained on."""
    out = []
    for rank in range(world):
        data, _ = parquet.build(cfg, env(rank, world), seed=0)
        data.set_epoch(number)
        out.append(torch.cat([y for _, y in data]).tolist())
    return out


def test_empty_files_and_zero_row_row_groups_are_skipped_in_training_and_evaluation(tmp_path: Path) -> None:
    # pyarrow writes an empty table as one row group of 0 rows; a writer may also leave one between others.
    path = write_row_groups(tmp_path / "data", [[40], [0], [25, 0, 10], [0]])
    for world in (2, 3):
        cfg = config(path, batch_size=5, test_path=str(path))
        for number in range(4):  # the row-group order is shuffled: an empty one lands anywhere in some epoch
            per_rank = epoch_labels(cfg, number, world)
            assert {len(r) for r in per_rank} == {75 // (5 * world) * 5}
            used = [i for r in per_rank for i in r]
            assert len(set(used)) == len(used) and set(used) <= set(range(75))
        evaluated = []
        for rank in range(world):
            _, test = parquet.build(cfg, env(rank, world), seed=0)
            assert test is not None
            evaluated += [i for j, (_, y) in enumerate(test) for i in y[: test.num_real_in_batch(j)].tolist()]
        assert sorted(evaluated) == list(range(75))


# --- Data sets written by pandas and Spark (tests/helpers/user_datasets.py), once per session ---


@pytest.fixture(scope="session")
def pandas_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return user_datasets.pandas_dataset(tmp_path_factory.getbasetemp() / "user_datasets")


# Tests on the Spark-written data sets: the first of them in a session waits ~20 s for Spark to write them.
SPARK = pytest.mark.slow


@pytest.fixture(scope="session")
def spark_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return user_datasets.spark_datasets(tmp_path_factory.getbasetemp() / "user_datasets")


def in_order(path: Path | str, **settings: Any) -> PetastormDataConfig:
    # One canonical partition: its steps are the stored rows in order (more take rows from C places).
    return config(path, shuffle_rows=False, shuffle_row_groups=False, canonical_partitions=1, **settings)


def all_batches(cfg: PetastormDataConfig) -> tuple[torch.Tensor, torch.Tensor]:
    data, _ = parquet.build(cfg, env(), seed=0)
    data.set_epoch(0)
    batches = list(data)
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def pandas_rows(directory: Path) -> pd.DataFrame:
    """Every row of the pandas files, file after file, as pandas reads them."""
    return pd.concat([pd.read_parquet(f) for f in sorted(directory.glob("*.parquet"))], ignore_index=True)


def test_columns_come_from_every_file_not_the_first(pandas_data: Path) -> None:
    # part-0.parquet has no rows and sorts first; pandas wrote its list column `pixels` as type null.
    # The other files disagree in width (int32/int64, float32/float64): all arrive as one dtype.
    expected = pandas_rows(pandas_data)
    x, y = all_batches(in_order(pandas_data, feature_columns=["pixels", "count", "ratio"], label_column="id"))
    n = len(expected) // 32 * 32
    assert len(x) == n and y.tolist() == expected["id"].tolist()[:n]
    pixels = np.stack(expected["pixels"].to_numpy()[:n])
    manual = np.concatenate([pixels, expected[["count", "ratio"]].to_numpy()[:n]], axis=1)
    torch.testing.assert_close(x, torch.from_numpy(manual).float())
    _, labels = all_batches(in_order(pandas_data, feature_columns=["ratio"], label_column="label"))
    assert labels.dtype == torch.int64 and labels.tolist() == expected["label"].tolist()[:n]


def test_files_whose_columns_disagree_in_kind_are_refused_naming_the_file(pandas_data: Path, tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(pandas_data / "part-1.parquet", mixed / "part-1.parquet")
    frame = pd.read_parquet(pandas_data / "part-2.parquet")
    frame["label"] = frame["label"].astype(np.float64)  # another job wrote the label as a float
    frame["count"] = frame["count"].astype(str)
    frame.to_parquet(mixed / "part-2.parquet")
    message = one_line_error(in_order(mixed, feature_columns=["ratio"], label_column="label"))
    assert message.startswith("data.label_column: column 'label' is int32 in ") and "part-1.parquet" in message
    assert f"but double in {mixed / 'part-2.parquet'}" in message
    message = one_line_error(in_order(mixed, feature_columns=["count"], label_column="id"))
    assert message.startswith("data.feature_columns: column 'count' is int32 in") and "string in" in message
    # Widths alone may differ (the pandas files do): columns untouched by the run are not checked.
    parquet.build(in_order(mixed, feature_columns=["ratio"], label_column="id"), env(), seed=0)
    # A column that one file lacks: named with both files, before anything is read.
    frame.drop(columns=["ratio"]).to_parquet(mixed / "part-3.parquet")
    message = one_line_error(in_order(mixed, feature_columns=["ratio"], label_column="id"))
    assert message.startswith("data.feature_columns: column 'ratio' is in ") and "part-1.parquet" in message
    assert f"but not in {mixed / 'part-3.parquet'}: every file with rows needs it" in message


def one_line_error(cfg: PetastormDataConfig, world: int = 1) -> str:
    with pytest.raises(UserError) as err:
        data, _ = parquet.build(cfg, env(0, world), seed=0)
        next(iter(data))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_integer_features_arrive_in_the_models_float_dtype(pandas_data: Path) -> None:
    # uint8 pixels and int counts: a Linear layer needs them in its own (floating) dtype.
    cfg = in_order(pandas_data, feature_columns=["pixels", "count"], label_column="label")
    x, y = all_batches(cfg)
    assert x.dtype == torch.get_default_dtype() == torch.float32 and y.dtype == torch.int64
    torch.nn.Linear(PIXELS + 1, 2)(x)  # was: mat1 and mat2 must have the same dtype
    default = torch.get_default_dtype()
    try:  # data.feature_dtype=auto follows torch's default dtype, which is what the model is built in
        torch.set_default_dtype(torch.float64)
        x64, _ = all_batches(cfg)
    finally:
        torch.set_default_dtype(default)
    assert x64.dtype == torch.float64 and torch.equal(x64.float(), x)
    cfg.feature_dtype = "bfloat16"
    assert all_batches(cfg)[0].dtype == torch.bfloat16
    _, ratios = all_batches(in_order(pandas_data, feature_columns=["count"], label_column="ratio"))
    assert ratios.dtype == torch.float32  # float labels: floats (of the features' dtype), ints: int64
    with pytest.raises(UserError, match=r"^data\.feature_dtype=int8 is invalid: use auto"):  # as data.* is checked
        in_order(pandas_data, feature_columns=["pixels"], feature_dtype="int8")


def test_image_transforms_compose_as_a_list(pandas_data: Path) -> None:
    cfg = in_order(pandas_data, feature_columns=["pixels"], label_column="id")
    raw, ids = all_batches(cfg)
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    cfg.transform = [
        {"_target_": "dtf.data.transforms.Scale", "divisor": 255},
        {"_target_": "dtf.data.transforms.Reshape", "shape": [2, 2, 3]},  # stored as HWC
        {"_target_": "dtf.data.transforms.Normalize", "mean": mean, "std": std, "channel_dim": -1},
        {"_target_": "dtf.data.transforms.Permute", "dims": [2, 0, 1]},  # to CHW
    ]
    x, y = all_batches(cfg)
    assert torch.equal(y, ids) and x.shape == (len(raw), 3, 2, 2) and x.dtype == torch.float32
    manual = (raw.reshape(-1, 2, 2, 3) / 255 - torch.tensor(mean)) / torch.tensor(std)
    torch.testing.assert_close(x, manual.permute(0, 3, 1, 2))
    cfg.transform = [{"_target_": "dtf.data.transforms.Scale", "factor": 2.0}]  # a single one: a list of one
    torch.testing.assert_close(all_batches(cfg)[0], raw * 2)
    cfg.transform = {"_target_": "dtf.data.transforms.Scale", "factor": 2.0}
    torch.testing.assert_close(all_batches(cfg)[0], raw * 2)
    cfg.transform = [{"_target_": "dtf.data.transforms.Normalize", "mean": [0.1, 0.2], "std": [1, 1]}]
    message = one_line_error(cfg)
    assert message.startswith("data.transform: Normalize has 2 means and 2 stds for 12 values along dim 1")


def hive_rows(root: Path, **where: Any) -> pd.DataFrame:
    """The rows of the Spark-written Hive dataset, as pyarrow's dataset reader sees them."""
    import pyarrow.dataset as ds

    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    frame = table.to_pandas()
    for key, value in where.items():
        frame = frame[frame[key].astype(str) == str(value)]
    return frame


@SPARK
def test_spark_ml_vector_columns_are_float_arrays_dense_and_sparse(spark_data: tuple[Path, Path]) -> None:
    _, hive = spark_data
    train = hive / "split=train" / "bucket=1"  # a path with '=' in it, as Spark names partitions
    cfg = in_order(train, feature_columns=["features"], label_column="id", batch_size=4)
    x, ids = all_batches(cfg)
    assert len(ids) == len(hive_rows(hive, split="train", bucket=1)) // 4 * 4
    torch.testing.assert_close(x, torch.tensor([user_datasets.hive_inputs(i) for i in ids.tolist()]))
    assert any(user_datasets.hive_inputs(i).count(0.0) > 3 for i in ids.tolist())  # sparse ones among them
    # StandardScaler's output (withMean=False keeps sparse vectors sparse) beside the assembled vector:
    # each column divided by one number (its standard deviation), zeros staying zeros.
    both, _ = all_batches(in_order(train, feature_columns=["features", "scaled"], label_column="id", batch_size=4))
    d = user_datasets.VECTOR_SIZE
    assert both.shape == (len(ids), 2 * d) and torch.equal(both[:, :d], x)
    assert torch.equal(both[:, d:] == 0, x == 0)
    for j in range(d):
        nonzero = x[:, j] != 0
        ratio = both[nonzero, d + j] / x[nonzero, j]
        torch.testing.assert_close(ratio, ratio[:1].expand_as(ratio))


@SPARK
def test_one_hive_root_serves_train_and_test_through_partition_filters(spark_data: tuple[Path, Path]) -> None:
    _, hive = spark_data
    cfg = config(
        hive,
        feature_columns=["features", "bucket"],  # partition columns are columns too
        label_column="id",
        batch_size=8,
        filters=[["split", "=", "train"]],
        test_filters=[["split", "=", "test"]],
    )
    train_ids = set(hive_rows(hive, split="train")["id"].tolist())
    test_ids = hive_rows(hive, split="test")["id"].tolist()
    used, evaluated = [], []
    for rank in range(2):
        data, test = parquet.build(cfg, env(rank, 2), seed=0)
        assert data.num_samples == len(train_ids) and data.num_dropped_per_epoch == len(train_ids) % 16
        data.set_epoch(0)
        for x, y in data:
            used += y.tolist()
            assert x[:, -1].tolist() == [float(user_datasets.hive_bucket(i)) for i in y.tolist()]
        assert test is not None
        evaluated += [i for j, (_, y) in enumerate(test) for i in y[: test.num_real_in_batch(j)].tolist()]
    assert len(set(used)) == len(used) == len(train_ids) // 16 * 16 and set(used) <= train_ids
    assert sorted(evaluated) == sorted(test_ids)
    # The partition column as the label, a DNF with two conjunctions, and values of the partition's type.
    either = [[["split", "=", "test"], ["bucket", "=", 0]], [["split", "=", "train"], ["bucket", "in", [1]]]]
    cfg = in_order(hive, feature_columns=["features"], label_column="bucket", batch_size=1, filters=either)
    x, buckets = all_batches(cfg)
    rows = pd.concat([hive_rows(hive, split="test", bucket=0), hive_rows(hive, split="train", bucket=1)])
    assert len(buckets) == len(rows) and buckets.dtype == torch.int64
    assert sorted(buckets.tolist()) == sorted(rows["bucket"].astype(int).tolist())


@SPARK
def test_filters_on_row_values_are_refused(spark_data: tuple[Path, Path]) -> None:
    _, hive = spark_data
    cfg = config(hive, feature_columns=["features"], label_column="id", filters=[["label", "=", 1]])
    message = one_line_error(cfg)
    assert message.startswith("data.filters: 'label' is not a partition column of data.path=")
    cfg = config(hive, feature_columns=["features"], label_column="id", filters=[["split", "=", "nope"]])
    assert one_line_error(cfg).startswith("data.filters=[['split', '=', 'nope']] leave no rows in data.path=")


@SPARK
def test_petastorm_hello_world_images_arrays_and_scalars_are_decoded(spark_data: tuple[Path, Path]) -> None:
    hello, _ = spark_data
    cfg = in_order(hello, feature_columns=["image1"], label_column="id", batch_size=8)
    data, _ = parquet.build(cfg, env(), seed=0)
    assert data.stream.reader.row_reader  # a Petastorm dataset: make_reader decodes its codecs
    x, ids = all_batches(cfg)
    assert len(ids) == user_datasets.HELLO_ROWS // 8 * 8 and ids.dtype == torch.int64
    expected = np.stack([user_datasets.hello_image(i) for i in ids.tolist()])
    torch.testing.assert_close(x, torch.from_numpy(expected).float())  # PNG is lossless
    # An NdarrayCodec field with None dimensions, and scalars, flattened side by side.
    cfg = in_order(hello, feature_columns=["array_4d", "weight"], label_column="label", batch_size=8)
    x, labels = all_batches(cfg)
    arrays = np.stack([user_datasets.hello_array(i).reshape(-1) for i in ids.tolist()])
    torch.testing.assert_close(x[:, :-1], torch.from_numpy(arrays).float())
    torch.testing.assert_close(x[:, -1], ids.float() / 10)
    assert labels.tolist() == [i % 4 for i in ids.tolist()]


@SPARK
def test_without_opencv_an_image_field_is_refused_before_reading(
    spark_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    hello, _ = spark_data
    monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` fails, as in a Python without OpenCV
    cfg = in_order(hello, feature_columns=["array_4d", "image1"], label_column="id")
    message = one_line_error(cfg)
    assert message.startswith(
        "data.feature_columns: column 'image1' holds png images (Petastorm's CompressedImageCodec), which need OpenCV ("
    )
    assert message.endswith("pip install opencv-python-headless")
    parquet.build(in_order(hello, feature_columns=["array_4d"], label_column="id"), env(), seed=0)  # no image


@SPARK
@pytest.mark.parametrize("pool", ["thread", "process"])
def test_a_decoding_error_in_a_reader_worker_names_the_field_the_file_and_the_cause(
    spark_data: tuple[Path, Path], pool: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hello, _ = spark_data
    cfg = in_order(hello, feature_columns=["image1"], label_column="id", batch_size=8, reader_pool_type=pool)
    data, _ = parquet.build(cfg, env(), seed=0)  # OpenCV is there when the run starts ...
    # ... and gone where the workers decode: the error users saw, buried in a chain of tracebacks.
    if pool == "thread":
        monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` fails, as in a Python without OpenCV
    else:  # worker processes start a fresh Python (on this one's sys.path): give them a cv2 that fails to import
        (tmp_path / "cv2.py").write_text("raise ImportError('cv2 blocked by the test')\n")
        monkeypatch.syspath_prepend(str(tmp_path))  # this process has imported the real one already
    data.set_epoch(0)
    with pytest.raises(UserError) as err:
        next(iter(data))
    message = str(err.value)
    files = sorted(str(f) for f in hello.glob("*.parquet"))
    assert "\n" not in message and message.startswith(f"data.path={hello.as_uri()}: decoding field 'image1' of ")
    assert any(f" of {f} failed (" in message for f in files) and "cv2" in message, message
    assert message.endswith("pip install opencv-python-headless")


def test_one_scalar_feature_column_is_one_value_per_row(pandas_data: Path) -> None:
    x, _ = all_batches(in_order(pandas_data, feature_columns=["count"], label_column="label"))
    assert x.shape == (96, 1)
    torch.nn.Linear(1, 2)(x)  # was: mat1 and mat2 shapes cannot be multiplied (1x32 and 1x2)
