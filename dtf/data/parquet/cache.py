"""data.cache_dir: remote Parquet files kept on local disk once read, so that a second epoch reads
nothing remote. One cache serves every rank (and every run) of a host that names the same folder.

A file is the unit, as Mosaic Streaming's shards are: the first reader of a file downloads all of
it (a Parquet footer names its row groups' byte ranges, but a rank reads most row groups of the
files it touches within an epoch or two). Between the ranks of a host:
- each file is filled under an exclusive lock of its own (fcntl.flock on `<entry>.lock`), so that
  it is downloaded once while the others wait for it, not beside it;
- a download goes to a temporary name and is renamed into place after its size checks, so that a
  reader never opens half a file, even after a rank was killed mid-download;
- an entry's name carries the remote file's size and version (what fsspec's info says of it: S3's
  ETag): a file rewritten under the same name is another entry, never the stale copy.

data.cache_limit_gb bounds the folder: after each fill the least recently used entries (by their
modification time, which every use touches) go until the rest fit. A rank that has an evicted file
open keeps reading it (POSIX keeps an unlinked file until its last reader closes it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtf import remote
from dtf.errors import UserError

_PART = ".part"
_LOCK = ".lock"


@dataclass(frozen=True)
class RemoteFile:
    """What the remote file system said of a file when the run started: its entry is valid while
    these stay the same (the version: S3's ETag, or where a store has none its modification time)."""

    size: int
    version: str


@dataclass(frozen=True)
class FileCache:
    """A source's files (by their path on its file system) in a local folder. Picklable: process
    workers rebuild the remote file system from url and storage_options."""

    root: Path
    limit_bytes: int | None  # None: as large as the data
    url: str  # the data set's URL: its scheme and storage options open the remote files
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    files: Mapping[str, RemoteFile] = field(default_factory=dict, repr=False)

    def open(self, path: str) -> Any:
        """The local copy of the remote file at path, open for reading (a pyarrow file), downloaded
        first where missing."""
        import pyarrow as pa

        entry = self.entry(path)
        for _ in range(3):  # an entry evicted between our fill and our open is filled again
            try:
                opened = pa.OSFile(str(entry))
            except FileNotFoundError:
                self._fill(path, entry)
                continue
            with contextlib.suppress(OSError):
                os.utime(entry)  # used now: the last to be evicted
            return opened
        raise UserError(
            f"data.cache_dir={self.root}: {path} was evicted as soon as it arrived: raise data.cache_limit_gb"
        )

    def describe(self) -> str:
        """Where the files go, and whether the limit holds them all (else every epoch fetches
        again what the limit evicted)."""
        total = sum(f.size for f in self.files.values())
        if self.limit_bytes is None or total <= self.limit_bytes:
            return f"files cached in {self.root}"
        return (
            f"files cached in {self.root}, whose limit of {self.limit_bytes / 2**30:.3g} GiB is below the data's "
            f"{total / 2**30:.3g} GiB: each epoch fetches again what it evicted (data.cache_limit_gb)"
        )

    def prefetch(self, paths: Iterable[str]) -> None:
        """Starts filling the entries of these files (in this order) in background threads, as many
        as fit in half the limit: a reading names the files it will need, so that their latency
        passes while it reads the first ones. A failure is left for the reader's own fill to meet."""
        room = None if self.limit_bytes is None else self.limit_bytes // 2
        for path in dict.fromkeys(paths):
            entry = self.entry(path)
            if room is not None:
                room -= self.files[path].size
                if room < 0:
                    break
            with _PREFETCH_LOCK:
                if entry in _IN_FLIGHT or entry.exists():
                    continue
                _IN_FLIGHT.add(entry)
            _prefetcher().submit(self._prefetch_one, path, entry)

    def _prefetch_one(self, path: str, entry: Path) -> None:
        try:
            if not entry.exists():
                self._fill(path, entry)
        except Exception:
            pass  # the reader fills it again, and reports what failed
        finally:
            with _PREFETCH_LOCK:
                _IN_FLIGHT.discard(entry)

    def holds(self, paths: Iterable[str]) -> bool:
        """Every one of these files has its entry: reading them needs nothing remote."""
        return all(self.entry(p).exists() for p in paths)

    def entry(self, path: str) -> Path:
        known = self.files[path]
        key = hashlib.sha256(f"{self.url}\0{path}\0{known.size}\0{known.version}".encode()).hexdigest()[:24]
        return self.root / f"{key}-{Path(path).name}"

    def _fill(self, path: str, entry: Path) -> None:
        with _locked(entry.with_name(entry.name + _LOCK)):
            if entry.exists():  # another rank filled it while this one waited
                return
            part = entry.with_name(f"{entry.name}.{os.getpid()}.{threading.get_ident()}{_PART}")
            try:
                remote.filesystem(self.url, self.storage_options, "data.path")[0].get_file(path, str(part))
                got, want = part.stat().st_size, self.files[path].size
                if got != want:
                    raise UserError(
                        f"data.cache_dir: {path} arrived with {got} bytes where its listing said {want}: "
                        "do not write to a data set a run is reading"
                    )
                os.replace(part, entry)
            finally:
                part.unlink(missing_ok=True)
        self._evict(keep=entry)

    def _evict(self, keep: Path) -> None:
        if self.limit_bytes is None:
            return
        entries = []
        for e in os.scandir(self.root):
            if e.name.endswith((_PART, _LOCK)) or not e.is_file():
                continue
            with contextlib.suppress(FileNotFoundError):  # another rank's eviction took it
                st = e.stat()
                entries.append((st.st_mtime_ns, st.st_size, Path(e.path)))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):  # least recently used first
            if total <= self.limit_bytes:
                break
            if path == keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            total -= size


# Downloads run beside the reading: a few at a time, each mostly waiting on the network.
_PREFETCH_THREADS = 8
_PREFETCH_LOCK = threading.Lock()
_IN_FLIGHT: set[Path] = set()
_EXECUTOR: list[ThreadPoolExecutor] = []


def _prefetcher() -> ThreadPoolExecutor:
    with _PREFETCH_LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(ThreadPoolExecutor(_PREFETCH_THREADS, thread_name_prefix="dtf-cache"))
        return _EXECUTOR[0]


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    with open(lock, "a+b") as f:  # its own open file description: threads of one rank exclude each other too
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def make(
    cache_dir: str, limit_gb: float | None, url: str, storage_options: Mapping[str, Any], paths: list[str]
) -> FileCache:
    """The cache of a source whose files (paths on its file system) the listing found, each with its
    size and version as the remote file system reports them now. Refuses a limit below the largest file."""
    fs = remote.filesystem(url, storage_options, "data.path")[0]  # fsspec keeps one per URL scheme and options
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(paths)))) as pool:
        infos = list(pool.map(fs.info, paths))
    files = {p: RemoteFile(int(i["size"]), _version(i)) for p, i in zip(paths, infos, strict=True)}
    limit = None if limit_gb is None else int(limit_gb * 2**30)
    largest = max((f.size for f in files.values()), default=0)
    if limit is not None and largest > limit:
        raise UserError(
            f"data.cache_limit_gb={limit_gb} is smaller than the largest file of {url} ({largest / 2**30:.3g} GiB): "
            "raise it, or data.cache_limit_gb=null"
        )
    root = Path(cache_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"data.cache_dir={cache_dir} cannot be made ({e.strerror}): name a writable local folder"
        ) from None
    return FileCache(root.resolve(), limit, url, dict(storage_options), files)


def _version(info: Mapping[str, Any]) -> str:
    """The field of fsspec's info that changes when a file is rewritten, and only then (a listing
    and a HEAD report different sets of fields, so not a digest of all of them)."""
    for name in ("ETag", "etag", "md5Hash", "LastModified", "last_modified", "mtime", "updated", "modified"):
        if info.get(name) is not None:
            return f"{name}={info[name]}"
    return ""  # the size alone tells a rewritten file
