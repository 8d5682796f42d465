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


@dataclass(frozen=True)
class ParquetSource:
    """A Parquet data set as its row groups ("pieces", in Petastorm's order) and its columns."""

    url: str
    key: str  # the config key that named it, for messages
    pieces: tuple[tuple[str, int], ...]  # (file path, row group index in the file)
    piece_rows: tuple[int, ...]
    column_types: Mapping[str, str]  # Parquet columns Petastorm can read, with their Arrow types
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # per-row shape of array columns
    has_unischema: bool = False  # written by Petastorm's materialize_dataset (codecs, shapes)

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


def inspect(path: str, key: str = "data.path", storage_options: Mapping[str, Any] | None = None) -> ParquetSource:
    """Lists the row groups and columns of the Parquet file or directory at path (a URL or a local path)."""
    quiet_petastorm()
    import pyarrow.parquet as pq
    from petastorm.etl.dataset_metadata import PetastormMetadataError, get_schema, load_row_groups
    from petastorm.unischema import Unischema

    url = to_url(path)
    parsed = urlparse(url)
    if parsed.scheme == "file" and not os.path.exists(parsed.path):
        raise UserError(f"{key}={path} does not exist: give the path of a Parquet file or directory")
    try:
        fs, fs_path = resolve(url, storage_options)
        dataset = pq.ParquetDataset(fs_path, filesystem=fs, validate_schema=False, metadata_nthreads=10)
    except Exception as e:
        raise UserError(f"{key}={url} cannot be opened as a Parquet data set ({first_line(e)})") from None
    files = sorted({piece.path for piece in dataset.pieces})
    if not files:
        raise UserError(f"{key}={url} holds no Parquet files: write the data there first (python -m dtf.data.prepare)")
    footers = _footers(dataset.fs, files, key, url)
    pieces = load_row_groups(dataset)
    piece_rows = tuple(footers[p.path].row_group(p.row_group).num_rows for p in pieces)
    arrow_schema = footers[files[0]].schema.to_arrow_schema()
    try:
        unischema, has_unischema = get_schema(dataset), True
    except PetastormMetadataError:
        unischema, has_unischema = Unischema.from_arrow_schema(dataset), False
    # Columns Petastorm cannot read (e.g. fixed_size_list, nested lists) are left out of its schema.
    readable = set(unischema.fields)
    column_types = {f.name: str(f.type) for f in arrow_schema if f.name in readable}
    if has_unischema:
        shapes = {name: tuple(f.shape) for name, f in unischema.fields.items() if f.shape and None not in f.shape}
    else:
        raw = (arrow_schema.metadata or {}).get(SHAPES_KEY)
        shapes = {name: tuple(shape) for name, shape in json.loads(raw).items()} if raw else {}
    return ParquetSource(
        url=url,
        key=key,
        pieces=tuple((p.path, p.row_group) for p in pieces),
        piece_rows=piece_rows,
        column_types=column_types,
        shapes=shapes,
        has_unischema=has_unischema,
    )


def storage_options(data: Any) -> dict[str, Any]:
    """data.storage_options as a plain dict, for fsspec."""
    from omegaconf import OmegaConf

    options = OmegaConf.to_container(data.storage_options) if data.get("storage_options") else {}
    return {str(k): v for k, v in options.items()} if isinstance(options, dict) else {}


def open_sources(data: Any, world_size: int | None) -> tuple[ParquetSource, ParquetSource | None]:
    """The train and test sources of a `data=petastorm` config, checked against its settings:
    files readable, columns present, a full batch for every rank (when world_size is known)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(data, "path"):
        raise UserError("data.path is not set: give the Parquet data to train on, e.g. data.path=data/train")
    storage = storage_options(data)
    features = list(data.feature_columns)
    if not features:
        raise UserError("data.feature_columns is empty: name the column(s) that form the model input")
    train = inspect(data.path, "data.path", storage)
    test = inspect(data.test_path, "data.test_path", storage) if data.test_path else None
    for source in (train, test):
        if source is not None:
            source.require_columns("data.feature_columns", features)
            source.require_columns("data.label_column", [data.label_column])
    if world_size is not None:
        train.require_rows(world_size, data.batch_size)
    if test is not None and test.num_rows == 0:
        raise UserError(f"data.test_path={test.url} has no rows: give a test set with rows, or data.test_path=null")
    return train, test
