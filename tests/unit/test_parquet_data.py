"""data=petastorm read through Petastorm: batches checked against the Parquet files themselves.

Ranks are simulated in one process (each rank's data is a pure function of its rank and the
world size); the test at the end runs real gloo ranks for the cross-rank checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dtf.config.schema import LoaderDataConfig, PetastormDataConfig
from dtf.data import loader
from dtf.data.parquet import data as parquet
from dtf.data.parquet import reader
from dtf.data.parquet.plan import EpochOrder, Partitions, auto_partitions
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from tests.helpers.gloo import run_on_ranks
from tests.helpers.parquet_files import SKEWED, write_row_groups, write_skewed
from tests.helpers.plan_steps import rank_steps


def config(path: Path | str, **settings: Any) -> PetastormDataConfig:
    return PetastormDataConfig(path=str(path), **settings)


def env(rank: int = 0, world: int = 1) -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))


def stored_labels(directory: Path) -> np.ndarray:
    """All labels, file by file and row group by row group (Petastorm's order), read by pyarrow alone."""
    return np.concatenate(
        [pq.read_table(f, columns=["label"])["label"].to_numpy() for f in sorted(directory.glob("*.parquet"))]
    )


def epoch(data: Any, number: int, start_batch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data.set_epoch(number, start_batch)
    return list(data)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_skewed(tmp_path_factory.mktemp("skewed") / "train")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_skewed_row_groups_give_every_rank_the_same_batches_of_the_promised_rows(
    skewed: Path, world: int, remainder: str
) -> None:
    labels = stored_labels(skewed)
    batch = 16
    for number in range(2):
        used: list[int] = []
        for rank in range(world):
            data, _ = parquet.build(config(skewed, batch_size=batch, remainder=remainder), env(rank, world), seed=3)
            batches = epoch(data, number)
            assert len(batches) == len(data) and all(len(y) == batch for _, y in batches)
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            torch.testing.assert_close(x, torch.stack([y, -y], 1).float() / 1000)  # features and label of one row
            # The rows are the ones the plan promises, looked up in the files by pyarrow, in plan order.
            order = EpochOrder(SKEWED, 3, number, True, True)
            c = auto_partitions(world * batch, world)
            plan = Partitions(order, c, world * batch // c, pad=remainder == "pad")
            starts = np.concatenate([[0], np.cumsum(SKEWED)])
            segments = [s for step in rank_steps(plan, world, rank) for part in step for s in part]
            promised = [int(labels[starts[s.piece] + r]) for s in segments for r in s.rows]
            assert y.tolist() == promised
            used += promised
        n = len(labels)
        if remainder == "pad":
            assert set(used) == set(range(n)) and len(used) - n == data.num_repeated_per_epoch > 0
        else:
            assert len(set(used)) == len(used) == n - data.num_dropped_per_epoch
        assert len(data) == (-(-n // (world * batch)) if remainder == "pad" else n // (world * batch))


def test_resuming_mid_epoch_continues_with_exactly_the_remaining_batches(skewed: Path) -> None:
    data, _ = parquet.build(config(skewed, batch_size=8, remainder="pad"), env(1, 3), seed=11)
    full = epoch(data, 4)
    for start in (1, 20, len(full) - 1):
        rest = epoch(data, 4, start_batch=start)
        assert len(rest) == len(full) - start
        assert all(torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]) for a, b in zip(rest, full[start:], strict=True))
    assert epoch(data, 5)[0][1].tolist() != full[0][1].tolist()  # the next epoch starts from its beginning


def test_order_is_fixed_by_the_seed_whatever_the_reader_pool(skewed: Path) -> None:
    runs = {}
    for pool, workers in (("thread", 4), ("dummy", 1), ("thread", 1), ("process", 2)):
        data, _ = parquet.build(config(skewed, batch_size=4, reader_pool_type=pool, workers_count=workers), env(), 5)
        runs[(pool, workers)] = torch.cat([y for _, y in epoch(data, 2)]).tolist()
    assert len({tuple(r) for r in runs.values()}) == 1
    other, _ = parquet.build(config(skewed, batch_size=4), env(), seed=6)
    assert torch.cat([y for _, y in epoch(other, 2)]).tolist() != runs[("dummy", 1)]


def test_evaluation_counts_every_test_row_exactly_once(skewed: Path) -> None:
    for world in (2, 3, 4):
        real: list[int] = []
        lengths = set()
        for rank in range(world):
            _, test = parquet.build(
                config(skewed, batch_size=16, test_path=str(skewed), eval_batch_size=100), env(rank, world), 0
            )
            assert test is not None
            batches = list(test)
            lengths.add(len(batches))
            assert len(batches) == len(test)
            for j, (_, y) in enumerate(batches):
                real += y[: test.num_real_in_batch(j)].tolist()
        assert len(lengths) == 1
        assert sorted(real) == list(range(sum(SKEWED)))


def test_one_row_group_is_shared_by_two_ranks(tmp_path: Path) -> None:
    path = write_row_groups(tmp_path / "one", [[100]])
    used = []
    for rank in range(2):
        data, _ = parquet.build(config(path, batch_size=10), env(rank, 2), seed=0)
        batches = epoch(data, 0)
        assert len(batches) == len(data) == 5
        used += torch.cat([y for _, y in batches]).tolist()
    assert sorted(used) == list(range(100))


def test_several_columns_are_concatenated_and_a_transform_reshapes(skewed: Path) -> None:
    transform = {"_target_": "dtf.data.transforms.reshape_features", "_partial_": True, "shape": [1, 3]}
    cfg = config(skewed, batch_size=5, feature_columns=["features", "x"], shuffle_rows=False, shuffle_row_groups=False)
    cfg.transform = transform
    data, _ = parquet.build(cfg, env(), seed=0)
    x, y = next(iter(data))
    assert x.shape == (5, 1, 3) and x.dtype == torch.float32 and y.dtype == torch.int64
    torch.testing.assert_close(x[:, 0, 2], y.float())


def test_the_parquet_copy_of_a_builtin_data_set_gives_the_in_memory_batches(tmp_path: Path) -> None:
    from dtf.data.prepare import build_splits, write_parquet

    for name, overrides in (("scalar_field", ["num_points=1000", "num_test=200"]), ("digits", [])):
        x, y = build_splits(name, overrides)["train"]
        write_parquet(x, y, tmp_path / name, rows_per_group=100)
        cfg = config(
            tmp_path / name, batch_size=32, shuffle_rows=False, shuffle_row_groups=False, canonical_partitions=1
        )
        parquet_batches = epoch(parquet.build(cfg, env(), seed=0)[0], 0)
        option = OmegaConf.load(Path(__file__).parents[2] / "conf" / "data" / f"{name}.yaml")
        dataset = OmegaConf.merge(option.dataset, OmegaConf.from_dotlist(overrides))
        memory_cfg = LoaderDataConfig(dataset=dataset, batch_size=32, shuffle=False, drop_last=True)
        memory_batches = epoch(loader.build_splits(memory_cfg, env(), seed=0).train, 0)
        assert len(parquet_batches) == len(memory_batches) > 0
        for (px, py), (mx, my) in zip(parquet_batches, memory_batches, strict=True):
            assert px.shape == mx.shape and px.dtype == mx.dtype and torch.equal(px, mx) and torch.equal(py, my)


def test_a_url_of_another_scheme_is_read_through_fsspec() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    for i, sizes in enumerate(([30, 30], [7])):
        table = pa.table(
            {"features": np.arange(sum(sizes), dtype=np.float32) + 100 * i, "label": np.arange(sum(sizes))}
        )
        with fs.open(f"memory://dtf-test/data/part{i}.parquet", "wb") as f:
            pq.write_table(table, f, row_group_size=sizes[0])
    data, _ = parquet.build(config("memory://dtf-test/data", batch_size=8), env(), seed=0)
    assert len(data) == 67 // 8
    features = torch.cat([x for x, _ in epoch(data, 0)]).reshape(-1)  # one scalar column: (batch, 1)
    assert len(set(features.tolist())) == 64


def one_line_error(cfg: PetastormDataConfig, world: int = 1) -> str:
    with pytest.raises(UserError) as err:
        parquet.build(cfg, env(0, world), seed=0)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_bad_data_is_refused_with_one_line_that_names_the_key(tmp_path: Path, skewed: Path) -> None:
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 8)
    pq.write_table(
        pa.table({"features": pa.array([], pa.float32()), "label": pa.array([], pa.int64())}),
        tmp_path / "norows.parquet",
    )
    (tmp_path / "no_files").mkdir()
    assert one_line_error(config(tmp_path / "missing")).startswith(f"data.path={tmp_path / 'missing'} does not exist")
    assert "empty.parquet is not a readable Parquet file" in one_line_error(config(tmp_path / "empty.parquet"))
    assert "corrupt.parquet is not a readable Parquet file" in one_line_error(config(tmp_path / "corrupt.parquet"))
    assert "has 0 rows, fewer than world size x data.batch_size" in one_line_error(config(tmp_path / "norows.parquet"))
    assert "holds no Parquet files" in one_line_error(config(tmp_path / "no_files"))
    message = one_line_error(config(skewed, feature_columns=["features", "nope"]))
    assert (
        message.startswith("data.feature_columns: column 'nope' is not in data.path=") and "label, x, name" in message
    )
    assert one_line_error(config(skewed, label_column="lable")).startswith("data.label_column: column 'lable'")
    assert "1021 rows, fewer than world size x data.batch_size = 3 x 400 = 1200" in one_line_error(
        config(skewed, batch_size=400), world=3
    )
    assert one_line_error(config(skewed, test_path=str(tmp_path / "nope"))).startswith("data.test_path=")
    # Found only when read: a column that cannot become a tensor.
    data, _ = parquet.build(config(skewed, feature_columns=["name"]), env(), seed=0)
    with pytest.raises(UserError, match=r"column 'name' has type string"):
        next(iter(data))


def _ranks_agree_and_refuse_different_data(rank: int, world: int, paths: list[str]) -> None:
    data, _ = parquet.build(config(paths[0], batch_size=16), env(rank, world), seed=1)
    counts = torch.zeros(world)
    ids = []
    for _, y in data:  # each step a collective, as in DDP: a rank with fewer batches would hang here
        step = torch.ones(1)
        dist.all_reduce(step)
        counts[rank] += 1
        ids += y.tolist()
    dist.all_reduce(counts)
    assert counts.tolist() == [len(data)] * world
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, ids)
    assert len({i for part in everyone for i in part}) == sum(len(p) for p in everyone) == len(data) * 16 * world
    # A rank that sees other files is refused on every rank, before any batch.
    with pytest.raises(UserError, match="the ranks see different data"):
        parquet.build(config(paths[rank == world - 1], batch_size=16), env(rank, world), seed=1)


@pytest.mark.slow
def test_real_ranks_run_in_lockstep_and_refuse_to_plan_from_different_files(tmp_path: Path, skewed: Path) -> None:
    other = write_row_groups(tmp_path / "other", [[500, 30]])
    run_on_ranks(_ranks_agree_and_refuse_different_data, 3, [str(skewed), str(other)])


def test_a_resume_at_another_global_batch_continues_every_partition_from_the_row_it_reached(
    tmp_path: Path, skewed: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from tests.helpers.inprocess import train_in_process
    from tests.helpers.record_rows import read_batches

    record = tmp_path / "rows"
    record.mkdir()
    args = [
        "data=petastorm",
        f"data.path={skewed}",
        "trainer.max_epochs=1",
        "trainer.seed=3",
        f"trainer.step_fn={{_target_: record_rows.record_step, _partial_: true, out_dir: '{record}'}}",
    ]
    # 5 steps of G = 64 on one rank (C = auto = 8: 8 rows of each partition a step), then G = 32.
    first = train_in_process([*args, "data.batch_size=64", "trainer.max_steps=5"], tmp_path / "run")
    assert first["global_step"] == 5
    capfd.readouterr()
    resumed = train_in_process([*args, "data.batch_size=32"], tmp_path / "run")
    said = capfd.readouterr().out
    order = EpochOrder(SKEWED, 3, 0, True, True)
    labels = stored_labels(skewed)
    starts = np.concatenate([[0], np.cumsum(SKEWED)])

    def ids(plan: Partitions, c: int) -> list[int]:
        return [int(labels[starts[s.piece] + r]) for s in plan.rows(c) for r in s.rows]

    before, after = Partitions(order, 8, 8, pad=False), Partitions(order, 8, 4, pad=False)
    batches = read_batches(record, "train", 0)
    used = 5 * 8  # rows of every partition
    remaining = (after.rows_per_partition - used) // 4
    assert resumed["global_step"] == 5 + remaining and len(batches) == 5 + remaining
    for t, batch in enumerate(batches):
        plan, b, offset = (before, 8, 0) if t < 5 else (after, 4, used - 5 * 4)
        assert batch == [i for c in range(8) for i in ids(plan, c)[offset + t * b : offset + (t + 1) * b]], t
    notes = [line for line in said.splitlines() if "global batch changed" in line]
    assert len(notes) == 1 and "(64 -> 32) in the middle of epoch 1" in notes[0], said
    assert "seen twice" not in said


def _worker_pids() -> set[int]:
    """This process's children: the workers of reader_pool_type=process (not multiprocessing's
    resource tracker, which a process pool starts once and which stays for the life of the process).
    A zombie (a child another test in this worker ended and did not wait for) has no command line to
    read: it counts as a child, so one left before is in `before`, and a reader left a zombie is not."""
    import psutil

    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" in " ".join(child.cmdline()):
                continue
        except psutil.ZombieProcess:
            pass
        except psutil.NoSuchProcess:  # ended and reaped between the listing and the look
            continue
        pids.add(child.pid)
    return pids


def test_a_zombie_child_left_by_another_test_is_counted_not_read() -> None:
    """The CI run of 6c3a12b failed the two tests below on psutil.ZombieProcess: a child an earlier test
    in the same pytest worker left unwaited-for."""
    import subprocess
    import time

    import psutil

    child = subprocess.Popen(["true"])
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    try:
        assert child.pid in _worker_pids()
    finally:
        child.wait()


def test_an_epoch_left_in_the_middle_stops_its_reader_processes(tmp_path: Path) -> None:
    path = write_row_groups(tmp_path / "many", [[97, 64, 130, 5], [50] * 8, [211, 3, 88], [40] * 5])
    before = _worker_pids()
    data, _ = parquet.build(config(path, batch_size=8, reader_pool_type="process"), env(1, 2), seed=3)
    data.set_epoch(0)
    batches = iter(data)
    first = [next(batches) for _ in range(3)]
    assert _worker_pids() - before  # the epoch's reader processes
    del batches  # the trainer leaves an epoch so when the budget ends inside it, or a stop comes
    assert _worker_pids() <= before
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, epoch(data, 0), strict=False))


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_the_next_epoch_read_ahead_gives_the_same_batches_and_is_let_go_when_not_read(
    tmp_path: Path, pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 20 row groups of uneven sizes: 4 partitions per rank need several each, so the read-ahead
    # starts in the middle of an epoch, not at its first step (chunks of 4 steps: the default
    # chunk would gather most of this small epoch at its first step).
    monkeypatch.setattr(reader, "CHUNK_STEPS", 4)
    path = write_row_groups(tmp_path / "many", [[97, 64, 130, 5], [50] * 8, [211, 3, 88], [40] * 5])
    settings = {"batch_size": 8, "reader_pool_type": pool, "workers_count": 2}
    started: list[tuple[int, int]] = []  # (epoch being read, batches of it taken) at each reading's start
    taken = [0]
    before = _worker_pids()
    for rank in range(2) if pool == "thread" else [1]:  # a process pool starts in about a second
        plain, _ = parquet.build(config(path, **settings), env(rank, 2), seed=3)
        ahead, _ = parquet.build(config(path, **settings), env(rank, 2), seed=3)
        start_reading = ahead.stream.start_reading

        def spy(*args: Any, ahead: Any = ahead, start_reading: Any = start_reading) -> Any:
            started.append((ahead.epoch, taken[0]))
            return start_reading(*args)

        monkeypatch.setattr(ahead.stream, "start_reading", spy)
        started.clear()
        for number in range(3):
            expected = epoch(plain, number)
            ahead.set_epoch(number, read_ahead=number < 2)
            got, taken[0] = [], 0
            for batch in ahead:
                got.append(batch)
                taken[0] += 1
            assert len(got) == len(expected) == len(ahead)
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected, strict=True))
        # One reading per epoch: the first made at the first batch, the next two during the epoch
        # before, before its last batch; the last epoch reads nothing ahead.
        batches = len(ahead)
        assert [e for e, _ in started] == [0, 0, 1], started
        assert started[0][1] == 0 and all(0 < at < batches for _, at in started[1:]), (started, batches)

        # Read ahead for an epoch that is not the next one read: let go, and the right rows are read.
        ahead.set_epoch(3, read_ahead=True)
        list(ahead)
        if pool == "process":
            assert _worker_pids() - before  # epoch 4's workers, started ahead
        ahead.set_epoch(7)
        assert all(torch.equal(a[1], b[1]) for a, b in zip(list(ahead), epoch(plain, 7), strict=True))
        # ... and close() lets go of a reading started ahead when the run reads no more.
        ahead.set_epoch(8, read_ahead=True)
        list(ahead)
        ahead.close()
        assert _worker_pids() <= before


def test_reading_ahead_reads_every_row_group_an_epoch_needs_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next epoch's reading starts once this one's row groups all arrived: the steps still to
    come use them as they are, they are not read again."""
    monkeypatch.setattr(reader, "CHUNK_STEPS", 4)  # several chunks after the last row group arrives
    path = write_row_groups(tmp_path / "many", [[97, 64, 130, 5], [50] * 8, [211, 3, 88], [40] * 5])
    reads: list[int] = []
    read = reader.RowGroupReader.__call__

    def counted(self: Any, pieces: list[int], *args: Any) -> Any:
        reads.extend(pieces)
        return read(self, pieces, *args)

    monkeypatch.setattr(reader.RowGroupReader, "__call__", counted)
    data, _ = parquet.build(config(path, batch_size=8, workers_count=2), env(0, 2), seed=3)
    needed = []
    for number in range(3):
        data.set_epoch(number, read_ahead=number < 2)
        list(data)
        plan = data.partitions(number)
        needed += {s.piece for c in plan.owned(2, 0) for s in plan.rows(c)}
    assert sorted(reads) == sorted(needed)


@pytest.mark.parametrize("stop", [False, True])
def test_the_trainer_reads_ahead_only_an_epoch_it_will_train_and_lets_go_of_it_when_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: bool
) -> None:
    from dtf.data.parquet.reader import StepReading
    from dtf.results import Stopped
    from tests.helpers.inprocess import train_in_process
    from tests.unit.test_trainer import StopAtCheck

    path = write_row_groups(tmp_path / "many", [[97, 64, 130, 5], [50] * 8, [211, 3, 88], [40] * 5])
    readings: list[StepReading] = []

    class Recorded(StepReading):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            readings.append(self)

    monkeypatch.setattr(parquet, "StepReading", Recorded)
    args = ["data=petastorm", f"data.path={path}", "data.batch_size=32", "trainer.max_epochs=3"]
    # 1,198 rows: 37 steps per epoch; a stop signal before check 70 stops the run at step 72, in
    # epoch 2 after its last row groups arrived (the third epoch's reading started).
    args += ["checkpoint.stop_check_every_n_steps=1"]
    result = train_in_process(args, tmp_path / "run", StopAtCheck(70) if stop else None)
    if stop:
        assert isinstance(result, Stopped) and result.step == 72, result
    else:
        assert result["global_step"] == 3 * 37
    assert len(readings) == 3  # one per epoch, none for an epoch after the last
    assert all(r.closed for r in readings)  # every pool stopped, the one read ahead too


def test_arrow_columns_become_the_arrays_pyarrow_lists_them_as() -> None:
    """Lists of numbers (list and large_list, several chunks, slices of longer arrays, empty) and
    scalars, each checked against pyarrow's own Python lists."""
    from dtf.data.parquet.reader import arrow_to_numpy

    rows = [[float(i), -float(i), i / 3] for i in range(10)]
    lists = pa.array(rows, pa.list_(pa.float32()))
    columns = {
        "list": lists,
        "large_list": pa.array(rows, pa.large_list(pa.float64())),
        "chunks": pa.chunked_array([lists.slice(0, 4), lists.slice(4)]),
        "slice": lists.slice(3, 5),
        "chunk of a slice": pa.chunked_array([lists.slice(2, 6)]),
        "empty": lists.slice(10),
        "ints": pa.chunked_array([pa.array([3, 1, 2], pa.int32()), pa.array([7], pa.int32())]),
    }
    for name, column in columns.items():
        got = arrow_to_numpy(column, name)
        expected = column.to_pylist()
        assert got.tolist() == (np.asarray(expected, got.dtype).tolist() if expected else []), name
        assert len(got) == len(column), name
    for ragged in (pa.array([[1.0], [2.0, 3.0]]), pa.array([[0.0], [1.0], [2.0, 3.0]]).slice(1)):
        with pytest.raises(UserError, match="lists of different lengths"):  # offsets from 0, and from 1
            arrow_to_numpy(ragged, "ragged")
    with pytest.raises(UserError, match="is a list of string"):
        arrow_to_numpy(pa.array([["a"], ["b"]]), "words")


_LEAVES_A_READING_OPEN = """
import sys, torch
from omegaconf import OmegaConf
from dtf.config.schema import PetastormDataConfig
from dtf.data.parquet import data as parquet
from dtf.dist.env import DistEnv
cfg = OmegaConf.structured(PetastormDataConfig(path=sys.argv[1], batch_size=8))
data, _ = parquet.build(cfg, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), seed=0)
data.set_epoch(0, read_ahead=True)
batches = iter(data)
next(batches)  # this epoch's reader is running; the process ends here without closing it
"""


def test_a_process_that_ends_with_a_reading_open_exits_cleanly(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = write_row_groups(tmp_path / "many", [[400] * 12])
    for _ in range(3):  # an abort at exit came in about 3 of 4 runs while readers' threads were left running
        run = subprocess.run([sys.executable, "-c", _LEAVES_A_READING_OPEN, str(path)], capture_output=True, text=True)
        assert run.returncode == 0 and "terminate called" not in run.stderr, run.stderr[-2000:]


def test_partition_filters_take_values_as_the_partition_column_holds_them(tmp_path: Path) -> None:
    # Hive directories as Spark's partitionBy writes them; a filter value '1' (a string, as Hydra's
    # command line may give it) means bucket 1, as pyarrow's legacy reader (and so Petastorm) took it.
    for bucket, ids in ((0, [[10, 6]]), (1, [[7]])):
        write_row_groups(tmp_path / "root" / f"bucket={bucket}", ids, first_id=100 * bucket)
    root = tmp_path / "root"
    for filters, expected in (
        ([["bucket", "=", "1"]], list(range(100, 107))),
        ([["bucket", "=", 1]], list(range(100, 107))),
        ([["bucket", "in", ["0"]]], list(range(16))),
        ([["bucket", "!=", 0]], list(range(100, 107))),
    ):
        data, _ = parquet.build(config(root, batch_size=1, filters=filters, shuffle_row_groups=False), env(), seed=0)
        data.set_epoch(0)
        assert sorted(int(y) for _, y in data) == expected, filters
    message = one_line_error(config(root, filters=[["bucket", "<", "x"]]))
    assert message.startswith("data.filters=[['bucket', '<', 'x']] cannot be applied to data.path="), message
