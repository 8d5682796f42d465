"""Checkpoints that are never torn: torch.distributed.checkpoint (sharded where the strategy
shards) plus one small file per rank, made valid only by a commit marker written last,
atomically (write, fsync, rename), once every rank has finished writing.

Layout: <run_dir>/checkpoints/step_<global step>/ (checkpoint.dir: any folder, or a URL such as
s3://bucket/run1, where the same files are objects: dtf.train.checkpoint_store)
    .metadata, __<rank>_0.distcp   DCP: model and optimizer state (resharded on load)
    rank_<r>.pt                    this rank's RNG states (dtf.train.rng; loaded with weights_only)
    trainer.pt                     loop position, epoch metrics, LR schedule (rank 0)
    COMMITTED.json                 step, world size, strategy, every file's size and CRC32; written last

Nothing in a checkpoint can run code when read: DCP's pickled .metadata is read by an unpickler
that builds only DCP's own metadata classes (named exactly), DCP's non-tensor entries load with
weights_only=True, and so do dtf's own files.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import json
import os
import pickle
import re
import shutil
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFiles
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlanner
from torch.futures import Future

from dtf import remote
from dtf.config.schema import CheckpointConfig
from dtf.dist.env import DistEnv
from dtf.errors import EveryRankUserError, UserError
from dtf.files import out_of_space, write_atomically, write_json, write_refused
from dtf.train.checkpoint_store import RemotePath, Where, location
from dtf.train.rng import rng_state
from dtf.train.save_plan import SmallReplicasOnOneRank
from dtf.train.state import TrainState

if TYPE_CHECKING:
    from dtf.train.checkpoint_writer import BackgroundWriter

MARKER = "COMMITTED.json"
TRAINER_FILE = "trainer.pt"
_PREFIX = "step_"
BEST_FILE = "best.json"  # checkpoint.keep_best: the best checkpoints and their objective
W = TypeVar("W", bound=Path | RemotePath)  # where checkpoints are: listed as what the root is


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Every global a DCP .metadata file may name, exactly (module, name): no dotted names, no modules.
_METADATA_CLASSES = frozenset(
    {
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # looks a layout up by name in a fixed table
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        *(
            (_DCP_METADATA, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle. This unpickler builds only DCP's own metadata classes and the
    torch types they hold, each named exactly, so a tampered or garbage file is refused instead of
    running code (the same promise as torch.load's weights_only)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "pathlib._local":  # where Python 3.13 defines (and so pickles) pathlib's classes
            module = "pathlib"
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if "." in name or not ((module, name) in _METADATA_CLASSES or dtype):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return super().find_class(module, name)


class _SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read by _MetadataUnpickler instead of pickle.load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{type(metadata).__name__} is not a checkpoint's metadata")
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _SafeRemoteReader(FsspecReader, _SafeReader):
    """DCP's fsspec reader, with _SafeReader's metadata, reading each object only where this rank's
    load plan reads it: the files it holds checked copies of from those, the rest as the byte ranges
    the plan names, a file's ranges in concurrent requests. (DCP streams each file through the file
    system's own reads, and s3fs reads ahead 50 MB from wherever a read starts: every rank fetched
    most of every file for the scalars and the shards it wanted from it.)"""

    def __init__(self, url: str, copies: LocalCopies | None = None, **options: Any) -> None:
        super().__init__(url, **options)
        self._files = _PlannedReads(cast(FsspecFiles, self.fs), {} if copies is None else copies.files)
        self.fs = cast(FileSystem, self._files)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        items = [cast(Any, self.storage_data[req.storage_index]) for req in plan.items]
        self._files.plan([(i.relative_path, i.offset, i.offset + i.length) for i in items])
        return super().read_data(plan, planner)


# Byte ranges of one object closer than this are fetched as one request (fewer round trips).
_RANGE_GAP = 1 << 20


class _PlannedReads:
    """DCP's fsspec file system, whose reads open a local copy where there is one, else fetch the
    byte ranges plan() named for the file, else read the object as the file system reads it."""

    def __init__(self, remote_files: FsspecFiles, copies: dict[str, Path]) -> None:
        self._remote = remote_files
        self._copies = copies
        self._planned: dict[str, list[list[int]]] = {}

    def plan(self, wanted: list[tuple[str, int, int]]) -> None:
        """The ranges (file name, start, end) a load reads, merged where they are close."""
        self._planned = {}
        for name, start, end in sorted(wanted):
            spans = self._planned.setdefault(name, [])
            if spans and start <= spans[-1][1] + _RANGE_GAP:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([start, end])

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        name = str(path).rsplit("/", 1)[-1]
        copy = self._copies.get(name) if mode == "rb" else None
        if copy is not None:
            with copy.open("rb") as f:
                yield cast(io.IOBase, f)
        elif mode == "rb" and name in self._planned:
            # One file's ranges at a time (the memory a load holds), in concurrent requests.
            spans = self._planned.pop(name)
            fs = cast(Any, self._remote).fs
            blobs = fs.cat_ranges([str(path)] * len(spans), [s[0] for s in spans], [s[1] for s in spans])
            fetched = _Ranges()
            for (start, _), blob in zip(spans, blobs, strict=True):
                if isinstance(blob, BaseException):
                    raise blob
                fetched.add(start, blob)
            yield fetched
        else:
            with self._remote.create_stream(path, mode) as stream:
                yield stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._remote, name)


class _Ranges(io.RawIOBase):
    """A file of which only some byte ranges are held (those fetched): reads within them."""

    def __init__(self) -> None:
        super().__init__()
        self._starts: list[int] = []
        self._blobs: list[bytes] = []
        self._pos = 0

    def add(self, start: int, blob: bytes) -> None:
        at = bisect.bisect(self._starts, start)
        self._starts.insert(at, start)
        self._blobs.insert(at, blob)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        if whence not in (os.SEEK_SET, os.SEEK_CUR):
            raise io.UnsupportedOperation("a file of fetched ranges has no end to seek from")
        self._pos = offset + (self._pos if whence == os.SEEK_CUR else 0)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        at = bisect.bisect(self._starts, self._pos) - 1
        blob = self._blobs[at] if at >= 0 else b""
        offset = self._pos - self._starts[at] if at >= 0 else -1
        if offset == len(blob):
            return 0  # the end of a range read: nothing after it was asked for
        if not 0 <= offset < len(blob):
            raise OSError(f"byte {self._pos} was not fetched (not in this rank's load plan)")
        view = memoryview(blob)[offset : offset + len(buffer)]
        memoryview(buffer).cast("B")[: len(view)] = view
        self._pos += len(view)
        return len(view)


def reader(path: Where, copies: LocalCopies | None = None) -> FileSystemReader:
    """DCP's reader of the checkpoint at path (a folder, or a URL), reading nothing that can run code;
    copies: this rank's checked copies of some of a remote checkpoint's files, read instead."""
    if isinstance(path, RemotePath):
        return _SafeRemoteReader(path.url, copies, **path.options)
    return _SafeReader(str(path))


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with values that are not tensors (an optimizer's param_groups, ...)
    loaded with weights_only=True (DCP's own loads them with weights_only=False)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


RESUME_ADVICE = (
    "resume with the model and optimizer it was trained with, or start over with checkpoint.resume=never (its "
    "checkpoints are moved aside) or another hydra.run.dir"
)


def load_app_state(
    path: Where, app_state: dict[str, Any], advice: str = RESUME_ADVICE, copies: LocalCopies | None = None
) -> None:
    """DCP's load into app_state (in place, resharding as needed), reading nothing that can run code
    (and the files of copies from there). A checkpoint of another model (or optimizer) is refused in
    one line before anything is read, ending with advice."""
    misfit = _misfit(reader(path, copies).read_metadata(), app_state)
    if misfit:
        raise EveryRankUserError(f"checkpoint {path} does not fit this run: {misfit}; {advice}")
    try:
        dcp.load(app_state, storage_reader=reader(path, copies), planner=_SafePlanner())
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, pickle.UnpicklingError)]
        if not refused:
            raise
        reason = next((line for line in str(refused[0]).splitlines() if "GLOBAL" in line), "not plain data")
        raise UserError(
            f"checkpoint {path} holds a value that could run code when loaded, and was refused ({reason.strip()}): "
            "resume only from checkpoints you trust"
        ) from None


def _misfit(metadata: Metadata, app_state: dict[str, Any]) -> str | None:
    """The first tensor of app_state (model first, in its state_dict order, then the optimizer's)
    whose shape differs from the checkpoint's or that the checkpoint lacks, or a model tensor the
    checkpoint holds and this model does not; None when it fits."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    saved = metadata.state_dict_metadata
    wanted, _ = flatten_state_dict(app_state)
    for key, value in wanted.items():
        if not isinstance(value, torch.Tensor):
            continue
        there = saved.get(key)
        if there is None:
            return f"{key} is not in it"
        size = getattr(there, "size", None)
        if size is not None and tuple(size) != tuple(value.shape):
            return f"{key} has the shape {list(size)} there and {list(value.shape)} here"
    extra = [key for key in saved if key.startswith("model.") and key not in wanted]
    return f"{extra[0]} is in it and not in this model" if extra else None


def _metadata_problem(path: Where) -> str:
    try:
        with (path / ".metadata").open("rb") as f:
            _MetadataUnpickler(f).load()
    except Exception as e:  # any failure to read it safely makes the checkpoint unusable
        return f"unsafe or corrupt .metadata ({type(e).__name__}: {e})"
    return ""


def file_crc32(path: Where, copy_to: Path | None = None) -> str:
    """CRC32 of a file (zlib's, about 6 GB/s here): catches bytes changed after the commit. With
    copy_to, the bytes read are written there too (a copy that cannot be written is left out)."""
    crc = 0
    out = None if copy_to is None else _open_copy(copy_to)
    with path.open("rb") as f:
        while chunk := f.read(1 << 23):
            crc = zlib.crc32(chunk, crc)
            if out is not None:
                try:
                    out.write(chunk)
                except OSError as e:  # a full local disk: the load reads this file from the store again
                    _drop_copy(out, cast(Path, copy_to))
                    out = None
                    _warn_no_copy(path.name, e)
    if out is not None:
        out.close()
    return f"{crc:08x}"


def _open_copy(path: Path) -> IO[bytes] | None:
    try:
        return path.open("wb")
    except OSError as e:
        _warn_no_copy(path.name, e)
        return None


def _warn_no_copy(name: str, e: OSError) -> None:
    _warn(f"no local copy of {name} for the load ({e}): it is read from the store again")


def _drop_copy(out: IO[bytes], path: Path) -> None:
    with contextlib.suppress(OSError):
        out.close()
    path.unlink(missing_ok=True)


def file_record(path: Where) -> dict[str, Any]:
    return {"size": path.stat().st_size, "crc32": file_crc32(path)}


def bytes_record(size: int, crc: int) -> dict[str, Any]:
    """The record file_record would read back from a file of these bytes (their count and CRC32)."""
    return {"size": size, "crc32": f"{crc:08x}"}


class _RecordedStreams:
    """A DCP file system (the class after this one in the bases) whose write streams count and
    checksum what goes through them; _record turns that into the file's record."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict[str, Any]] = {}  # file name -> record, as finally named

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:  # type: ignore[misc]
            if "w" not in mode:
                yield stream
                return
            counted = _ChecksummedStream(stream)
            yield cast(io.IOBase, counted)
        self._record(path, counted)

    def _record(self, path: str | os.PathLike, counted: _ChecksummedStream) -> None:
        raise NotImplementedError


class ChecksummedFiles(_RecordedStreams, FileSystem):
    """DCP's local file system, which also takes each file's record (size, CRC32) from the bytes as
    DCP writes them: the same record file_record would read back, without reading the file again
    (which doubled the memory traffic of a save). DCP writes every file front to back through the
    stream's write(); a file whose size on disk is not what went through write() is read back."""

    def _record(self, path: str | os.PathLike, counted: _ChecksummedStream) -> None:
        file = Path(path)
        streamed = file.stat().st_size == counted.size
        self.records[file.name] = bytes_record(counted.size, counted.crc) if streamed else file_record(file)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP's .metadata is written under a temporary name
        record = self.records.pop(Path(path).name, None)
        if record is not None:
            self.records[Path(new_path).name] = record


class ChecksummedObjects(_RecordedStreams, FsspecFiles):
    """ChecksummedFiles on an fsspec file system (an object store): each file's record from the
    bytes DCP writes, which are the object's bytes (one upload when the stream closes; no file
    descriptor anything else could write through)."""

    def __init__(self, fs: Any) -> None:
        super().__init__()
        self.fs = fs

    def _record(self, path: str | os.PathLike, counted: _ChecksummedStream) -> None:
        self.records[os.fspath(path).rsplit("/", 1)[-1]] = bytes_record(counted.size, counted.crc)

    def mkdir(self, path: str | os.PathLike) -> None:
        """Nothing: a prefix needs no making (and s3fs's makedirs would create a missing bucket)."""

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        # DCP's .metadata is written under a temporary name and renamed: a copy and a delete on an
        # object store, not atomic, which the commit marker (written after it) makes harmless.
        super().rename(path, new_path)
        record = self.records.pop(os.fspath(path).rsplit("/", 1)[-1], None)
        if record is not None:
            self.records[os.fspath(new_path).rsplit("/", 1)[-1]] = record


class _ChecksummedStream:
    """A file opened for writing, counting and checksumming what is written through it."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        written = self._raw.write(data)
        view = memoryview(data).cast("B")[:written]
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return written

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno (fsync), close: the file's own
        return getattr(self._raw, name)


def _storage_writer(path: Where) -> tuple[FileSystemWriter, ChecksummedFiles | ChecksummedObjects]:
    """What dcp.save(checkpoint_id=path) would write with (its defaults), on files that take their
    records. On an object store, without fsync: an object is stored once its upload returns (and
    DCP's fallback where a stream has no file descriptor, os.sync(), would flush the whole host)."""
    if isinstance(path, RemotePath):
        remote_writer = FsspecWriter(path.url, sync_files=False, **path.options)
        objects = ChecksummedObjects(path.fs)
        remote_writer.fs = objects  # type: ignore[assignment]  # DCP's own attribute, typed for its local files
        return remote_writer, objects
    writer = FileSystemWriter(str(path))
    files = ChecksummedFiles()
    writer.fs = files
    return writer, files


def _write(path: Where, content: str | bytes) -> None:
    """A small file written whole: atomically and durably on a disk, one upload on an object store."""
    if isinstance(path, RemotePath):
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    else:
        write_atomically(path, content, durable=True)


def _remove_tree(path: Where) -> None:
    """A pruned checkpoint removed, as far as it can be: one left behind is pruned at the next commit."""
    if isinstance(path, RemotePath):
        with contextlib.suppress(Exception):  # as shutil's ignore_errors: a store that fails here fails the next save
            path.rmtree()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _torch_load(path: Where, copies: LocalCopies | None = None) -> Any:
    if isinstance(path, RemotePath):
        data = path.read_bytes() if copies is None else copies.read_bytes(path)
        return torch.load(io.BytesIO(data), weights_only=True)
    return torch.load(path, weights_only=True)


@dataclass(frozen=True)
class Marker:
    """A checkpoint's commit marker: what was saved, by how many ranks, and every file's record."""

    step: int
    world_size: int
    strategy: str
    files: dict[str, dict[str, Any]]  # name -> {"size": bytes, "crc32": hex}


def write_marker(path: Where, step: int, world_size: int, strategy: str, files: dict[str, dict[str, Any]]) -> None:
    """The commit: written last and atomically (one PUT on an object store), once every file it
    lists is on disk."""
    meta = {"step": step, "world_size": world_size, "strategy": strategy, "files": dict(sorted(files.items()))}
    _write(path / MARKER, json.dumps(meta, indent=1))


def read_marker(path: Where) -> Marker:
    """The commit marker of the checkpoint at path (OSError, ValueError, KeyError or TypeError when
    it is missing or malformed)."""
    meta = json.loads((path / MARKER).read_text())
    return Marker(int(meta["step"]), int(meta["world_size"]), str(meta["strategy"]), meta["files"])


def _marker_files(path: Where) -> dict[str, dict[str, Any]]:
    files = read_marker(path).files
    if not isinstance(files, dict) or not all(isinstance(r, dict) and "crc32" in r for r in files.values()):
        raise ValueError("it lists no checksums (written by an older dtf)")
    return files


def is_complete(path: Where) -> tuple[bool, str]:
    """Cheap: the marker exists, every file it lists has its size, and the metadata is safe to read."""
    listed = path.sizes() if isinstance(path, RemotePath) else None  # one listing, not a request a file

    def size(name: str) -> int | None:
        if listed is not None:
            return listed.get(name)
        f = path / name
        return f.stat().st_size if f.is_file() else None

    if size(MARKER) is None:
        return False, "no commit marker (the save was interrupted)"
    try:
        for name, record in _marker_files(path).items():
            if size(name) != record["size"]:
                return False, f"{name} is missing or truncated"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return False, f"unreadable commit marker ({e})"
    problem = _metadata_problem(path)
    return (False, problem) if problem else (True, "")


def verify(path: Where) -> tuple[bool, str]:
    """is_complete, and every file's CRC32 as the marker recorded it (reads the whole checkpoint)."""
    ok, why = is_complete(path)
    if not ok:
        return ok, why
    problem = damaged(path, 0, 1)
    return (False, problem) if problem else (True, "")


def damaged(path: Where, rank: int, world_size: int, copies: LocalCopies | None = None) -> str:
    """This rank's share of verify's checksums (share()): what is wrong with the first file of it
    that differs from its record, or "". With copies, each file read is kept there, so that the load
    reads the bytes checked here rather than download them again."""
    files = _marker_files(path)
    for name in share(list(files), rank, world_size):
        copy_to = None if copies is None else copies.folder / name
        if file_crc32(path / name, copy_to) != files[name]["crc32"]:
            return f"{name} is damaged (its checksum differs from the one recorded at the commit)"
        if copies is not None and copy_to is not None and copy_to.is_file():
            copies.files[name] = copy_to
    return ""


# The files a rank of the saving run wrote for itself: its DCP data file, its RNG state.
_RANKS_OWN = re.compile(r"__(\d+)_\d+\.distcp|rank_(\d+)\.pt")


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files of a checkpoint whose checksums this rank checks, every file by one rank: what rank
    k of the saving run wrote goes to rank k modulo the world size (at the same world size, the files
    that rank loads: its shards, its RNG state), the rest in turn."""
    mine, rest = [], []
    for name in sorted(names):
        own = _RANKS_OWN.fullmatch(name)
        if own is None:
            rest.append(name)
        elif int(own[1] or own[2]) % world_size == rank:
            mine.append(name)
    return mine + rest[rank::world_size]


class LocalCopies:
    """A rank's checked copies of files of a remote checkpoint (name -> local file), in a folder of
    their own that remove() deletes."""

    def __init__(self, folder: Path) -> None:
        shutil.rmtree(folder, ignore_errors=True)  # a killed run's, never read
        folder.mkdir(parents=True)
        self.folder = folder
        self.files: dict[str, Path] = {}

    def read_bytes(self, path: Where) -> bytes:
        """The file at path: its copy where this rank holds one."""
        copy = self.files.get(path.name)
        return copy.read_bytes() if copy is not None else path.read_bytes()

    def remove(self) -> None:
        self.files.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def scan(root: W) -> tuple[list[W], list[tuple[W, str]]]:
    """(complete checkpoints under root, newest first; incomplete ones with the reason)."""
    if not root.is_dir():
        return [], []
    found: list[W] = []
    skipped: list[tuple[W, str]] = []
    listed = cast(list[W], list(root.glob(f"{_PREFIX}*")))
    for path in sorted(listed, key=lambda p: p.name, reverse=True):
        if not path.name[len(_PREFIX) :].isdigit():
            continue
        ok, why = is_complete(path)
        if ok:
            found.append(path)
        else:
            skipped.append((path, why))
    return found, skipped


def _warn(text: str) -> None:
    print(f"dtf: warning: {text}", file=sys.stderr, flush=True)


def committed(root: W) -> list[W]:
    """Complete checkpoints under root, newest first."""
    return scan(root)[0]


@dataclass
class SaveRequest:
    """One rank's part of a checkpoint, as write_files writes it (in the rank, or in its writer
    process: dtf.train.checkpoint_writer, which replaces state by its copy in shared memory)."""

    path: Where
    state: dict[str, Any]  # DCP's: model and optimizer
    files: dict[str, bytes]  # dtf's own small files (rank_<r>.pt; trainer.pt on rank 0), serialized
    planner: SavePlanner | None = None  # SmallReplicasOnOneRank unless the writer process sets its own
    collective = True  # every rank's writer at once (their group is joined for it)

    def carry_out(self, rank: int, world_size: int) -> dict[str, dict[str, Any]]:
        """What the writer process does with it (it knows requests by this method, not by their module)."""
        return write_files(self, rank, world_size)


@dataclass(frozen=True)
class Retention:
    """Which checkpoints are kept: the newest keep_last complete ones, and with keep_best the
    best ones ([step, objective value], best first), listed in best.json."""

    keep_last: int
    keep_best: int
    best: tuple[tuple[int, float], ...] = ()
    objective: str = ""


@dataclass(frozen=True)
class CommitRequest:
    """A checkpoint whose files every rank has written: its marker is written (and older
    checkpoints pruned) by commit_files, on rank 0 or in its writer process."""

    path: Where
    step: int
    world_size: int
    strategy: str
    files: dict[str, dict[str, Any]]  # every rank's records
    retention: Retention
    collective = False  # rank 0's writer alone

    def carry_out(self, rank: int, world_size: int) -> None:
        commit_files(self)


def commit_files(request: CommitRequest) -> None:
    """The commit: the marker, listing every file with its record (anything no rank claimed, a
    file layout DCP may change, is checksummed here), then the pruning of older checkpoints."""
    files = dict(request.files)
    path = request.path
    names = list(path.sizes()) if isinstance(path, RemotePath) else [f.name for f in path.iterdir() if f.is_file()]
    for name in names:
        if name not in files:
            files[name] = file_record(path / name)
    write_marker(request.path, request.step, request.world_size, request.strategy, files)
    prune(request.path.parent, request.retention)


def prune(root: Where, retention: Retention) -> None:
    """Delete all but the newest keep_last complete checkpoints and the keep_best best ones
    (incomplete ones too: never loadable); best.json lists the best that exist."""
    complete = committed(root)
    keep = set(complete[: retention.keep_last])
    best = [(step, value) for step, value in retention.best if root / f"{_PREFIX}{step:09d}" in complete]
    keep.update(root / f"{_PREFIX}{step:09d}" for step, _ in best)
    for path in root.glob(f"{_PREFIX}*"):
        if path not in keep and path.is_dir():
            _remove_tree(path)
    if retention.keep_best:
        listed = [{"step": step, retention.objective: value, "path": f"{_PREFIX}{step:09d}"} for step, value in best]
        best_json = {"objective": retention.objective, "best": listed}
        if isinstance(root, RemotePath):
            (root / BEST_FILE).write_bytes((json.dumps(best_json, indent=2) + "\n").encode())  # as write_json
        else:
            write_json(root / BEST_FILE, best_json)


def write_files(request: SaveRequest, rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Collective (on the default group of the calling process): writes this rank's files of a
    checkpoint, fsynced; returns the records (size, CRC32) of those it wrote, each checksummed by
    the rank that wrote it, in parallel and from its own page cache. Rank 0 makes the folder (a
    stale, uncommitted attempt at the same step is removed first, e.g. one before a crash)."""
    path = request.path
    if rank == 0:
        if isinstance(path, RemotePath):
            path.rmtree()
        elif path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    if world_size > 1:
        dist.barrier()
    records = {}
    for name, data in request.files.items():
        _write(path / name, data)
        records[name] = bytes_record(len(data), zlib.crc32(data))
    writer, files = _storage_writer(path)
    dcp.save(request.state, storage_writer=writer, planner=request.planner or SmallReplicasOnOneRank())
    return records | files.records


class Saveable(Protocol):
    """What a checkpoint holds: state sharded by the strategy (DCP writes each rank's part, and
    reshards it on load), and the trainer's own small state (rank 0 writes it whole)."""

    def app_state(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...


class Checkpointer:
    """Decides when a save is due (every_n_steps, the last step when at_end, or a stop) and saves
    one checkpoint at a time. With async_save, a writer process beside the rank writes it
    (dtf.train.checkpoint_writer) while the rank trains on; the marker is written once every
    rank's part is done, which the ranks learn together at a step boundary (dtf.train.control),
    or at the latest when the next save starts or the run ends."""

    def __init__(
        self, cfg: CheckpointConfig, root: Where, env: DistEnv, strategy_name: str, timeout_s: float = 1800.0
    ) -> None:
        self.root = root
        self.env = env
        self.every_n_steps = cfg.every_n_steps
        self.at_end = cfg.at_end
        self.keep_last = cfg.keep_last
        self.keep_best = cfg.keep_best
        self._best: list[list[float]] = []  # [step, objective] of the checkpoints kept as the best
        self._objective = ""
        self.strategy_name = strategy_name
        self.async_save = cfg.async_save
        self.writer: BackgroundWriter | None = None
        if cfg.async_save:
            from dtf.train.checkpoint_writer import BackgroundWriter

            self.writer = BackgroundWriter(env.rank, env.world_size, env.device, timeout_s)
        self._pending: tuple[int, Where] | None = None  # the save the writer is writing
        self._committing: tuple[int, Where] | None = None  # rank 0: the checkpoint whose marker the writer writes
        self.blocked_s: list[float] = []  # how long each save held up the training loop
        self.last_saved_step: int | None = None  # of this process's latest save (maybe still being written)

    def is_due(self, step: int, last: bool) -> bool:
        return bool(self.every_n_steps and step % self.every_n_steps == 0) or (last and self.at_end)

    def save(
        self, step: int, what: Saveable, *, last: bool = False, force: bool = False, later: frozenset[int] = frozenset()
    ) -> bool:
        """Collective: every rank calls it at every step boundary (last: the run's final step;
        force: save whether due or not, for a stop). Returns whether it saved. later: as write's."""
        if not (force or self.is_due(step, last)):
            return False
        t0 = time.perf_counter()
        self.write(step, what.app_state(), what.state_dict(), later)
        self.blocked_s.append(time.perf_counter() - t0)
        return True

    def wait_staged(self) -> None:
        """Before the tensors named `later` at the last save change: waits until the save in
        flight has copied them. The wait counts as that save's time blocked."""
        t0 = time.perf_counter()
        if self.writer is not None and self.writer.wait_staged() and self.blocked_s:
            self.blocked_s[-1] += time.perf_counter() - t0

    def write(
        self, step: int, app_state: dict[str, Any], trainer_state: dict[str, Any], later: frozenset[int] = frozenset()
    ) -> Where:
        """Collective: writes the checkpoint of this step now (committed at once, or once every
        rank's writer has written its part). later (async_save): the data_ptr()s of tensors of
        app_state that the caller leaves unchanged until it calls wait_staged; they are copied in
        the background until then."""
        self.finish()  # at most one save in flight: the one before is committed first
        path = self.path_of(step)
        self.last_saved_step = step
        files = {f"rank_{self.env.rank}.pt": _torch_bytes(rng_state())}
        if self.env.is_main:
            files[TRAINER_FILE] = _torch_bytes(trainer_state)
        request = SaveRequest(path, app_state, files)
        with self._failing_save(step, path):
            if self.writer is not None:
                self.writer.submit(request, later)  # returns once the state (but `later`) is copied to memory
                self._pending = (step, path)
            else:
                self._commit(step, path, write_files(request, self.env.rank, self.env.world_size))
        return path

    def path_of(self, step: int) -> Where:
        return self.root / f"{_PREFIX}{step:09d}"

    @property
    def background_step(self) -> int | None:
        """The step of the save still being written in the background, if any."""
        return self._pending[0] if self._pending else None

    def background_done(self) -> bool:
        """Whether this rank's part of the background save has been written."""
        return self._pending is not None and self.writer is not None and self.writer.done()

    def finish(self) -> None:
        """Collective: waits for the background save, if any, and commits it."""
        if self._pending is None or self.writer is None:
            return
        step, path = self._pending
        self._pending = None
        self._settle_commit()  # the one before, whose outcome comes first
        with self._failing_save(step, path):
            records = self.writer.result()  # a failed write raises here, and the checkpoint is never committed
            self._commit(step, path, records)

    def close(self) -> None:
        """Commits the background save, if any, and ends the writer process (collective): the
        newest checkpoint is committed on every rank when it returns."""
        try:
            self.finish()
            self._settle_commit()
            _barrier()
        finally:
            if self.writer is not None:
                self.writer.close()
                self.writer = None

    @contextlib.contextmanager
    def _failing_save(self, step: int, path: Where) -> Iterator[None]:
        """A save that fails leaves no files behind (they are never loaded, and would only take the
        space a full disk lacks); a full disk is told in one line, and so is an object store that
        fails (its objects are left: they are never loaded, the next save of the step or the next
        pruning removes them, and a store that failed may not answer a removal either)."""
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(self.root, RemotePath):
                failure = next((w[0] for w in getattr(e, "failures", {}).values() if isinstance(w, tuple)), e)
                line = remote.diagnose(
                    failure, self.root.url, "checkpoint.dir", f"saving the checkpoint of step {step}"
                )
                if line is None:
                    raise
                raise EveryRankUserError(line) from None
            assert isinstance(path, Path) and isinstance(self.root, Path)
            full = out_of_space(e, self.root)
            if self.env.is_main:
                shutil.rmtree(path, ignore_errors=True)
            else:
                for f in path.glob(f"*{self.env.rank}*"):  # its own files; rank 0 removes the rest
                    f.unlink(missing_ok=True)
            refused = None if full else write_refused(e)
            newest = committed(self.root)[:1]
            kept = f"{newest[0].name} is intact and a rerun continues from it" if newest else "none was saved before it"
            if refused is not None:  # made read-only while the run trains (a read-only mount, chmod)
                raise EveryRankUserError(
                    f"{self.root} cannot be written ({refused.strerror}) while saving the checkpoint of step {step} "
                    f"(of the earlier checkpoints, {kept}): make it writable (chmod -R u+w {self.root}, or mount it "
                    "read-write), or put checkpoints elsewhere (checkpoint.dir), then run the same command to continue"
                ) from None
            if not full:
                raise
            raise EveryRankUserError(
                f"no space left on the device of {self.root} while saving the checkpoint of step {step} (its files "
                f"were removed; of the earlier checkpoints, {kept}): free space there, or keep fewer "
                "(checkpoint.keep_last) or put them on a larger disk (checkpoint.dir, hydra.run.dir), then run the "
                "same command to continue"
            ) from None

    def _commit(self, step: int, path: Where, records: dict[str, dict[str, Any]]) -> None:
        """Rank 0 gathers every rank's records (each sends them once it has written its files) and
        writes the marker: itself, or through its writer process (which writes it before the next
        save; _settle_commit takes its outcome)."""
        gathered: list[Any] = [records]
        if dist.is_initialized() and self.env.world_size > 1:
            gathered = [None] * self.env.world_size if self.env.is_main else []
            dist.gather_object(records, gathered if self.env.is_main else None, dst=0)
        if self.env.is_main:
            files = {name: record for part in gathered for name, record in part.items()}
            request = CommitRequest(path, step, self.env.world_size, self.strategy_name, files, self._retention())
            if self.writer is None:
                commit_files(request)
            else:
                self.writer.commit(request)
                self._committing = (step, path)
        if self.writer is None:
            _barrier()  # the checkpoint is committed on every rank when save returns

    def _settle_commit(self) -> None:
        """Rank 0: waits for the marker its writer is writing, if any (raising its failure)."""
        if self._committing is None or self.writer is None:
            return
        step, path = self._committing
        self._committing = None
        with self._failing_save(step, path):
            self.writer.take_commit()

    def _retention(self) -> Retention:
        best = tuple((int(step), float(value)) for step, value in self._best)
        return Retention(self.keep_last, self.keep_best, best, self._objective)

    def keep_steps(self, objective: str, best: list[list[float]]) -> None:
        """checkpoint.keep_best: the checkpoints of these steps ([step, objective value], best
        first) are kept beside the newest keep_last, and listed in best.json."""
        self._objective, self._best = objective, [list(sv) for sv in best]
        if self.keep_best and self.env.is_main and self._pending is None and self.root.is_dir():  # else at a commit
            self._settle_commit()
            self._prune()

    def _prune(self) -> None:
        prune(self.root, self._retention())

    def load(
        self, path: Where, app_state: dict[str, Any], copies: LocalCopies | None = None
    ) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
        """Loads DCP state into app_state (resharding as needed; copies: this rank's checked copies
        of files of a remote checkpoint, read instead); returns (trainer state, this rank's RNG state
        or None when the world size changed, saved world size)."""
        saved_world = read_marker(path).world_size
        load_app_state(path, app_state, copies=copies)
        trainer_state = _torch_load(path / TRAINER_FILE, copies)
        rank_file = path / f"rank_{self.env.rank}.pt"
        same_world = saved_world == self.env.world_size
        rng = _torch_load(rank_file, copies) if same_world and rank_file.is_file() else None
        return trainer_state, rng, saved_world


def recorded_position(path: Where, copies: LocalCopies | None = None) -> TrainState:
    """Where the run a checkpoint holds stood (step, epoch, samples_in_epoch, global_batch,
    canonical_partitions, ...), read without loading anything else."""
    saved = _torch_load(path / TRAINER_FILE, copies)
    position = TrainState()
    position.load_state_dict(saved.get("trainer", saved))
    return position


def newest_complete(root: Where) -> Where | None:
    """The newest complete checkpoint under root; each incomplete one passed over is named in a
    warning line (normal after a kill). Its checksums are checked by every rank, each its share of
    the files, before it is loaded (dtf.train.loop.choose_checkpoint): no process reads it whole."""
    found, skipped = scan(root)
    for path, why in skipped:
        _warn(f"skipping checkpoint {path}: {why}")
    return found[0] if found else None


def resolve_resume(setting: str, root: Where, storage_options: dict[str, Any] | None = None) -> Where | None:
    """checkpoint.resume: auto (newest complete checkpoint of this run dir, if any), never, or a path
    or URL of a complete one (its checksums are checked by the ranks, as newest_complete's)."""
    if setting == "never":
        return None
    if setting == "auto":
        return newest_complete(root)
    path = location(setting, storage_options, "checkpoint.resume")
    try:
        if not path.is_dir():
            raise UserError(
                f"checkpoint.resume={setting}: no such checkpoint directory; give a step_* folder, auto or never"
            )
        ok, why = is_complete(path)
    except UserError:
        raise
    except Exception as e:
        line = (
            remote.diagnose(e, setting, "checkpoint.resume", "reading the checkpoint")
            if remote.is_remote(setting)
            else None
        )
        if line is None:
            raise
        raise UserError(line) from None
    if not ok:
        raise UserError(f"checkpoint.resume={setting} is not a complete checkpoint: {why}")
    return path


def choose_start(
    setting: str, root: Where, attempt: int, storage_options: dict[str, Any] | None = None
) -> tuple[Where | None, str | None]:
    """The checkpoint a run starts from, and a note for the user. One rule for a run directory:
    a restart or requeue (attempt > 0) always continues this run from its newest checkpoint, whatever
    checkpoint.resume says (that is for the first attempt); a fresh start (never, or another
    checkpoint's path) in a run dir that holds checkpoints moves them aside first, so that they
    can neither outlive the new run's checkpoints nor be continued by a later resume=auto. An
    object store cannot move them (no rename): a fresh start there is refused in one line."""
    if attempt > 0:
        newest = newest_complete(root)
        if newest is not None or setting in ("auto", "never"):
            return newest, None
        # no checkpoint of its own yet: where the first attempt began
        return resolve_resume(setting, root, storage_options), None
    start = resolve_resume(setting, root, storage_options)
    if setting == "auto" or not root.is_dir() or not any(root.glob(f"{_PREFIX}*")):
        return start, None
    if isinstance(root, RemotePath):
        raise UserError(
            f"checkpoint.dir={root} holds the checkpoints of an earlier run, which cannot be moved aside on an object "
            f"store as they are in a folder (checkpoint.resume={setting} starts another run): give this run a "
            "checkpoint.dir of its own, or continue that run with checkpoint.resume=auto"
        )
    assert isinstance(start, Path | None)
    aside = root.with_name(f"{root.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    while aside.exists():
        aside = aside.with_name(aside.name + "_")
    inside = start is not None and start.resolve().is_relative_to(root.resolve())
    root.rename(aside)
    if start is not None and inside:
        start = aside / start.resolve().relative_to(root.resolve())  # one of them: load it from where it is now
    how = "this run starts fresh" if start is None else f"this run starts from {start}"
    return start, f"checkpoint.resume={setting}: {how}; the run dir's earlier checkpoints were moved to {aside}"
