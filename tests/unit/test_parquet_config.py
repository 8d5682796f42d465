"""data=petastorm as a user configures it: composition, the driver's checks, and the prepare command."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from hydra.errors import ConfigCompositionException

from dtf.config.typed import typed
from dtf.data import prepare
from dtf.data.parquet import data as parquet
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.preflight import validate
from tests.helpers.inprocess import compose
from tests.helpers.parquet_files import write_skewed


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_skewed(tmp_path_factory.mktemp("skewed") / "train")


def test_petastorm_option_composes_validates_and_overrides_an_experiment(skewed: Path) -> None:
    cfg = compose("data=petastorm", f"data.path={skewed}", "data.feature_columns=[features,x]", "data.remainder=pad")
    validate(cfg)
    assert (cfg.data.path, list(cfg.data.feature_columns), cfg.data.remainder.value) == (
        str(skewed),
        ["features", "x"],
        "pad",
    )
    cnn = compose("+experiment=digits_cnn", "data=petastorm", f"data.path={skewed}")
    assert cnn.model._target_.endswith("MnistCNN") and cnn.data.path == str(skewed)


@pytest.mark.parametrize(
    ("overrides", "start"),
    [
        ([], "data.path is not set"),
        (["data.path=/no/such/dir"], "data.path=/no/such/dir does not exist"),
        (["data.path={skewed}", "data.label_column=y"], "data.label_column: column 'y' is not in"),
        (["data.path={skewed}", "data.feature_columns=[features,z]"], "data.feature_columns: column 'z'"),
        (["data.path={skewed}", "data.test_path={skewed}/part-00009.parquet"], "data.test_path="),
        (["data.path={skewed}", "data.workers_count=0"], "data.workers_count=0 is invalid"),
        (["data.path={skewed}", "data.transform={{_target_:no.such.fn}}"], "data.transform._target_=no.such.fn"),
        (["data.path={skewed}", "data.feature_dtype=int8"], "data.feature_dtype=int8 is invalid: use auto"),
        (
            ["data.path={skewed}", "data.transform=[{{_target_:dtf.data.transforms.Scale,div:255}}]"],
            "data.transform[0].div is not a parameter of dtf.data.transforms.Scale",
        ),
        (["data.path={skewed}", "data.filters=[[label,'=',1]]"], "data.filters: 'label' is not a partition column"),
        (["data.path={skewed}", "data.test_filters=[[split,'=',test]]"], "data.test_filters: 'split' is not a"),
        (["data.path={skewed}", "data.filters=[label]"], "data.filters=['label'] is not a list of [column, op"),
        (
            ["data.path={skewed}", "data.cache_limit_gb=5"],
            "data.cache_limit_gb=5.0 is invalid: it bounds data.cache_dir",
        ),
        (
            ["data.path=s3://b/x", "data.cache_dir=/tmp/c", "data.cache_limit_gb=0"],
            "data.cache_limit_gb=0.0 is invalid: use a size in GiB above 0",
        ),
        (["data.path={skewed}", "data.cache_dir=/tmp/c"], "data.cache_dir=/tmp/c keeps remote files on local disk"),
        # no gcsfs here or on CI: the line names the package to install
        (["data.path=gs://bucket/x"], "data.path=gs://bucket/x: no file system for gs:// is installed"),
        (["data.path=nosuch://bucket/x"], "data.path=nosuch://bucket/x: fsspec knows no scheme nosuch://"),
        # 1021 rows: enough for 2 ranks of 500, not for 3 (the world size comes from the launcher)
        (["data.path={skewed}", "data.batch_size=500", "launcher.nproc=3"], "data.path=file://"),
    ],
)
def test_the_driver_refuses_bad_settings_in_one_line_naming_the_key(
    skewed: Path, overrides: list[str], start: str
) -> None:
    cfg = compose("data=petastorm", *(o.format(skewed=skewed) for o in overrides))
    with pytest.raises(UserError) as err:
        validate(cfg)
    assert str(err.value).startswith(start) and "\n" not in str(err.value)


def test_driver_accepts_what_fits_the_world_size(skewed: Path) -> None:
    validate(compose("data=petastorm", f"data.path={skewed}", "data.batch_size=500", "launcher.nproc=2"))


def test_options_outside_the_choices_fail_at_composition() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose("data=petastorm", "data.remainder=keep")
    assert "drop" in str(err.value.__cause__) and "pad" in str(err.value.__cause__)


def test_prepare_writes_parquet_that_trains_like_the_in_memory_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = prepare.main(["digits", "--out", str(tmp_path), "--rows-per-group", "300", "--set", "test_fraction=0.5"])
    assert code == 0
    out = capsys.readouterr().out
    assert f"data=parquet data.path={tmp_path}/digits/parquet/train" in out
    # the printed command trains as it is (the digits need the CNN experiment that reads them)
    command = next(line for line in out.splitlines() if line.startswith("train on it: ")).removeprefix("train on it: ")
    import shlex

    from tests.helpers.run_command import run_dtf

    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "dtf"]
    run_dtf([*argv[3:], "trainer.max_steps=2", "launcher.nproc=1"], tmp_path / "run")
    train = tmp_path / "digits" / "parquet" / "train" / "part-00000.parquet"
    meta = pq.ParquetFile(train).metadata
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert sizes == [300, 300, 299] and sum(sizes) == 899  # 1797 - round(1797 * 0.5)
    assert json.loads(pq.read_schema(train).metadata[b"dtf.shapes"]) == {"features": [1, 28, 28]}
    cfg = compose("data=petastorm", f"data.path={train.parent}", f"data.test_path={train.parent.parent / 'test'}")
    data, test = parquet.build(typed(cfg).data, DistEnv(0, 1, 0, torch.device("cpu")), seed=0)
    x, y = next(iter(data))
    assert x.shape == (32, 1, 28, 28) and y.dtype == torch.int64 and test is not None


def test_prepare_refuses_an_unknown_builder_parameter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert prepare.main(["digits", "--out", str(tmp_path), "--set", "num_points=5"]) == 2
    assert "num_points is not a parameter of the digits data set" in capsys.readouterr().err


@pytest.mark.slow
def test_prepare_writes_a_petastorm_dataset_that_make_reader_reads_like_the_parquet_copy(tmp_path: Path) -> None:
    # Spark (local[2]) writes it through materialize_dataset, in Petastorm's own environment.
    from tests.helpers.side_venv import side_python

    side_python("petastorm")
    args = ["scalar_field", "--out", str(tmp_path), "--format", "both", "--rows-per-group", "250"]
    assert prepare.main([*args, "--set", "num_points=1200", "--set", "num_test=200"]) == 0
    batches = {}
    for fmt in ("parquet", "petastorm"):
        base = tmp_path / "scalar_field" / fmt
        cfg = compose(
            "data=petastorm",
            f"data.path={base / 'train'}",
            f"data.test_path={base / 'test'}",
            "data.shuffle_rows=false",
            "data.shuffle_row_groups=false",
        )
        data, _ = parquet.build(typed(cfg).data, DistEnv(0, 1, 0, torch.device("cpu")), seed=0)
        assert data.stream.reader.row_reader == (fmt == "petastorm")  # make_reader for the Unischema dataset
        batches[fmt] = list(data)
    assert (tmp_path / "scalar_field" / "petastorm" / "train" / "_common_metadata").exists()
    assert len(batches["parquet"]) == len(batches["petastorm"]) == 1000 // 32
    for (a, b), (c, d) in zip(batches["parquet"], batches["petastorm"], strict=True):
        assert a.shape == c.shape == (32, 2) and b.shape == d.shape == (32, 1)
        assert torch.equal(a, c) and torch.equal(b, d)


def test_workers_count_auto_takes_a_second_worker_only_where_a_codec_decodes(skewed: Path) -> None:
    """auto: 1 worker for columns read as stored (benchmarks/data.py: a second thread only contends
    for the GIL there), 2 where a Petastorm codec decodes images or arrays (OpenCV, zlib: no GIL)."""
    from types import SimpleNamespace

    from dtf.data.parquet.petastorm_format import Codec, PetastormField, Unischema

    def field(name: str, codec: Codec | None) -> PetastormField:
        return PetastormField(name, None, (), codec, False)

    schema = Unischema(
        "s",
        {
            "image": field("image", Codec("image", image_format="png")),
            "label": field("label", Codec("scalar", spark_type="IntegerType")),
            "raw": field("raw", None),
        },
    )
    src = SimpleNamespace(unischema=schema)
    assert parquet._workers("auto", src, ["image"], row_reader=True) == 2  # type: ignore[arg-type]
    assert parquet._workers("auto", src, ["label", "raw"], row_reader=True) == 1  # type: ignore[arg-type]
    assert parquet._workers("auto", src, ["image"], row_reader=False) == 1  # type: ignore[arg-type]
    assert parquet._workers(3, src, ["label"], row_reader=True) == 3  # type: ignore[arg-type]
    train, _ = parquet.build(
        compose("data=parquet", f"data.path={skewed}").data, DistEnv(0, 1, 0, torch.device("cpu")), 0
    )
    assert train.stream.reader.workers_count == 1  # type: ignore[attr-defined]
    with pytest.raises(UserError, match=r"data\.workers_count=0 is invalid: use auto or 1 or more"):
        typed(compose("data=parquet", f"data.path={skewed}", "data.workers_count=0"))
