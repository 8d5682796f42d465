"""Files and directories dtf writes: whole or not at all, and a directory it cannot make named in
one line. Standard library only: the driver, the ranks and the sweeper all write through it."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from dtf.errors import UserError


def write_atomically(path: Path, content: str | bytes | Callable[[IO[bytes]], None], *, durable: bool = False) -> None:
    """Write a sibling temp file, then rename it over path: a reader (a sweep, a test, a resume)
    sees the old file or the new one, never half of one. content: text, bytes, or a function that
    writes to the open file (torch.save). durable: fsync the file and the directory first, so the
    rename survives a crash of the machine (a checkpoint's files and its commit marker)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if callable(content):
            content(f)
        else:
            f.write(content.encode() if isinstance(content, str) else content)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """data as indented JSON (summary.json, a sweep's records), atomically."""
    write_atomically(path, json.dumps(data, indent=2, default=str) + "\n")


def make_dir(path: str | Path, key: str) -> Path:
    """The directory path (made if missing), resolved; UserError naming the setting (key) that gave
    it when it cannot be made, or when it is there but cannot be written (a run dir made read-only,
    a read-only mount): found before the first write, which would end in a traceback."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"{key}={path} cannot be made ({e.strerror or type(e).__name__}): give {key} a directory you can write to"
        ) from None
    require_writable(Path(path), key)
    return Path(path).resolve()


def require_writable(directory: Path, key: str, root: Path | None = None) -> None:
    """UserError naming key (which gives root: directory or a folder above it) when a file cannot
    be made in directory. A file is made and removed: os.access does not know read-only mounts on
    every system, nor what root may not write."""
    root = root or directory
    try:
        fd, probe = tempfile.mkstemp(prefix=".dtf-writable-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        inside = "" if root == directory else f" (its {directory.relative_to(root)})"
        raise UserError(
            f"{key}={root}{inside} cannot be written ({e.strerror or type(e).__name__}): make it writable "
            f"(chmod -R u+w {root}, or mount it read-write) and run the same command again, or give {key} "
            "a directory you can write to"
        ) from None


_NEARLY_FULL_BYTES = 1 << 20  # a write that failed with less than this left on its disk ran out of space


def out_of_space(error: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of disk space: an error in its chain says so (ENOSPC, EDQUOT;
    DCP gathers every rank's in one CheckpointException), or, where the writer reports no errno
    (torch.save's "unexpected pos ...", "iostream error"), the disk of where is full now."""
    if _os_error_in(error, (errno.ENOSPC, errno.EDQUOT)) is not None:
        return True
    try:
        disk = os.statvfs(where)
    except OSError:
        return False
    return disk.f_bavail * disk.f_frsize < _NEARLY_FULL_BYTES


def write_refused(error: BaseException) -> OSError | None:
    """The error in a failed write's chain that says the place cannot be written (a read-only
    mount, a folder without write permission), if any."""
    return _os_error_in(error, (errno.EROFS, errno.EACCES, errno.EPERM))


def _os_error_in(error: BaseException, errnos: tuple[int, ...]) -> OSError | None:
    """An OSError with one of errnos among error, its causes and contexts, and the errors of each
    rank that DCP gathers in one CheckpointException."""
    found: list[BaseException] = [error]
    found += [wrapped[0] for wrapped in getattr(error, "failures", {}).values() if isinstance(wrapped, tuple)]
    seen: set[int] = set()
    while found:
        e = found.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in errnos:
            return e
        found += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None
