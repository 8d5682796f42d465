"""Checkpoints that are never torn: torch.distributed.checkpoint (sharded where the strategy
shards) plus one small file per rank, made valid only by a commit marker written last,
atomically (write, fsync, rename), once every rank has finished writing.

Layout: <run_dir>/checkpoints/step_<global step>/
    .metadata, __<rank>_0.distcp   DCP: model and optimizer state (resharded on load)
    rank_<r>.pt                    this rank's RNG states (torch.save, loaded with weights_only)
    trainer.pt                     loop position, epoch metrics, LR scheduler (rank 0)
    COMMITTED.json                 step, world size, strategy, every file's size; written last
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dtf.dist.env import DistEnv
from dtf.errors import UserError

MARKER = "COMMITTED.json"
TRAINER_FILE = "trainer.pt"
_PREFIX = "step_"


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save_synced(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain numbers (loadable with weights_only=True)."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(py_state, dtype=torch.int64),
        "python_version": py_version,
        "python_gauss": py_gauss,
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "numpy_kind": str(np_kind),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"].tolist()), state["python_gauss"]))
    np.random.set_state(
        (
            state["numpy_kind"],
            state["numpy_keys"].numpy().astype(np.uint32),
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_gauss"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


_METADATA_CLASSES = frozenset(
    {
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP reads its .metadata with plain pickle.load. Before it does, dtf reads the file with this
    unpickler, which builds only DCP's own metadata classes and the torch types they hold, so a
    tampered or garbage checkpoint is refused instead of running code (weights_only semantics)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module, name) in _METADATA_CLASSES
            or module == "torch.distributed.checkpoint.metadata"
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return super().find_class(module, name)


def _metadata_problem(path: Path) -> str:
    try:
        with open(path / ".metadata", "rb") as f:
            _MetadataUnpickler(f).load()
    except Exception as e:  # any failure to read it safely makes the checkpoint unusable
        return f"unsafe or corrupt .metadata ({type(e).__name__}: {e})"
    return ""


def is_complete(path: Path) -> tuple[bool, str]:
    """A checkpoint counts only with its marker, and only if every file it lists has its size."""
    marker = path / MARKER
    if not marker.is_file():
        return False, "no commit marker (the save was interrupted)"
    try:
        meta = json.loads(marker.read_text())
        for name, size in meta["files"].items():
            f = path / name
            if not f.is_file() or f.stat().st_size != size:
                return False, f"{name} is missing or truncated"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return False, f"unreadable commit marker ({e})"
    problem = _metadata_problem(path)
    return (False, problem) if problem else (True, "")


def committed(root: Path) -> list[Path]:
    """Complete checkpoints under root, newest first; incomplete ones are named in a warning."""
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.glob(f"{_PREFIX}*"), key=lambda p: p.name, reverse=True):
        if not path.name[len(_PREFIX) :].isdigit():
            continue
        ok, why = is_complete(path)
        if ok:
            found.append(path)
        else:
            warnings.warn(f"dtf: skipping checkpoint {path}: {why}", stacklevel=2)
    return found


class Checkpointer:
    """Saves one checkpoint at a time. With async_save, DCP writes in a background thread (on
    its own gloo group, so its collectives never interleave with training's); the marker is
    written once every rank's part is done, which the ranks learn together at a step boundary
    (dtf.train.control), or at the latest when the next save starts or the run ends."""

    def __init__(self, root: Path, env: DistEnv, keep_last: int, strategy_name: str, async_save: bool = False) -> None:
        self.root = root
        self.env = env
        self.keep_last = keep_last
        self.strategy_name = strategy_name
        self.async_save = async_save
        multi = dist.is_initialized() and env.world_size > 1
        self._upload_group = dist.new_group(backend="gloo") if async_save and multi else None
        self._pending: tuple[int, Path, Future[Any]] | None = None

    def save(self, step: int, app_state: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        """Collective: every rank calls it at the same step."""
        self.finish()  # at most one save in flight: the one before is committed first
        path = self.path_of(step)
        if self.env.is_main:
            if path.exists():  # a stale, uncommitted attempt at the same step (e.g. before a crash)
                shutil.rmtree(path)
            path.mkdir(parents=True)
        _barrier()
        _torch_save_synced(rng_state(), path / f"rank_{self.env.rank}.pt")
        if self.env.is_main:
            _torch_save_synced(trainer_state, path / TRAINER_FILE)
        if self.async_save:
            # Returns once the state is copied to memory; the files are written in the background.
            future = dcp.async_save(app_state, checkpoint_id=str(path), process_group=self._upload_group)
            self._pending = (step, path, future)  # type: ignore[assignment]
        else:
            dcp.save(app_state, checkpoint_id=str(path))
            self._commit(step, path)
        return path

    def path_of(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:09d}"

    @property
    def upload_step(self) -> int | None:
        """The step of the save still being written in the background, if any."""
        return self._pending[0] if self._pending else None

    def upload_done(self) -> bool:
        return self._pending is not None and self._pending[2].done()

    def finish(self) -> None:
        """Collective: waits for the background save, if any, and commits it."""
        if self._pending is None:
            return
        step, path, future = self._pending
        self._pending = None
        future.result()  # a failed write raises here, and the checkpoint is never committed
        self._commit(step, path)

    def _commit(self, step: int, path: Path) -> None:
        _barrier()  # every rank's files are on disk before the marker says so
        if self.env.is_main:
            files = {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()}
            meta = {"step": step, "world_size": self.env.world_size, "strategy": self.strategy_name, "files": files}
            _fsync_write(path / MARKER, json.dumps(meta, indent=1).encode())
            self._prune()
        _barrier()

    def _prune(self) -> None:
        """Delete all but the newest keep_last complete checkpoints (incomplete ones too: never loadable)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            keep = set(committed(self.root)[: self.keep_last])
        for path in self.root.glob(f"{_PREFIX}*"):
            if path not in keep and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path, app_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
        """Loads DCP state into app_state (resharding as needed); returns (trainer state, this rank's
        RNG state or None when the world size changed, saved world size)."""
        meta = json.loads((path / MARKER).read_text())
        dcp.load(app_state, checkpoint_id=str(path))
        trainer_state = torch.load(path / TRAINER_FILE, weights_only=True)
        rank_file = path / f"rank_{self.env.rank}.pt"
        same_world = meta["world_size"] == self.env.world_size
        rng = torch.load(rank_file, weights_only=True) if same_world and rank_file.is_file() else None
        return trainer_state, rng, int(meta["world_size"])


def resolve_resume(setting: str, root: Path) -> Path | None:
    """checkpoint.resume: auto (newest complete checkpoint of this run dir, if any), never, or a path."""
    if setting == "never":
        return None
    if setting == "auto":
        found = committed(root)
        return found[0] if found else None
    path = Path(setting)
    if not path.is_dir():
        raise UserError(
            f"checkpoint.resume={setting}: no such checkpoint directory; give a step_* folder, auto or never"
        )
    ok, why = is_complete(path)
    if not ok:
        raise UserError(f"checkpoint.resume={setting} is not a complete checkpoint: {why}")
    return path


def attempt_number() -> int:
    """0 on a run's first attempt; the restart count when torch elastic restarted the ranks
    (launcher.max_restarts, torchrun) or SLURM requeued the job."""
    return max(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ.get("SLURM_RESTART_COUNT", "0")))


def choose_start(setting: str, root: Path, attempt: int) -> tuple[Path | None, str | None]:
    """The checkpoint a run starts from, and a note for the user. One rule for a run directory:
    a restart or requeue (attempt > 0) always continues this run from its newest checkpoint, whatever
    checkpoint.resume says (that is for the first attempt); a fresh start (never, or another
    checkpoint's path) in a run dir that holds checkpoints moves them aside first, so that they
    can neither outlive the new run's checkpoints nor be continued by a later resume=auto."""
    if attempt > 0:
        found = committed(root)
        if found or setting in ("auto", "never"):
            return (found[0] if found else None), None
        return resolve_resume(setting, root), None  # no checkpoint of its own yet: where the first attempt began
    start = resolve_resume(setting, root)
    if setting == "auto" or not root.is_dir() or not any(root.glob(f"{_PREFIX}*")):
        return start, None
    aside = root.with_name(f"{root.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    while aside.exists():
        aside = aside.with_name(aside.name + "_")
    inside = start is not None and start.resolve().is_relative_to(root.resolve())
    root.rename(aside)
    if start is not None and inside:
        start = aside / start.resolve().relative_to(root.resolve())  # one of them: load it from where it is now
    how = "this run starts fresh" if start is None else f"this run starts from {start}"
    return start, f"checkpoint.resume={setting}: {how}; the run dir's earlier checkpoints were moved to {aside}"
