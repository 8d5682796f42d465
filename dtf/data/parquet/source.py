"""What a Parquet data set holds, from its metadata only: row groups, their row counts, columns.

The driver uses it to refuse bad settings before any rank starts; every rank uses it to
plan its epochs. Row groups are listed the way Petastorm's Reader lists them
(`load_row_groups`), so a plan's row-group indices are the Reader's piece indices.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from pyarrow.filesystem import DaskFileSystem
from pyarrow.filesystem import FileSystem as LegacyFileSystem

from dtf.config.schema import PetastormDataConfig
from dtf.errors import UserError

# Written by `python -m dtf.data.prepare` into plain Parquet: the per-row shape of array
# columns, which Parquet's flat list<float> cannot hold (e.g. images 1x28x28).
SHAPES_KEY = b"dtf.shapes"


def quiet_petastorm() -> None:
    """Petastorm 0.12 runs on pyarrow's legacy dataset API, which warns on every call, and logs at INFO
    that plain Parquet has no Petastorm metadata: nothing a user can act on."""
    logging.getLogger("petastorm").setLevel(logging.WARNING)
    for module in (r"petastorm(\..*)?", r"pyarrow(\..*)?", r"dtf\.data\..*"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    warnings.filterwarnings("ignore", message=r"Column .* has an unsupported field", module=r"petastorm\..*")


def to_url(path: str) -> str:
    """Petastorm wants a URL: a plain local path becomes file://<absolute path>."""
    if "://" in path:
        return path.rstrip("/")
    return "file://" + os.path.abspath(os.path.expanduser(path))


def resolve(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """(filesystem, path) of a URL, as Petastorm resolves it, in a form pyarrow 14's legacy
    ParquetDataset (which Petastorm 0.12 uses) accepts for every scheme."""
    from petastorm.fs_utils import get_filesystem_and_path_or_paths

    fs, path = get_filesystem_and_path_or_paths(url, storage_options=dict(storage_options or {}))
    if not isinstance(fs, LegacyFileSystem):
        # An fsspec filesystem (s3://, gs://, memory://, ...): given to ParquetDataset as it is, pyarrow
        # 14 takes its new Dataset API, which refuses Petastorm's validate_schema argument.
        fs = LegacyFsspec(fs)
    return fs, path


class LegacyFsspec(DaskFileSystem):
    """pyarrow's legacy wrapper of an fsspec filesystem, with the two queries it leaves unimplemented."""

    def __init__(self, fs: Any) -> None:  # DaskFileSystem's own __init__ only adds a deprecation warning
        self.fs = fs

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def isfile(self, path: str) -> bool:
        return bool(self.fs.isfile(path))


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


# Filter operators pyarrow's (legacy) ParquetDataset applies to partition values.
FILTER_OPS = ("=", "==", "!=", "<", ">", "<=", ">=", "in", "not in")

IMAGE_FIX = "pip install opencv-python-headless"


@dataclass(frozen=True)
class ParquetSource:
    """A Parquet data set as its row groups ("pieces", in Petastorm's order) and its columns."""

    url: str
    key: str  # the config key that named it, for messages
    pieces: tuple[tuple[str, int], ...]  # (file path, row group index in the file)
    piece_rows: tuple[int, ...]
    column_types: Mapping[str, str]  # every column (partition columns too), with its Arrow type
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # per-row shape of array columns
    has_unischema: bool = False  # written by Petastorm's materialize_dataset (codecs, shapes)
    # The fields Petastorm's workers read: the dataset's own Unischema, or one inferred from the
    # schemas of all its files (Spark ML vectors included, as float arrays).
    unischema: Any = field(default=None, compare=False, repr=False)
    problems: Mapping[str, str] = field(default_factory=dict)  # column -> why it cannot be read
    images: Mapping[str, str] = field(default_factory=dict)  # column -> image format (CompressedImageCodec)
    filters: tuple[tuple[tuple[str, str, Any], ...], ...] | None = None  # DNF on partition columns

    @property
    def num_rows(self) -> int:
        return sum(self.piece_rows)

    def describe(self) -> str:
        return f"{self.num_rows} rows in {len(self.pieces)} row groups"

    def fingerprint(self) -> str:
        """Short, and equal exactly when two ranks would plan alike (same row-group sizes in the same order)."""
        digest = hashlib.sha256(repr(self.piece_rows).encode()).hexdigest()[:12]
        return f"{self.describe()} ({digest})"

    def require_columns(self, key: str, names: list[str]) -> None:
        for name in names:
            if name not in self.column_types:
                listed = ", ".join(self.column_types) or "none"
                raise UserError(
                    f"{key}: column {name!r} is not in {self.key}={self.url} (its columns: {listed}); "
                    f"fix the name in {key}"
                )
            if name in self.problems:
                raise UserError(f"{key}: column {name!r} {self.problems[name]}")

    def require_image_decoder(self, key: str, names: list[str]) -> None:
        """Petastorm decodes png/jpeg fields with OpenCV, imported only if present: without it every
        read fails deep in a worker. Checked where the run starts instead."""
        for name in names:
            if name in self.images:
                try:
                    import cv2  # noqa: F401
                except ImportError as e:
                    raise UserError(
                        f"{key}: column {name!r} holds {self.images[name]} images (Petastorm's CompressedImageCodec), "
                        f"which need OpenCV ({first_line(e)}): {IMAGE_FIX}"
                    ) from None

    def require_rows(self, world_size: int, batch_size: int) -> None:
        needed = world_size * batch_size
        if self.num_rows < needed:
            raise UserError(
                f"{self.key}={self.url} has {self.num_rows} rows, fewer than world size x data.batch_size = "
                f"{world_size} x {batch_size} = {needed}: every rank needs a full batch; "
                "lower data.batch_size, start fewer ranks, or add rows"
            )


def _footers(fs: Any, paths: list[str], key: str, url: str) -> dict[str, Any]:
    """Each file's Parquet footer; a file that has none (empty, truncated, not Parquet) is named."""
    import pyarrow.parquet as pq

    def read(path: str) -> Any:
        try:
            with fs.open(path, "rb") as f:
                return pq.ParquetFile(f).metadata
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... depending on the damage
            raise UserError(f"{key}={url}: {path} is not a readable Parquet file ({first_line(e)})") from None

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(paths)))) as pool:
        return dict(zip(paths, pool.map(read, paths), strict=True))


def is_vector(kind: Any) -> bool:
    """A Spark ML vector (VectorUDT) as Parquet stores it: struct<type: int8, size: int32,
    indices: list<int32>, values: list<double>>; type 1 = dense (values only), 0 = sparse."""
    import pyarrow as pa

    return bool(pa.types.is_struct(kind)) and sorted(f.name for f in kind) == ["indices", "size", "type", "values"]


def _kind(kind: Any) -> str:
    """What a column holds, whatever its width: files may differ in width (int32/int64,
    float32/float64), every batch is cast to one dtype anyway; they may not differ in kind."""
    import pyarrow as pa

    if is_vector(kind):
        return "vector"
    if pa.types.is_dictionary(kind):
        return _kind(kind.value_type)
    if pa.types.is_integer(kind):
        return "integer"
    if pa.types.is_floating(kind):
        return "float"
    if pa.types.is_boolean(kind):
        return "bool"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "string"
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return f"list<{_kind(kind.value_type)}>"
    return str(kind)


# Kinds Petastorm's batch reader reads and dtf turns into arrays (strings fail when read, with a reason).
_READABLE = {"integer", "float", "bool", "string", "vector", "list<integer>", "list<float>", "list<bool>"}


def _numpy_type(kind: Any) -> Any:
    import numpy as np
    import pyarrow as pa

    if is_vector(kind):
        return np.float64
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_dictionary(kind):
        return _numpy_type(kind.value_type)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return np.str_
    return kind.to_pandas_dtype()


@dataclass
class _Columns:
    """The columns of all files with rows, as one schema: per column its widest type, or why not."""

    types: dict[str, Any] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)


def _unified_columns(footers: Mapping[str, Any]) -> _Columns:
    """Petastorm infers the columns from the first file alone, so a 0-row file that sorts first
    (pandas writes an empty list column as type null) hides columns that are there. Here files
    without rows are left out and the others must agree on each column's kind (widths may differ)."""
    import pyarrow as pa

    with_rows = [path for path, meta in footers.items() if meta.num_rows > 0] or list(footers)
    schemas = {path: footers[path].schema.to_arrow_schema() for path in with_rows}
    out = _Columns()
    first: dict[str, tuple[str, Any]] = {}  # column -> (first file, its type there)
    for path, schema in schemas.items():
        for f in schema:
            if pa.types.is_null(f.type):
                continue  # all values null: the read refuses it with a reason if it is used
            if f.name not in first:
                first[f.name] = (path, f.type)
                out.types[f.name] = f.type
                continue
            where, kind = first[f.name]
            if _kind(f.type) != _kind(kind):
                out.problems.setdefault(
                    f.name,
                    f"is {kind} in {where} but {f.type} in {path}: rewrite the files that disagree with one type",
                )
            elif _width(f.type) > _width(out.types[f.name]):
                out.types[f.name] = f.type
    names = {path: set(schema.names) for path, schema in schemas.items()}
    for name, (where, _) in first.items():
        lacking = next((path for path in with_rows if name not in names[path]), None)
        if lacking is not None:
            out.problems.setdefault(name, f"is in {where} but not in {lacking}: every file with rows needs it")
    return out


def _width(kind: Any) -> int:
    import pyarrow as pa

    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _width(kind.value_type)
    try:
        return int(kind.bit_width)
    except ValueError:  # no fixed width (strings, structs)
        return 0


def _dnf(filters: Any, key: str) -> tuple[tuple[tuple[str, str, Any], ...], ...] | None:
    """data.filters in pyarrow's DNF: [[col, op, value], ...] (one conjunction) or a list of those (OR)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(filters) if OmegaConf.is_config(filters) else filters
    if not raw:
        return None
    if not isinstance(raw, list) or not all(isinstance(c, list) and c for c in raw):
        raise UserError(f"{key}={raw} is not a list of [column, op, value] triples: e.g. {key}=[[split,'=',train]]")
    conjunctions = [raw] if isinstance(raw[0][0], str) else raw
    out = []
    for conjunction in conjunctions:
        triples = []
        for triple in conjunction:
            if not (isinstance(triple, list) and len(triple) == 3 and isinstance(triple[0], str)):
                raise UserError(f"{key}: {triple} is not a [column, op, value] triple: e.g. {key}=[[split,'=',train]]")
            column, op, value = triple
            if op not in FILTER_OPS:
                raise UserError(f"{key}: operator {op!r} in {triple} is not one of {', '.join(FILTER_OPS)}")
            triples.append((column, op, tuple(value) if isinstance(value, list) else value))
        out.append(tuple(triples))
    return tuple(out)


def _partition_types(dataset: Any) -> dict[str, str]:
    """Hive partition columns (root/split=train/...) as pyarrow's legacy dataset types them."""
    return {p.name: "int64" if str(p.dictionary.type) == "int64" else "string" for p in (dataset.partitions or [])}


def inspect(
    path: str,
    key: str = "data.path",
    storage_options: Mapping[str, Any] | None = None,
    filters: Any = None,
    filters_key: str = "data.filters",
) -> ParquetSource:
    """Lists the row groups and columns of the Parquet file or directory at path (a URL or a local
    path), of the partitions that filters keep."""
    quiet_petastorm()
    import pyarrow.parquet as pq
    from petastorm.codecs import CompressedImageCodec
    from petastorm.etl.dataset_metadata import PetastormMetadataError, get_schema, load_row_groups
    from petastorm.unischema import Unischema, UnischemaField

    url = to_url(path)
    parsed = urlparse(url)
    if parsed.scheme == "file" and not os.path.exists(parsed.path):
        raise UserError(f"{key}={path} does not exist: give the path of a Parquet file or directory")
    dnf = _dnf(filters, filters_key)
    try:
        fs, fs_path = resolve(url, storage_options)
        dataset = pq.ParquetDataset(fs_path, filesystem=fs, validate_schema=False, metadata_nthreads=10)
    except Exception as e:
        raise UserError(f"{key}={url} cannot be opened as a Parquet data set ({first_line(e)})") from None
    partitions = _partition_types(dataset)
    if dnf is not None:
        _check_filters(dnf, partitions, filters_key, key, url)
        try:
            dataset = open_dataset(fs, fs_path, dnf)
        except (TypeError, ValueError) as e:
            raise UserError(
                f"{filters_key}={_show(filters)} cannot be applied to {key}={url} ({first_line(e)})"
            ) from None
    files = sorted({piece.path for piece in dataset.pieces})
    if not files and dnf is not None:
        raise UserError(
            f"{filters_key}={_show(filters)} leave no rows in {key}={url}: its partitions are "
            f"{', '.join(partitions) or 'none'}; check the names and values"
        )
    if not files:
        raise UserError(f"{key}={url} holds no Parquet files: write the data there first (python -m dtf.data.prepare)")
    footers = _footers(dataset.fs, files, key, url)
    pieces = load_row_groups(dataset)
    piece_rows = tuple(footers[p.path].row_group(p.row_group).num_rows for p in pieces)
    columns = _unified_columns(footers)
    column_types = {name: str(kind) for name, kind in columns.types.items()}
    column_types.update(partitions)
    problems = dict(columns.problems)
    images: dict[str, str] = {}
    try:
        unischema, has_unischema = get_schema(dataset), True
    except PetastormMetadataError:
        unischema, has_unischema = None, False
    if has_unischema:
        shapes = {name: tuple(f.shape) for name, f in unischema.fields.items() if f.shape and None not in f.shape}
        images = {
            name: f.codec.image_codec
            for name, f in unischema.fields.items()
            if isinstance(f.codec, CompressedImageCodec)
        }
        for name in column_types:
            if name not in unischema.fields:
                problems.setdefault(name, f"is not in the Unischema of the Petastorm dataset {key}={url}")
    else:
        raw = next((footers[f].metadata[SHAPES_KEY] for f in files if SHAPES_KEY in (footers[f].metadata or {})), None)
        shapes = {name: tuple(shape) for name, shape in json.loads(raw).items()} if raw else {}
        fields = [UnischemaField(name, _partition_numpy(t), (), None, False) for name, t in partitions.items()]
        for name, kind in columns.types.items():
            if name in partitions:
                continue
            if _kind(kind) not in _READABLE:
                problems.setdefault(
                    name, f"has type {kind}: dtf reads numbers, lists of numbers and Spark ML vectors only"
                )
                continue
            shape = (None,) if _kind(kind).startswith("list") or is_vector(kind) else ()
            fields.append(UnischemaField(name, _numpy_type(kind), shape, None, True))
        unischema = Unischema("inferred_schema", fields)
    return ParquetSource(
        url=url,
        key=key,
        pieces=tuple((p.path, p.row_group) for p in pieces),
        piece_rows=piece_rows,
        column_types=column_types,
        shapes=shapes,
        has_unischema=has_unischema,
        unischema=unischema,
        problems=problems,
        images=images,
        filters=dnf,
    )


def _partition_numpy(kind: str) -> Any:
    import numpy as np

    return np.int64 if kind == "int64" else np.str_


def _show(filters: Any) -> str:
    from omegaconf import OmegaConf

    return str(OmegaConf.to_container(filters) if OmegaConf.is_config(filters) else filters)


def _check_filters(dnf: Any, partitions: Mapping[str, str], filters_key: str, key: str, url: str) -> None:
    """Only whole partitions: the equal-batches plan counts rows from row-group metadata, which a
    filter on row values would make wrong (and pyarrow's legacy reader ignores such filters)."""
    for conjunction in dnf:
        for column, _, _ in conjunction:
            if column not in partitions:
                raise UserError(
                    f"{filters_key}: {column!r} is not a partition column of {key}={url} "
                    f"(its partition columns: {', '.join(partitions) or 'none'}); dtf filters whole partitions "
                    "only, since it counts rows from the files' metadata: filter rows before writing, or write "
                    "the data partitioned by that column (partitionBy)"
                )


def open_dataset(fs: Any, path: str, filters: Any = None) -> Any:
    """pyarrow's legacy ParquetDataset (what Petastorm 0.12 reads through), with partition filters."""
    import pyarrow.parquet as pq

    return pq.ParquetDataset(
        path,
        filesystem=fs,
        validate_schema=False,
        metadata_nthreads=10,
        filters=[list(c) for c in filters] if filters else None,
    )


def open_sources(data: PetastormDataConfig, world_size: int | None) -> tuple[ParquetSource, ParquetSource | None]:
    """The train and test sources of a `data=petastorm` config, checked against its settings:
    files readable, columns present, a full batch for every rank (when world_size is known).

    The test data are data.test_path with data.test_filters, or, with only data.test_filters set,
    data.path with data.test_filters (one Hive-partitioned root for train and test)."""
    storage = dict(data.storage_options)
    features = list(data.feature_columns)
    train = inspect(data.path, "data.path", storage, data.filters, "data.filters")
    test_filters = data.test_filters
    test_path, test_key = (data.test_path, "data.test_path") if data.test_path else (data.path, "data.path")
    test = (
        inspect(test_path, test_key, storage, test_filters, "data.test_filters")
        if data.test_path or test_filters
        else None
    )
    for source in (train, test):
        if source is not None:
            source.require_columns("data.feature_columns", features)
            source.require_columns("data.label_column", [data.label_column])
            source.require_image_decoder("data.feature_columns", features)
            source.require_image_decoder("data.label_column", [data.label_column])
    if world_size is not None:
        train.require_rows(world_size, data.batch_size)
    if test is not None and test.num_rows == 0:
        raise UserError(f"{test.key}={test.url} has no rows: give a test set with rows, or data.test_path=null")
    return train, test
