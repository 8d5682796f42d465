"""Petastorm's format read without Petastorm: what the Unischema's pickle may and may not do.

The schemas here are pickled from stand-in classes under Petastorm's module and class names (real
Petastorm cannot be imported beside this venv's pyarrow); datasets written by Petastorm itself, and
its own readers' values, are the ground truth of tests/e2e/test_petastorm.py."""

from __future__ import annotations

import builtins
import json
import pickle
import sys
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dtf.config.schema import PetastormDataConfig
from dtf.data.parquet import data as parquet
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from tests.helpers.parquet_files import write_row_groups

UNISCHEMA_KEY = b"dataset-toolkit.unischema.v1"  # petastorm.etl.dataset_metadata's keys
ROW_GROUPS_KEY = b"dataset-toolkit.num_row_groups_per_file.v1"


class Unischema:
    def __init__(self, name: str, fields: list[Any]) -> None:
        self._name = name
        self._fields = OrderedDict((f.name, f) for f in fields)


class UnischemaField(NamedTuple):
    name: str
    numpy_dtype: Any
    shape: tuple[Any, ...]
    codec: Any
    nullable: bool = False


class ScalarCodec:
    def __init__(self, spark_type: Any) -> None:
        self._spark_type = spark_type


class NdarrayCodec:
    pass


class CompressedImageCodec:
    def __init__(self, image_codec: str = "png", quality: int = 80) -> None:
        self._image_codec, self._quality = "." + image_codec, quality


class IntegerType:
    pass


class FancyCodec:  # a codec of a user's own, as a team's ETL code may have subclassed
    def __init__(self) -> None:
        self.level = 3


@pytest.fixture
def petastorm_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-ins above, pickled under Petastorm's (and Spark's) names."""
    homes = {
        "petastorm.unischema": [Unischema, UnischemaField],
        "petastorm.codecs": [ScalarCodec, NdarrayCodec, CompressedImageCodec],
        "pyspark.sql.types": [IntegerType],
        "mycompany.codecs": [FancyCodec],
    }
    for module_name, classes in homes.items():
        parts = module_name.split(".")
        for k in range(1, len(parts)):  # pickle imports the module: its packages too
            monkeypatch.setitem(sys.modules, ".".join(parts[:k]), types.ModuleType(".".join(parts[:k])))
        module = types.ModuleType(module_name)
        for cls in classes:
            monkeypatch.setattr(cls, "__module__", module_name)
            setattr(module, cls.__name__, cls)
        monkeypatch.setitem(sys.modules, module_name, module)


def schema(*extra: Any) -> Unischema:
    return Unischema(
        "Rows",
        [
            UnischemaField("features", np.float32, (2,), NdarrayCodec()),
            UnischemaField("label", np.int64, (), ScalarCodec(IntegerType())),
            UnischemaField("image", np.uint8, (4, 4, 3), CompressedImageCodec("jpeg", 90)),
            *extra,
        ],
    )


def with_metadata(directory: Path, metadata: dict[bytes, bytes]) -> Path:
    """Petastorm's _common_metadata beside the files: the Arrow schema with the dataset's keys."""
    files = sorted(p.name for p in directory.glob("*.parquet"))
    counts = {name: pq.ParquetFile(directory / name).metadata.num_row_groups for name in files}
    arrow_schema = pq.read_schema(directory / files[0]).with_metadata(
        {ROW_GROUPS_KEY: json.dumps(counts).encode(), **metadata}
    )
    pq.write_metadata(arrow_schema, directory / "_common_metadata")
    return directory


def build(path: Path, **settings: Any) -> Any:
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return parquet.build(PetastormDataConfig(path=str(path), batch_size=4, **settings), env, seed=0)


class RunsCode:
    """What a crafted pickle does: call builtins.exec, which Petastorm's unpickler admits (it allows
    the whole `builtins` package)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def test_a_crafted_unischema_runs_nothing_and_is_refused_naming_the_file(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = with_metadata(
        write_row_groups(tmp_path / "data", [[10, 10]]), {UNISCHEMA_KEY: pickle.dumps(RunsCode(marker))}
    )
    with pytest.raises(UserError) as err:
        build(path)
    assert not marker.exists(), "the pickle's code ran"
    message = str(err.value)
    assert "\n" not in message and f"{path}/_common_metadata" in message and "builtins.exec" in message, message
    assert "nothing in the file ran" in message


def test_other_pickles_than_a_unischema_are_refused(tmp_path: Path, petastorm_names: None) -> None:
    base = write_row_groups(tmp_path / "data", [[10]])
    for i, raw in enumerate([pickle.dumps({"fields": []}), pickle.dumps(np.float32), b"\x80\x04not a pickle"]):
        path = with_metadata(base, {UNISCHEMA_KEY: raw})
        with pytest.raises(UserError, match=r"_common_metadata holds a Petastorm schema dtf does not read"):
            build(path)
        (path / "_common_metadata").unlink()
        assert i >= 0


@pytest.mark.parametrize("protocol", range(6))
def test_the_schema_is_read_from_every_pickle_protocol(tmp_path: Path, petastorm_names: None, protocol: int) -> None:
    from dtf.data.parquet.petastorm_format import read_unischema

    read = read_unischema(pickle.dumps(schema(), protocol=protocol))
    assert read.name == "Rows" and list(read.fields) == ["features", "label", "image"]
    features, label, image = read.fields.values()
    assert (features.numpy_type, features.shape, features.codec and features.codec.kind) == (
        np.float32,
        (2,),
        "ndarray",
    )
    assert label.codec is not None and (label.codec.kind, label.codec.spark_type) == ("scalar", "IntegerType")
    assert image.codec is not None and (image.codec.kind, image.codec.image_format) == ("image", "jpeg")
    assert image.fixed_shape == (4, 4, 3)


def test_a_codec_dtf_does_not_know_is_named_when_its_column_is_used(tmp_path: Path, petastorm_names: None) -> None:
    base = write_row_groups(tmp_path / "data", [[10, 6]])
    fancy = UnischemaField("x", np.float32, (), FancyCodec())
    path = with_metadata(base, {UNISCHEMA_KEY: pickle.dumps(schema(fancy, UnischemaField("name", np.str_, (), None)))})
    build(path)  # the features and label columns are still readable
    with pytest.raises(UserError) as err:
        build(path, feature_columns=["x"])
    message = str(err.value)
    assert message.startswith("data.feature_columns: column 'x' is encoded by mycompany.codecs.FancyCodec")
    assert "a codec dtf does not know" in message and "\n" not in message


def test_a_data_set_without_a_unischema_in_its_common_metadata_is_plain_parquet(tmp_path: Path) -> None:
    # pyarrow's (or Dask's) summary file: no Petastorm keys at all. Petastorm raised PetastormMetadataError here.
    path = write_row_groups(tmp_path / "data", [[10, 10]])
    pq.write_metadata(pq.read_schema(path / "part-00000.parquet"), path / "_common_metadata")
    data, _ = build(path)
    data.set_epoch(0)
    assert sum(len(y) for _, y in data) == 20


def test_no_module_of_dtf_imports_petastorm() -> None:
    """Petastorm cannot import beside a current Arrow: only the writer that runs in its own environment names it."""
    import ast

    import dtf

    root = Path(dtf.__file__).parent
    importers = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "petastorm" or n.startswith("petastorm.") for n in names):
                importers.append(str(f.relative_to(root)))
    assert set(importers) <= {"data/petastorm_writer.py"}, importers
    assert "petastorm" not in sys.modules


def test_arrow_list_columns_in_a_petastorm_dataset_without_codec_are_cast_per_row(tmp_path: Path) -> None:
    from dtf.data.parquet.petastorm_format import PetastormField, decode

    field = PetastormField("v", np.float32, (None,), None, False)
    column = pa.array([[1.5, 2.25], [3.0, 4.0]], pa.list_(pa.float64()))
    got = decode(field, column)
    assert got.dtype == np.float32 and got.tolist() == [[1.5, 2.25], [3.0, 4.0]]


def test_ndarray_values_decode_as_numpy_loads_them_also_when_headers_differ() -> None:
    import io

    from dtf.data.parquet.petastorm_format import PetastormField, decode

    def npy(a: np.ndarray) -> bytes:
        buffer = io.BytesIO()
        np.save(buffer, a)
        return buffer.getvalue()

    rng = np.random.default_rng(0)
    same = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(5)]
    field = PetastormField("a", np.float32, (3, 2), None, False)
    from dtf.data.parquet.petastorm_format import Codec

    field = PetastormField("a", np.float32, (3, 2), Codec("ndarray"), False)
    for binary in (pa.binary(), pa.large_binary()):
        got = decode(field, pa.array([npy(a) for a in same], binary).slice(1, 3))  # a slice: offsets not at 0
        assert np.array_equal(got, np.stack(same[1:4])) and got.dtype == np.float32
    fortran = np.asfortranarray(rng.normal(size=(3, 2)))
    mixed = [npy(same[0]), npy(fortran.astype(np.float32)), npy(same[1].astype(">f4"))]
    got = decode(field, pa.array(mixed, pa.binary()))
    expected = [np.load(io.BytesIO(v)) for v in mixed]
    assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))
    ragged = decode(field, pa.array([npy(np.zeros((1, 2), np.float32)), npy(np.zeros((2, 2), np.float32))]))
    assert ragged.dtype == object and [v.shape for v in ragged] == [(1, 2), (2, 2)]
