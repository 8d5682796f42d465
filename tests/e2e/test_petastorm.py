"""`python -m dtf data=parquet` (and `data=petastorm`, its former name) on skewed Parquet: equal
steps on every rank, the promised rows, a run that ends on its own, an exact mid-epoch resume, and
the in-memory path's loss; data that users' own tools wrote."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from dtf.data.parquet.plan import EpochOrder, Partitions, auto_partitions, batches_per_rank
from dtf.data.prepare import build_splits, write_parquet
from tests.helpers import user_datasets
from tests.helpers.parquet_files import SKEWED, write_skewed
from tests.helpers.plan_steps import rank_steps
from tests.helpers.record_rows import read_batches
from tests.helpers.run_command import DtfRun, run_command, run_dtf

BATCH = 16
SEED = 0  # trainer.seed: the plan's seed


def skewed_args(data: Path, record: Path, world: int, remainder: str) -> list[str]:
    return [
        "data=petastorm",
        f"data.path={data}",
        f"data.test_path={data}",
        f"data.batch_size={BATCH}",
        "data.eval_batch_size=50",
        f"data.remainder={remainder}",
        f"launcher.nproc={world}",
        "trainer.max_epochs=2",
        f"trainer.seed={SEED}",
        f"trainer.step_fn={{_target_: record_rows.record_step, _partial_: true, out_dir: '{record}'}}",
    ]


def promised_rows(data: Path, world: int, rank: int, epoch: int, remainder: str) -> list[int]:
    """What rank must train on in epoch: the plan's rows, looked up in the files with pyarrow."""
    labels = np.concatenate([pq.read_table(f, columns=["label"])["label"].to_numpy() for f in sorted(data.iterdir())])
    starts = np.concatenate([[0], np.cumsum(SKEWED)])
    c = auto_partitions(world * BATCH, world)  # data.canonical_partitions=auto
    plan = Partitions(EpochOrder(SKEWED, SEED, epoch, True, True), c, world * BATCH // c, remainder == "pad")
    segments = [s for step in rank_steps(plan, world, rank) for part in step for s in part]
    return [int(labels[starts[s.piece] + r]) for s in segments for r in s.rows]


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_skewed(tmp_path_factory.mktemp("skewed") / "train")


@pytest.fixture(scope="module")
def straight_2_ranks(tmp_path_factory: pytest.TempPathFactory, skewed: Path) -> tuple[DtfRun, Path]:
    record = tmp_path_factory.mktemp("straight_rows")
    run = run_dtf(skewed_args(skewed, record, 2, "drop"), tmp_path_factory.mktemp("straight") / "run")
    return run, record


def check_rows(run: DtfRun, record: Path, data: Path, world: int, remainder: str) -> None:
    n = sum(SKEWED)
    per_epoch = batches_per_rank(n, world, BATCH, remainder == "pad")
    s = run.summary
    assert s["steps_per_rank"] == [2 * per_epoch] * world and s["epochs"] == 2
    if remainder == "pad":
        assert f"{per_epoch * world * BATCH - n} rows repeated per epoch (data.remainder=pad)" in run.stdout
    else:
        assert f"{n - per_epoch * world * BATCH} rows dropped per epoch (data.remainder=drop)" in run.stdout
    for rank in range(world):
        batches = read_batches(record, "train", rank)
        assert len(batches) == 2 * per_epoch and {len(b) for b in batches} == {BATCH}
        for epoch in range(2):
            used = [i for b in batches[epoch * per_epoch : (epoch + 1) * per_epoch] for i in b]
            assert used == promised_rows(data, world, rank, epoch, remainder)
    # Two evaluations, each over every test row exactly once across the ranks.
    evaluated = Counter(i for rank in range(world) for b in read_batches(record, "eval", rank) for i in b)
    assert evaluated == Counter({i: 2 for i in range(n)})


@pytest.mark.slow
def test_skewed_row_groups_on_2_ranks_every_rank_same_steps_and_promised_rows(
    straight_2_ranks: tuple[DtfRun, Path], skewed: Path
) -> None:
    run, record = straight_2_ranks
    check_rows(run, record, skewed, 2, "drop")


@pytest.mark.slow
def test_skewed_row_groups_on_3_ranks_padded(tmp_path: Path, skewed: Path) -> None:
    record = tmp_path / "rows"
    record.mkdir()
    run = run_dtf(skewed_args(skewed, record, 3, "pad"), tmp_path / "run")
    check_rows(run, record, skewed, 3, "pad")


@pytest.mark.slow
def test_resume_mid_epoch_reads_on_exactly_where_it_stopped(
    tmp_path: Path, straight_2_ranks: tuple[DtfRun, Path], skewed: Path
) -> None:
    straight, straight_record = straight_2_ranks
    record = tmp_path / "rows"
    record.mkdir()
    args = skewed_args(skewed, record, 2, "drop")
    k = 40  # epoch 2 (of 31 batches each), batch 9
    run_dtf([*args, f"trainer.max_steps={k}"], tmp_path / "run")
    resumed = run_dtf(args, tmp_path / "run")
    assert resumed.summary["resumed_from_step"] == k
    assert resumed.summary["params_sha256"] == straight.summary["params_sha256"]
    assert resumed.summary["final_train_loss"] == straight.summary["final_train_loss"]
    for rank in range(2):  # the two runs together trained on the very batches of the straight run
        assert read_batches(record, "train", rank) == read_batches(straight_record, "train", rank)


def test_parquet_copy_trains_to_the_in_memory_loss_without_shuffling(tmp_path: Path) -> None:
    sizes = ["data.dataset.num_points=2000", "data.dataset.num_test=400"]
    splits = build_splits("scalar_field", [s.removeprefix("data.dataset.") for s in sizes])
    for split, (x, y) in splits.items():
        write_parquet(x, y, tmp_path / "parquet" / split, rows_per_group=300)
    common = ["launcher.nproc=1", "trainer.max_epochs=2"]
    memory = run_dtf([*common, *sizes, "data.shuffle=false"], tmp_path / "memory")
    files = run_dtf(
        [
            *common,
            "data=petastorm",
            f"data.path={tmp_path / 'parquet' / 'train'}",
            f"data.test_path={tmp_path / 'parquet' / 'test'}",
            "data.shuffle_rows=false",
            "data.shuffle_row_groups=false",
            "data.canonical_partitions=1",  # one partition: steps of stored rows in order, as in memory
        ],
        tmp_path / "files",
    )
    for key in ("train_loss_per_epoch", "test_loss_per_epoch", "params_sha256", "steps_per_rank"):
        assert files.summary[key] == memory.summary[key], key


def test_a_corrupt_file_is_one_error_line_before_any_rank_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    run = run_dtf(["data=petastorm", f"data.path={bad}"], tmp_path / "run", expect=2)
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dtf: error: data.path=file://{bad}: {bad} is not a readable Parquet file (ArrowInvalid: ")
    assert "Traceback" not in run.stderr and not (tmp_path / "run" / "logs").exists()


# --- Data users already have (tests/helpers/user_datasets.py: written by Spark and pandas, not by dtf),
# --- trained on 2 ranks with the commands of "Your own data" in docs/data.md.


@pytest.fixture(scope="session")
def user_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    base = tmp_path_factory.getbasetemp() / "user_datasets"
    hello, hive = user_datasets.spark_datasets(base)
    return hello, hive, user_datasets.pandas_dataset(base)


def check_counts(run: DtfRun, num_rows: int, batch: int, world: int = 2) -> None:
    """Equal steps on every rank, and every row of the data accounted for (used or dropped)."""
    s = run.summary
    per_rank = num_rows // (world * batch)
    assert s["data_samples"] == num_rows
    assert s["data_batches_per_epoch"] == per_rank and s["steps_per_rank"] == [per_rank] * world
    assert s["data_dropped_per_epoch"] == num_rows - per_rank * world * batch
    assert f"{num_rows - per_rank * world * batch} rows dropped per epoch" in run.stdout


def stored_rows(path: Path) -> int:
    """Rows in the Parquet files under path, counted by pyarrow from the files themselves."""
    return sum(pq.ParquetFile(f).metadata.num_rows for f in path.rglob("*.parquet"))


USER_RUN = [
    "launcher.nproc=2",
    "trainer.max_epochs=1",
    "data.batch_size=8",
    "model.hidden=16",
    "loss=cross_entropy",
    "metrics=accuracy",
]


@pytest.mark.slow
def test_a_petastorm_hello_world_dataset_with_png_images_trains_on_2_ranks(
    tmp_path: Path, user_data: tuple[Path, Path, Path]
) -> None:
    hello, _, _ = user_data
    width = math.prod(user_datasets.IMAGE_SHAPE) + math.prod(user_datasets.ARRAY_SHAPE) + 1
    run = run_dtf(
        [
            *USER_RUN,
            "data=petastorm",
            f"data.path={hello}",
            "data.feature_columns=[image1,array_4d,weight]",
            "data.label_column=label",
            "data.transform=[{_target_:dtf.data.transforms.Scale,divisor:255}]",
            f"model.in_features={width}",
            "model.out_features=4",
        ],
        tmp_path / "run",
    )
    assert "of a Petastorm dataset (codecs decoded)" in run.stdout
    check_counts(run, stored_rows(hello), 8)


@pytest.mark.slow
def test_a_hive_partitioned_spark_ml_dataset_trains_and_tests_from_one_root_on_2_ranks(
    tmp_path: Path, user_data: tuple[Path, Path, Path]
) -> None:
    _, hive, _ = user_data
    run = run_dtf(
        [
            *USER_RUN,
            "data=petastorm",
            f"data.path={hive}",
            "data.filters=[[split,'=',train]]",
            "data.test_filters=[[split,'=',test]]",
            "data.feature_columns=[features,bucket]",
            "data.label_column=label",
            f"model.in_features={user_datasets.VECTOR_SIZE + 1}",
            "model.out_features=3",
        ],
        tmp_path / "run",
    )
    check_counts(run, stored_rows(hive / "split=train"), 8)
    assert run.summary["final_test_loss"] is not None


@pytest.mark.slow
def test_pandas_files_of_uneven_sizes_and_widths_with_an_empty_one_train_on_2_ranks(
    tmp_path: Path, user_data: tuple[Path, Path, Path]
) -> None:
    _, _, pandas_dir = user_data
    run = run_dtf(
        [
            *USER_RUN,
            "data=petastorm",
            f"data.path={pandas_dir}",
            f"data.test_path={pandas_dir}",
            "data.feature_columns=[pixels,count,ratio]",
            "data.label_column=label",
            f"model.in_features={user_datasets.PIXELS + 2}",
            "model.out_features=3",
        ],
        tmp_path / "run",
    )
    assert stored_rows(pandas_dir) == sum(user_datasets.PANDAS_SIZES)
    check_counts(run, stored_rows(pandas_dir), 8)


_NO_MAIN_GUARD = """
import sys, torch
from omegaconf import OmegaConf
from dtf.config.schema import ParquetDataConfig
from dtf.data.parquet import data as parquet
from dtf.dist.env import DistEnv
print("the script's top level ran", flush=True)
cfg = OmegaConf.structured(ParquetDataConfig(path=sys.argv[1], batch_size=8, reader_pool_type="process"))
data, _ = parquet.build(cfg, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), seed=0)
data.set_epoch(0)
print(sum(len(y) for _, y in data), "rows", flush=True)
"""


def test_process_workers_do_not_run_a_script_without_a_main_guard_again(tmp_path: Path, skewed: Path) -> None:
    # multiprocessing's spawn imports the program's __main__ in every worker: a script like this,
    # with no `if __name__ == "__main__":`, would run again in each, and start workers of its own.
    import sys

    script = tmp_path / "read.py"
    script.write_text(_NO_MAIN_GUARD)
    run = run_command([sys.executable, str(script), str(skewed)], cwd=tmp_path)
    assert run.stdout.count("the script's top level ran") == 1 and "1016 rows" in run.stdout, run.stdout
