"""data=parquet from s3:// on a real S3 endpoint: scripts/local-s3.sh runs moto's server on
127.0.0.1, and dtf reads it through s3fs over HTTP exactly as it would read AWS, its endpoint and
key taken from where boto takes them (AWS_ENDPOINT_URL and AWS_ACCESS_KEY_ID in the environment)
or from data.storage_options. The data are what `python -m dtf.data.prepare` writes, uploaded
with s3fs; the proof is the same run from the local copy, bit for bit. The server's own request
log counts what the runs fetched: data.cache_dir's promise is that a second epoch fetches nothing."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dtf.data import prepare
from dtf.errors import UserError
from tests.helpers import user_datasets
from tests.helpers.clusters import script_cluster
from tests.helpers.inprocess import train_in_process, train_on_ranks

BUCKET = "dtf-data"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The project's S3 endpoint for this module, and the environment that points boto at it."""
    env = {"DTF_S3_DIR": str(tmp_path_factory.mktemp("s3-server"))}
    with script_cluster("local-s3.sh", "AWS_ENDPOINT_URL", env) as endpoint, pytest.MonkeyPatch.context() as mp:
        found = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "dtf-local",
            "AWS_SECRET_ACCESS_KEY": "dtf-local",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        for key, value in found.items():
            mp.setenv(key, value)
        yield {**found, "log": str(Path(env["DTF_S3_DIR"]) / "server.log")}


@pytest.fixture(scope="module")
def scalar_field(s3: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The scalar field (python -m dtf.data.prepare) as pandas writes it: the training rows in 4
    files of 3 row groups, the test rows in one; on disk, and in the bucket (put there by s3fs)."""
    import pyarrow.parquet as pq
    import s3fs

    made = tmp_path_factory.mktemp("prepared")
    assert prepare.main(["scalar_field", "--out", str(made), "--set", "num_points=1200", "--set", "num_test=200"]) == 0
    local = tmp_path_factory.mktemp("scalar")
    for split in ("train", "test"):
        frame = pq.read_table(made / "scalar_field" / "parquet" / split).to_pandas()
        (local / split).mkdir()
        files = 4 if split == "train" else 1
        for i in range(files):
            part = frame.iloc[i * len(frame) // files : (i + 1) * len(frame) // files]
            part.to_parquet(local / split / f"part-{i}.parquet", row_group_size=100, index=False)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    fs.put(f"{local}/", f"{BUCKET}/scalar/", recursive=True)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/scalar")) == ["test", "train"]
    return local, f"s3://{BUCKET}/scalar"


def _args(root: str, storage: dict[str, str] | None = None, *more: str) -> list[str]:
    args = [
        "data=parquet",
        f"data.path={root}/train",
        f"data.test_path={root}/test",
        "data.batch_size=32",
        "trainer.max_epochs=2",
        "checkpoint.every_n_steps=null",
        *more,
    ]
    if storage:  # s3fs's own keywords, as a user writes them
        args += [
            f"+data.storage_options.key={storage['AWS_ACCESS_KEY_ID']}",
            f"+data.storage_options.secret={storage['AWS_SECRET_ACCESS_KEY']}",
            f"+data.storage_options.client_kwargs.endpoint_url={storage['AWS_ENDPOINT_URL']}",
        ]
    return args


_REQUEST = re.compile(r'"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/[\d.]+" (\d+)')


def _requests(s3: dict[str, str]) -> list[tuple[str, str, int]]:
    """(method, path and query, status) of every request the server has logged (werkzeug's log)."""
    return [(m[1], m[2], int(m[3])) for m in map(_REQUEST.search, Path(s3["log"]).read_text().splitlines()) if m]


def _same_model(a: Path, b: Path) -> None:
    ours = torch.load(a / "model.pt", weights_only=True)
    theirs = torch.load(b / "model.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (a, b))
    assert sa["train_loss_per_epoch"] == sb["train_loss_per_epoch"]
    assert sa["test_loss_per_epoch"] == sb["test_loss_per_epoch"]
    assert sa["steps_per_rank"] == sb["steps_per_rank"]


def test_parquet_from_s3_trains_as_from_local_disk_on_one_rank(scalar_field: tuple[Path, str], tmp_path: Path) -> None:
    # The endpoint and key from the environment, as boto reads them (AWS_ENDPOINT_URL).
    local, url = scalar_field
    train_in_process(_args(str(local)), tmp_path / "local")
    train_in_process(_args(url), tmp_path / "s3")
    _same_model(tmp_path / "s3", tmp_path / "local")


def test_parquet_from_s3_trains_as_from_local_disk_on_two_ranks(
    s3: dict[str, str], scalar_field: tuple[Path, str], tmp_path: Path
) -> None:
    # The endpoint and key in data.storage_options: the ranks' environment does not name them.
    local, url = scalar_field
    train_on_ranks(2, [("local", _args(str(local))), ("s3", _args(url, s3))], tmp_path)
    _same_model(tmp_path / "s3", tmp_path / "local")


def test_a_petastorm_dataset_on_s3_trains_as_from_local_disk_on_two_ranks(
    s3: dict[str, str], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Petastorm's own dataset (its Unischema pickled in _common_metadata, its NdarrayCodec values),
    written by Petastorm and Spark, read from the bucket through the cache."""
    import s3fs

    local = user_datasets.field_petastorm(tmp_path_factory.getbasetemp() / "user_datasets")
    s3fs.S3FileSystem(skip_instance_cache=True).put(f"{local}/", f"{BUCKET}/field_petastorm/", recursive=True)
    args = ["data=petastorm", "data.batch_size=16", "trainer.max_epochs=1", "checkpoint.every_n_steps=null"]
    cached = [f"data.path=s3://{BUCKET}/field_petastorm", f"data.cache_dir={tmp_path / 'cache'}"]
    runs = [("local", [*args, f"data.path={local}"]), ("s3", [*args, *cached])]
    train_on_ranks(2, runs, tmp_path)
    ours = torch.load(tmp_path / "s3" / "model.pt", weights_only=True)
    theirs = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_bucket_that_does_not_exist_is_named_in_one_line(s3: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        train_in_process(_args("s3://no-such-bucket/scalar"), tmp_path / "run")
    line = str(err.value)
    assert line.startswith("data.path=s3://no-such-bucket/scalar/train does not exist") and "\n" not in line
    assert "check the bucket and the path" in line


def test_an_endpoint_that_does_not_answer_ends_in_one_line_within_the_bounded_wait(
    s3: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that takes the connection and never answers: dtf's bounded waits (shortened here
    to keep the test short; dtf.remote's defaults are 5 s to connect and 10 s a read) end the run in one line."""
    import socket
    import time

    from dtf import remote

    monkeypatch.setattr(remote, "S3_READ_TIMEOUT_S", 1)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes the handshakes; nothing ever reads or answers
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(UserError) as err:
            train_in_process(_args(f"s3://{BUCKET}/scalar"), tmp_path / "run")
        took = time.monotonic() - started
    finally:
        silent.close()
    line = str(err.value)
    assert line.startswith(f"data.path=s3://{BUCKET}/scalar/train: the storage endpoint did not answer"), line
    assert "\n" not in line and "AWS_ENDPOINT_URL" in line
    assert took < 30, took


def test_refused_credentials_are_named_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second server that checks every request's signature (moto's INITIAL_NO_AUTH_ACTION_COUNT=0:
    its IAM knows no key), as AWS does a key it does not know."""
    import s3fs

    # fsspec reuses a file system made with the same options, and the earlier tests' one holds
    # the other server and good keys (boto read them from the environment when it was made)
    s3fs.S3FileSystem.clear_instance_cache()
    env = {"DTF_S3_DIR": str(tmp_path / "strict"), "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    with script_cluster("local-s3.sh", "AWS_ENDPOINT_URL", env) as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(UserError) as err:
            train_in_process(_args(f"s3://{BUCKET}/scalar"), tmp_path / "run")
    line = str(err.value)
    assert line.startswith(f"data.path=s3://{BUCKET}/scalar/train: access was refused"), line
    assert "AWS_ACCESS_KEY_ID" in line and "\n" not in line


def test_a_mid_epoch_resume_from_s3_equals_the_straight_run(
    s3: dict[str, str], scalar_field: tuple[Path, str], tmp_path: Path
) -> None:
    _, url = scalar_field
    runs = [("straight", _args(url, s3)), ("resumed", _args(url, s3, "trainer.max_steps=13"))]
    runs += [("resumed", _args(url, s3))]  # 18 steps an epoch on 2 ranks: it stopped in the first
    summaries = train_on_ranks(2, runs, tmp_path)
    assert summaries["resumed"]["resumed_from_step"] == 13
    _same_model(tmp_path / "resumed", tmp_path / "straight")


def test_the_cache_is_filled_once_and_a_second_epoch_fetches_nothing(
    s3: dict[str, str], scalar_field: tuple[Path, str], tmp_path: Path
) -> None:
    """Two ranks read the same files at the same time into one cache: each file comes whole, once.
    A run of two epochs makes exactly the requests of a run of one (the footers, the listing, the
    files): the second reads its copies and lists nothing."""
    local, url = scalar_field
    made: dict[int, Counter[tuple[str, str, int]]] = {}
    for epochs in (1, 2):
        before = len(_requests(s3))
        cached = _args(url, s3, f"trainer.max_epochs={epochs}", f"data.cache_dir={tmp_path / f'cache{epochs}'}")
        train_on_ranks(2, [(f"cached{epochs}", cached)], tmp_path)
        made[epochs] = Counter(_requests(s3)[before:])
    assert made[2] == made[1]
    whole = Counter(p for (method, p, status) in made[2] if method == "GET" and status == 200 and ".parquet" in p)
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*.parquet"))
    assert sorted(p.rsplit("/scalar/", 1)[1] for p in whole) == files and set(whole.values()) == {1}
    assert len(list((tmp_path / "cache2").glob("*.parquet"))) == len(files)
    train_on_ranks(2, [("local", _args(str(local)))], tmp_path)
    _same_model(tmp_path / "cached2", tmp_path / "local")


def test_a_cache_limit_keeps_the_folder_within_it_and_trains_the_same(
    s3: dict[str, str], scalar_field: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local, url = scalar_field
    sizes = sorted(p.stat().st_size for p in local.rglob("*.parquet"))
    limit = (sizes[-1] + sizes[-2]) / 2**30  # room for two files at most: every epoch evicts and fetches again
    args = _args(url, s3, f"data.cache_dir={tmp_path / 'cache'}", f"data.cache_limit_gb={limit}")
    train_in_process(args, tmp_path / "bounded")
    assert "each epoch fetches again what it evicted (data.cache_limit_gb)" in capsys.readouterr().out  # named
    kept = [p.stat().st_size for p in (tmp_path / "cache").glob("*.parquet")]
    assert 0 < len(kept) <= 2 and sum(kept) <= limit * 2**30
    train_in_process(_args(str(local)), tmp_path / "local")
    _same_model(tmp_path / "bounded", tmp_path / "local")
