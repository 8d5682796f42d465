"""Where checkpoints are kept: a local folder (a pathlib.Path, as always) or a URL that fsspec
resolves (a RemotePath: s3://bucket/run1, ...).

RemotePath has the few methods of Path that dtf.train.checkpoint uses, on the object store, so
that checkpoints have one code path. What an object store lacks it is never asked for: a file is
one upload that appears whole or not at all (no temporary name and rename, no fsync), a folder is
a prefix (nothing to make; s3fs's makedirs would even create a missing bucket), and listings are
never cached (the ranks' writers, rank 0's commit and a later run each see what is there now).

The store is checked before any rank starts (check_store): its file system installed, the
endpoint answering, the credentials taken, the bucket there, and nothing in the prefix that dtf
did not write; each failure is one line naming the URL and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, NamedTuple, cast
from urllib.parse import urlparse

from dtf import remote
from dtf.errors import UserError

KEY = "checkpoint.dir"

# What dtf writes in a checkpoint.dir on an object store: checkpoints, best.json, and the copies of
# the run's results (dtf.train.loop.publish); anything else means the prefix is someone else's.
_OURS = re.compile(r"step_\d+|best\.json|model\.pt|best_model\.pt|summary\.json|hf_export|hf_export_best")


class _Stat(NamedTuple):
    st_size: int


class RemotePath:
    """A file or prefix at a URL, with the storage options that reach it (picklable: the writer
    processes get it in their requests, and make their own file system from it); key: the setting
    that named it, for the refusals."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, key: str = KEY) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.key = key

    @property
    def fs(self) -> Any:
        # fsspec keeps one file system per scheme and options (per process): made once, not per path.
        return remote.filesystem(self.url, self.options, self.key)[0]

    @property
    def options(self) -> dict[str, Any]:
        """The options a file system of it is made with: dtf's bounded waits, and no cached listings."""
        return {"use_listings_cache": False, **remote.options(self.url, self.storage_options)}

    @property
    def path(self) -> str:
        """Its path in its file system (the URL without the scheme)."""
        return cast(str, self.fs._strip_protocol(self.url))

    def _at(self, path: str) -> RemotePath:
        return RemotePath(cast(str, self.fs.unstrip_protocol(path)), self.storage_options, self.key)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self.storage_options, self.key)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rsplit("/", 1)[0], self.storage_options, self.key)

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.path))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.path))

    def stat(self) -> _Stat:
        return _Stat(int(self.fs.size(self.path)))

    def open(self, mode: str = "rb") -> IO[bytes]:
        return cast(IO[bytes], self.fs.open(self.path, mode))

    def read_bytes(self) -> bytes:
        return cast(bytes, self.fs.cat_file(self.path))

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        """One upload (one PUT on S3): the object appears whole, or not at all."""
        self.fs.pipe_file(self.path, data)

    def iterdir(self) -> Iterator[RemotePath]:
        try:
            found = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return
        yield from (self._at(p) for p in found)

    def sizes(self) -> dict[str, int]:
        """The files directly under this prefix, and their sizes: one listing."""
        try:
            found = self.fs.ls(self.path, detail=True)
        except FileNotFoundError:
            return {}
        return {f["name"].rsplit("/", 1)[-1]: int(f["size"]) for f in found if f["type"] == "file"}

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        yield from (self._at(p) for p in self.fs.glob(f"{self.path}/{pattern}"))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing: a prefix needs no making."""

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        """Every object under this prefix."""
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)

    def resolve(self) -> RemotePath:
        return self

    def is_relative_to(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (self.url + "/").startswith(other.url + "/")


Where = Path | RemotePath


def location(text: str | Path, storage_options: Mapping[str, Any] | None = None, key: str = KEY) -> Where:
    """The place a setting (key) names: a RemotePath for a URL, else a Path (file:// too)."""
    text = str(text)
    return RemotePath(text, storage_options, key) if remote.is_remote(text) else _local(text)


def checkpoint_root(run_dir: Path, directory: str, storage_options: Mapping[str, Any] | None = None) -> Where:
    """checkpoint.dir: a folder of the run dir (or any path, file:// too), or a URL."""
    return RemotePath(directory, storage_options) if remote.is_remote(directory) else run_dir / _local(directory)


def _local(text: str) -> Path:
    return Path(urlparse(text).path) if urlparse(text).scheme in ("file", "local") else Path(text)


def check_store(root: RemotePath) -> None:
    """Before any rank starts: the checkpoint.dir on an object store can be listed (its file system
    installed, the endpoint up, the credentials good, the bucket there), and holds only what dtf
    writes. One line naming the URL and the fix for each failure; nothing is written."""
    fs = root.fs  # a scheme whose package is missing is refused here
    try:
        found = fs.ls(root.path, detail=False)
    except FileNotFoundError as e:
        bucket = root.path.split("/", 1)[0]
        try:
            _bucket_exists(fs, bucket)  # an empty prefix in a bucket that is there: nothing saved yet
            found = []
        except Exception:
            raise UserError(remote.explain(e, root.url, KEY, "listing its checkpoints")) from None
    except Exception as e:
        line = remote.diagnose(e, root.url, KEY, "listing its checkpoints")
        if line is None:
            raise  # not a storage problem a user can fix: a bug keeps its traceback
        raise UserError(line) from None
    foreign = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found)
    foreign = [name for name in foreign if not _OURS.fullmatch(name)]
    if foreign:
        raise UserError(
            f"{KEY}={root.url} holds objects dtf did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}), and dtf writes, prunes and resumes there as in a folder of "
            "its own: give a prefix of its own (e.g. s3://bucket/<run name>), empty or holding only dtf's checkpoints"
        )


def _bucket_exists(fs: Any, bucket: str) -> None:
    """Raises where the bucket is not there (or cannot be read). s3fs 2024.6 (the lowest declared) answers info()
    on an empty bucket with FileNotFoundError, so a listing of it decides there."""
    try:
        fs.info(bucket)
    except FileNotFoundError:
        fs.ls(bucket, detail=False)
