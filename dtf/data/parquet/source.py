"""What a Parquet data set holds, from its metadata only: row groups, their row counts, columns.

The driver uses it to refuse bad settings before any rank starts; every rank uses it to plan its
epochs. Files are listed by pyarrow.dataset (Hive partitions, filters on them) and sorted by path,
each file's row groups in order: the order Petastorm's Reader listed them in, so a plan's
row-group indices (and the data order of a run) are what they were when dtf read through Petastorm.
A Petastorm dataset's Unischema is read from its `_common_metadata` without unpickling anything
but Petastorm's schema classes (dtf.data.parquet.petastorm_format).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse

from dtf import remote
from dtf.config.schema import ParquetDataConfig
from dtf.data.parquet.cache import FileCache
from dtf.data.parquet.petastorm_format import UNISCHEMA_KEY, SchemaRefused, Unischema, read_unischema
from dtf.errors import UserError
from dtf.remote import first_line

# Written by `python -m dtf.data.prepare` into plain Parquet: the per-row shape of array
# columns, which Parquet's flat list<float> cannot hold (e.g. images 1x28x28).
SHAPES_KEY = b"dtf.shapes"
COMMON_METADATA = "_common_metadata"


def to_url(path: str) -> str:
    """A plain local path becomes file://<absolute path>; a URL stays as it is."""
    if "://" in path:
        return path.rstrip("/")
    return "file://" + os.path.abspath(os.path.expanduser(path))


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None, key: str = "data.path") -> tuple[Any, str]:
    """(pyarrow filesystem, path) of a URL: local files directly, every other scheme (s3://,
    gs://, hdfs://, memory://, ...) through fsspec with data.storage_options (dtf.remote)."""
    import pyarrow.fs as pafs

    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return pafs.LocalFileSystem(), parsed.path if parsed.scheme else url
    fs, path = remote.filesystem(url, storage_options, key)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


# Filter operators of pyarrow's DNF filters (pyarrow.parquet.filters_to_expression).
FILTER_OPS = ("=", "==", "!=", "<", ">", "<=", ">=", "in", "not in")

IMAGE_FIX = "pip install opencv-python-headless"


@dataclass(frozen=True)
class ParquetSource:
    """A Parquet data set as its row groups ("pieces": files sorted by path, each file's row groups
    in order) and its columns."""

    url: str
    key: str  # the config key that named it, for messages
    pieces: tuple[tuple[str, int], ...]  # (file path, row group index in the file)
    piece_rows: tuple[int, ...]
    column_types: Mapping[str, str]  # every column (partition columns too), with its Arrow type
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # per-row shape of array columns
    # A Petastorm dataset's Unischema (codecs, shapes), as dtf describes it; None for plain Parquet.
    unischema: Unischema | None = field(default=None, compare=False, repr=False)
    problems: Mapping[str, str] = field(default_factory=dict)  # column -> why it cannot be read
    images: Mapping[str, str] = field(default_factory=dict)  # column -> image format (CompressedImageCodec)
    filters: tuple[tuple[tuple[str, str, Any], ...], ...] | None = None  # DNF on partition columns
    # Hive partition values of each file (root/split=train/...), the columns its rows get.
    partition_values: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False, repr=False)
    storage_options: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # Each file's Parquet footer, read once here: readers open the files without reading it again.
    footers: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The first row of each piece in its row group, where a piece is part of one (a split held
    # out for validation); empty: every piece is a whole row group.
    piece_starts: tuple[int, ...] = ()
    # Every file the listing found (those filters keep): a reading checks the data set still holds them.
    files: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # data.cache_dir: where the files of a remote data set are kept once read (None: read remotely each time).
    cache: FileCache | None = field(default=None, compare=False, repr=False)

    def start_of(self, piece: int) -> int:
        return self.piece_starts[piece] if self.piece_starts else 0

    def hold_out(self, fraction: float, seed: int, key: str) -> tuple[ParquetSource, ParquetSource]:
        """(the rest, the held-out rows): round(fraction x rows) rows, as whole row groups drawn in a
        seeded order and the first rows of one more. A pure function of the metadata and seed:
        the same split on any world size. Whole row groups, not rows drawn one by one, so that
        reading either split reads only its own row groups (and one shared)."""
        total = self.num_rows
        want = round(fraction * total)
        if not 0 < want < total:
            raise UserError(
                f"{key}={fraction} of the {total} rows of {self.key}={self.url} holds out {want}: leave at least "
                "one row on each side (a larger or smaller fraction)"
            )
        import numpy as np

        taken: dict[int, int] = {}  # piece -> rows held out (its first ones)
        left = want
        for piece in np.random.default_rng([seed % 2**63, 7]).permutation(len(self.pieces)).tolist():
            if left == 0:
                break
            held = min(self.piece_rows[piece], left)
            if held:
                taken[piece] = held
                left -= held
        rest = [(p, self.start_of(p) + taken.get(p, 0), n - taken.get(p, 0)) for p, n in enumerate(self.piece_rows)]
        held = [(p, self.start_of(p), taken[p]) for p in sorted(taken)]
        return self._subset([r for r in rest if r[2] > 0]), self._subset(held)

    def _subset(self, parts: list[tuple[int, int, int]]) -> ParquetSource:
        """The source of these (piece, first row, rows) parts of this one's pieces."""
        return dataclasses.replace(
            self,
            pieces=tuple(self.pieces[p] for p, _, _ in parts),
            piece_rows=tuple(n for _, _, n in parts),
            piece_starts=tuple(start for _, start, _ in parts),
        )

    @property
    def has_unischema(self) -> bool:
        """Written by Petastorm's materialize_dataset (codecs, shapes)."""
        return self.unischema is not None

    @property
    def num_rows(self) -> int:
        return sum(self.piece_rows)

    def describe(self) -> str:
        cached = f" ({self.cache.describe()})" if self.cache is not None else ""
        return f"{self.num_rows} rows in {len(self.pieces)} row groups{cached}"

    def fingerprint(self) -> str:
        """Short, and equal exactly when two ranks would plan alike (same row-group sizes in the same order)."""
        digest = hashlib.sha256(repr((self.piece_rows, self.piece_starts)).encode()).hexdigest()[:12]
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
            with fs.open_input_file(path) as f:
                return pq.read_metadata(f)
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


@dataclass
class _Columns:
    """The columns of all files with rows, as one schema: per column its widest type, or why not."""

    types: dict[str, Any] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)


def _unified_columns(footers: Mapping[str, Any]) -> _Columns:
    """The columns of all files: a 0-row file (pandas writes an empty list column as type null)
    would hide columns that are there, so files without rows are left out and the others must
    agree on each column's kind (widths may differ). Petastorm inferred them from the first file."""
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
    _check_list_lengths(footers, with_rows, out)
    return out


def _check_list_lengths(footers: Mapping[str, Any], paths: list[str], out: _Columns) -> None:
    """Files whose list column holds lists of another length (3 values a row in one file, 2 in
    another), found from the footers: a list of numbers is one leaf column, which holds rows x
    length numbers where every row holds one length. Otherwise only a reading would meet it, in the
    middle of a run and only where a chunk of steps spans both files."""
    import pyarrow as pa

    lists = {name for name, kind in out.types.items() if pa.types.is_list(kind) or pa.types.is_large_list(kind)}
    first: dict[str, tuple[str, int]] = {}  # column -> (first file, its lists' length)
    for path in paths:
        meta = footers[path]
        leaves = {meta.schema.column(j).path.split(".")[0]: j for j in range(meta.num_columns)}
        for name in sorted(lists - out.problems.keys()):
            if name not in leaves:
                continue
            values = sum(_values_in(meta.row_group(g).column(leaves[name])) for g in range(meta.num_row_groups))
            if meta.num_rows == 0 or values % meta.num_rows:
                continue  # lists of different lengths, or nulls: the reading refuses them, naming the column
            length = values // meta.num_rows
            where, expected = first.setdefault(name, (path, length))
            if length != expected:
                out.problems[name] = (
                    f"holds lists of {expected} values in {where} but of {length} in {path}: every row needs "
                    "one length; rewrite the files that disagree with lists of one length"
                )


def _values_in(chunk: Any) -> int:
    """The numbers a list column's chunk holds: its leaf slots but those of empty lists and nulls,
    which its statistics count as nulls."""
    stats = chunk.statistics
    return int(chunk.num_values) - (int(stats.null_count) if stats is not None and stats.has_null_count else 0)


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


def inspect(
    path: str,
    key: str = "data.path",
    storage_options: Mapping[str, Any] | None = None,
    filters: Any = None,
    filters_key: str = "data.filters",
) -> ParquetSource:
    """Lists the row groups and columns of the Parquet file or directory at path (a URL or a local
    path), of the partitions that filters keep."""
    url = to_url(path)
    parsed = urlparse(url)
    if parsed.scheme == "file" and not os.path.exists(parsed.path):
        raise UserError(f"{key}={path} does not exist: give the path of a Parquet file or directory")
    dnf = _dnf(filters, filters_key)
    try:
        fs, root = filesystem(url, storage_options, key)
        dataset = list_dataset(fs, root)
    except UserError:
        raise
    except Exception as e:
        if remote.is_remote(url):
            raise UserError(remote.explain(e, url, key, "listing the data set")) from None
        raise UserError(f"{key}={url} cannot be opened as a Parquet data set ({first_line(e)})") from None
    partitions = _partition_types(dataset)
    fragments = _fragments(dataset, dnf, partitions, filters, filters_key, key, url)
    files = sorted(f.path for f in fragments)
    if not files and dnf is not None:
        raise UserError(
            f"{filters_key}={_show(filters)} leave no rows in {key}={url}: its partitions are "
            f"{', '.join(partitions) or 'none'}; check the names and values"
        )
    if not files:
        raise UserError(f"{key}={url} holds no Parquet files: write the data there first (python -m dtf.data.prepare)")
    import pyarrow.dataset as ds

    partition_values = {f.path: ds.get_partition_keys(f.partition_expression) for f in fragments}
    footers = _footers(fs, files, key, url)
    pieces = tuple((path, g) for path in files for g in range(footers[path].num_row_groups))
    piece_rows = tuple(footers[path].row_group(g).num_rows for path, g in pieces)
    columns = _unified_columns(footers)
    column_types = {name: str(kind) for name, kind in columns.types.items()}
    column_types.update(partitions)
    problems = dict(columns.problems)
    images: dict[str, str] = {}
    unischema = _unischema(fs, root, key, url)
    if unischema is not None:
        shapes = {name: f.fixed_shape for name, f in unischema.fields.items() if f.fixed_shape}
        images = {
            name: f.codec.image_format or "png"
            for name, f in unischema.fields.items()
            if f.codec is not None and f.codec.kind == "image"
        }
        for name in column_types:
            if name not in unischema.fields:
                problems.setdefault(name, f"is not in the Unischema of the Petastorm dataset {key}={url}")
            elif unischema.fields[name].problem:
                problems.setdefault(name, str(unischema.fields[name].problem))
    else:
        raw = next((footers[f].metadata[SHAPES_KEY] for f in files if SHAPES_KEY in (footers[f].metadata or {})), None)
        shapes = {name: tuple(shape) for name, shape in json.loads(raw).items()} if raw else {}
        for name, kind in columns.types.items():
            if name not in partitions and _kind(kind) not in _READABLE:
                problems.setdefault(
                    name, f"has type {kind}: dtf reads numbers, lists of numbers and Spark ML vectors only"
                )
    return ParquetSource(
        url=url,
        key=key,
        pieces=pieces,
        piece_rows=piece_rows,
        column_types=column_types,
        shapes=shapes,
        unischema=unischema,
        problems=problems,
        images=images,
        filters=dnf,
        partition_values=partition_values,
        storage_options=dict(storage_options or {}),
        footers=footers,
        files=tuple(files),
    )


def list_dataset(fs: Any, root: str) -> Any:
    """The files of a Parquet file or directory, with their Hive partitions, as a pyarrow Dataset
    made without opening a file (a damaged one is named when its footer is read). Names starting
    with "." or "_" are not data (Spark's _SUCCESS and .crc files, _common_metadata)."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs

    kind = fs.get_file_info(root).type
    if kind == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{root} does not exist")
    if kind == pafs.FileType.File:
        factory = ds.FileSystemDatasetFactory(fs, [root], ds.ParquetFileFormat(), ds.FileSystemFactoryOptions())
        return factory.finish(schema=pa.schema([]))
    options = ds.FileSystemFactoryOptions(partition_base_dir=root, selector_ignore_prefixes=[".", "_"])
    selector = pafs.FileSelector(root, recursive=True)
    listed = ds.FileSystemDatasetFactory(fs, selector, ds.ParquetFileFormat(), options).finish(schema=pa.schema([]))
    paths = [f.path for f in listed.get_fragments()]
    schema = hive_schema(paths, root)
    if not len(schema):
        return listed
    options.partitioning = ds.HivePartitioning(schema)
    return ds.FileSystemDatasetFactory(fs, paths, ds.ParquetFileFormat(), options).finish(schema=schema)


def hive_schema(paths: list[str], root: str) -> Any:
    """The Hive partition columns of files under root (root/split=train/bucket=0/...): int64 where
    every value is an integer, else string. From the paths alone: pyarrow's own discovery (a
    dataset factory's inspect) reads every file's schema before pyarrow 19."""
    import pyarrow as pa

    values: dict[str, list[str]] = {}
    base = root.rstrip("/") + "/"
    for path in paths:
        for segment in path[len(base) :].split("/")[:-1] if path.startswith(base) else []:
            if "=" in segment:
                key, value = segment.split("=", 1)
                values.setdefault(key, []).append(unquote(value))
    return pa.schema(
        [(k, pa.int64() if all(_INTEGER.fullmatch(v) for v in vs) else pa.string()) for k, vs in values.items()]
    )


_INTEGER = re.compile(r"-?[0-9]+")


def _partition_types(dataset: Any) -> dict[str, str]:
    """Hive partition columns (root/split=train/...) as the listing typed them."""
    import pyarrow as pa

    return {f.name: "int64" if pa.types.is_integer(f.type) else "string" for f in dataset.schema}


def _fragments(
    dataset: Any, dnf: Any, partitions: Mapping[str, str], filters: Any, filters_key: str, key: str, url: str
) -> list[Any]:
    """The files the partition filters keep (all without filters)."""
    if dnf is None:
        return list(dataset.get_fragments())
    import pyarrow.parquet as pq

    _check_filters(dnf, partitions, filters_key, key, url)
    typed = [[(c, op, _as_partition_value(v, partitions[c])) for c, op, v in conj] for conj in dnf]
    try:
        return list(dataset.get_fragments(filter=pq.filters_to_expression(typed)))
    except Exception as e:  # a value of the wrong type for the column, an operator the values do not take
        raise UserError(f"{filters_key}={_show(filters)} cannot be applied to {key}={url} ({first_line(e)})") from None


def _as_partition_value(value: Any, kind: str) -> Any:
    """A filter value as the partition column holds it: [[bucket, '=', '0']] means bucket 0, as
    pyarrow's legacy dataset (and so Petastorm) read it."""
    if isinstance(value, tuple | list):
        return [_as_partition_value(v, kind) for v in value]
    if kind == "int64" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if kind == "string" and not isinstance(value, str):
        return str(value)
    return value


def _unischema(fs: Any, root: str, key: str, url: str) -> Unischema | None:
    """The Unischema in root/_common_metadata, if the data set is a Petastorm dataset."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    where = f"{root.rstrip('/')}/{COMMON_METADATA}"
    if fs.get_file_info(where).type != pafs.FileType.File:
        return None
    try:
        with fs.open_input_file(where) as f:
            metadata = pq.read_metadata(f).metadata or {}
    except Exception as e:
        raise UserError(f"{key}={url}: {where} is not a readable Parquet metadata file ({first_line(e)})") from None
    if UNISCHEMA_KEY not in metadata:
        return None  # summary metadata of plain Parquet (pyarrow's write_metadata, Dask)
    try:
        return read_unischema(metadata[UNISCHEMA_KEY])
    except SchemaRefused as e:
        raise UserError(
            f"{key}={url}: {where} holds a Petastorm schema dtf does not read ({e}); dtf unpickles only "
            "Petastorm's own schema classes, so nothing in the file ran: rewrite it with Petastorm's "
            "materialize_dataset, or delete it to read the files as plain Parquet"
        ) from None


def _show(filters: Any) -> str:
    from omegaconf import OmegaConf

    return str(OmegaConf.to_container(filters) if OmegaConf.is_config(filters) else filters)


def _check_filters(dnf: Any, partitions: Mapping[str, str], filters_key: str, key: str, url: str) -> None:
    """Only whole partitions: the equal-batches plan counts rows from row-group metadata, which a
    filter on row values would make wrong."""
    for conjunction in dnf:
        for column, _, _ in conjunction:
            if column not in partitions:
                raise UserError(
                    f"{filters_key}: {column!r} is not a partition column of {key}={url} "
                    f"(its partition columns: {', '.join(partitions) or 'none'}); dtf filters whole partitions "
                    "only, since it counts rows from the files' metadata: filter rows before writing, or write "
                    "the data partitioned by that column (partitionBy)"
                )


@dataclass(frozen=True)
class Sources:
    """The sources of a data=parquet run: training, and validation and test where given."""

    train: ParquetSource
    val: ParquetSource | None
    test: ParquetSource | None


def open_sources(data: ParquetDataConfig, world_size: int | None) -> Sources:
    """The sources of a `data=parquet` config, checked against its settings: files readable,
    columns present, a full batch for every rank (when world_size is known).

    The test data are data.test_path with data.test_filters, or, with only data.test_filters set,
    data.path with data.test_filters (one Hive-partitioned root for train and test); the validation
    data likewise (val_path, val_filters), or data.val_fraction of the training rows."""
    storage = dict(data.storage_options)
    features = list(data.feature_columns)
    train = inspect(data.path, "data.path", storage, data.filters, "data.filters")
    test = _split_source(data, "test", data.test_path, data.test_filters, storage)
    val = _split_source(data, "val", data.val_path, data.val_filters, storage)
    if data.cache_dir is not None:
        train, val, test = _cached(data, train, val, test)
    if data.val_fraction:
        train, val = train.hold_out(data.val_fraction, data.val_seed, "data.val_fraction")
    for source in (train, val, test):
        if source is not None:
            source.require_columns("data.feature_columns", features)
            source.require_columns("data.label_column", [data.label_column])
            source.require_image_decoder("data.feature_columns", features)
            source.require_image_decoder("data.label_column", [data.label_column])
    if world_size is not None:
        train.require_rows(world_size, data.batch_size)
    for split, source in (("validation", val), ("test", test)):
        if source is not None and source.num_rows == 0:
            raise UserError(
                f"{source.key}={source.url} has no rows: give a {split} set with rows, or "
                f"data.{'val' if split == 'validation' else 'test'}_path=null"
            )
    return Sources(train, val, test)


def _cached(
    data: ParquetDataConfig, *sources: ParquetSource | None
) -> tuple[ParquetSource, ParquetSource | None, ParquetSource | None]:
    """The sources with data.cache_dir keeping their files, those that are remote (a local file
    is read where it is); refused where none is."""
    from dtf.data.parquet.cache import make

    if not any(s is not None and remote.is_remote(s.url) for s in sources):
        raise UserError(
            f"data.cache_dir={data.cache_dir} keeps remote files on local disk, and data.path={data.path} is on "
            "local disk already: drop data.cache_dir (it is for s3://, gs://, hdfs://, ... data)"
        )
    out = [
        s
        if s is None or not remote.is_remote(s.url)
        else dataclasses.replace(
            s, cache=make(str(data.cache_dir), data.cache_limit_gb, s.url, s.storage_options, list(s.files))
        )
        for s in sources
    ]
    train, val, test = out
    assert train is not None
    return train, val, test


def _split_source(
    data: ParquetDataConfig, split: str, path: str | None, filters: Any, storage: Mapping[str, Any]
) -> ParquetSource | None:
    """An evaluation split: its own path (and filters), or data.path's partitions that its filters keep."""
    if not path and not filters:
        return None
    where, key = (path, f"data.{split}_path") if path else (data.path, "data.path")
    return inspect(where, key, storage, filters, f"data.{split}_filters")
