"""What makes a checkpoint loadable: a commit marker, every file at its size, metadata that
unpickles to DCP's own classes only. And RNG states survive a weights_only round trip."""

from __future__ import annotations

import copy
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dtf.errors import UserError
from dtf.train.checkpoint import (
    MARKER,
    committed,
    file_crc32,
    file_record,
    is_complete,
    resolve_resume,
    write_marker,
)
from dtf.train.rng import rng_state, set_rng_state


def _checkpoint(root: Path, step: int) -> Path:
    path = root / f"step_{step:09d}"
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(path), no_dist=True)
    write_marker(path, step, 1, "ddp", {f.name: file_record(f) for f in path.iterdir()})
    return path


class _Exploit:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch pwned",))


def test_only_complete_untampered_checkpoints_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    good = _checkpoint(tmp_path, 10)
    assert is_complete(good) == (True, "")
    uncommitted = _checkpoint(tmp_path, 20)
    (uncommitted / MARKER).unlink()
    truncated = _checkpoint(tmp_path, 30)
    shard = next(truncated.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:3])
    tampered = _checkpoint(tmp_path, 40)
    size = (tampered / ".metadata").stat().st_size
    payload = pickle.dumps(_Exploit())
    (tampered / ".metadata").write_bytes(payload + b"\0" * (size - len(payload)))  # same size as before
    monkeypatch.chdir(tmp_path)  # where the exploit would create its file
    assert [p.name for p in committed(tmp_path)] == ["step_000000010"]
    assert not (tmp_path / "pwned").exists()  # the tampered metadata never ran
    assert resolve_resume("auto", tmp_path) == good
    reasons = capsys.readouterr().err  # resume=auto names every checkpoint it passes over, one line each
    assert "step_000000020: no commit marker" in reasons
    assert "step_000000030" in reasons and "truncated" in reasons
    assert "step_000000040: unsafe or corrupt .metadata" in reasons
    assert "system is not part of a checkpoint's metadata" in reasons
    assert len(reasons.strip().splitlines()) == 3
    with pytest.raises(UserError, match="not a complete checkpoint"):
        resolve_resume(str(tampered), tmp_path)
    shutil.rmtree(good)
    assert resolve_resume("auto", tmp_path) is None


def test_rng_states_round_trip_through_weights_only(tmp_path: Path) -> None:
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), random.random(), np.random.rand())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]


def test_a_fresh_start_from_one_of_the_run_dirs_own_checkpoints_loads_it_from_where_it_was_moved(
    tmp_path: Path,
) -> None:
    from dtf.train.checkpoint import choose_start

    root = tmp_path / "checkpoints"
    _checkpoint(root, 10)
    _checkpoint(root, 20)
    start, note = choose_start(str(root / "step_000000010"), root, attempt=0)
    assert start is not None and start.parent != root and start.name == "step_000000010" and is_complete(start)[0]
    assert not root.exists() and note is not None and str(start.parent) in note
    # a restart continues this run (here: it has no checkpoint yet, so from where its first attempt began)
    assert choose_start(str(start), root, attempt=1) == (start, None)
    _checkpoint(root, 30)
    assert choose_start("never", root, attempt=1) == (root / "step_000000030", None)


def _global(module: str, name: str, arg: str) -> bytes:
    """A pickle that calls module.name(arg), with a dotted name as pickle protocol 4 allows."""

    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch.distributed.checkpoint.metadata", "os.system"),  # a dotted name reaching out of an allowed module
        ("torch", "os.system"),
        ("torch.distributed.checkpoint.metadata", "torch.os.system"),
    ],
)
def test_a_crafted_metadata_file_runs_nothing_on_any_path_that_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, name: str
) -> None:
    from dtf.config.schema import CheckpointConfig
    from dtf.train.checkpoint import Checkpointer, choose_start

    monkeypatch.chdir(tmp_path)  # where the exploit would create its file
    root = tmp_path / "checkpoints"
    good = _checkpoint(root, 10)
    crafted = _checkpoint(root, 20)
    (crafted / ".metadata").write_bytes(_global(module, name, "touch pwned"))
    _rewrite_marker(crafted)  # the marker matches the files: only the unpickler stands in the way
    assert committed(root) == [good]  # resume=auto on rank 0, and every prune
    with pytest.raises(UserError):
        resolve_resume(str(crafted), root)  # resume=<path>, checked on the driver
    assert choose_start("auto", root, attempt=0)[0] == good
    Checkpointer(CheckpointConfig(keep_last=1), root, _env(), strategy_name="ddp")._prune()
    assert not (tmp_path / "pwned").exists()


def test_non_tensor_state_in_a_checkpoint_loads_without_running_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dtf.train.checkpoint import load_app_state

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "step_000000010"
    # DCP stores values that are not tensors with torch.save; its default planner loads them with weights_only=False
    dcp.save({"w": torch.arange(3.0), "extra": _Exploit()}, checkpoint_id=str(path), no_dist=True)
    state = {"w": torch.zeros(3), "extra": None}
    with pytest.raises(UserError, match=r"could run code when loaded, and was refused \(.*posix\.system"):
        load_app_state(path, state)
    assert not (tmp_path / "pwned").exists()
    # plain values (an optimizer's param_groups) load as before
    dcp.save(
        {"w": torch.arange(3.0), "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["a"]}]},
        checkpoint_id=str(tmp_path / "plain"),
        no_dist=True,
    )
    state = {"w": torch.zeros(3), "groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": [""]}]}
    load_app_state(tmp_path / "plain", state)
    assert state["groups"][0]["lr"] == 0.1 and torch.equal(state["w"], torch.arange(3.0))


def _env():  # type: ignore[no-untyped-def]
    from dtf.dist.env import DistEnv

    return DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _rewrite_marker(path: Path) -> None:
    write_marker(path, 20, 1, "ddp", {f.name: file_record(f) for f in path.iterdir() if f.name != MARKER})


def test_an_async_save_is_written_by_the_writer_process_from_a_copy_and_equals_a_synchronous_one(
    tmp_path: Path,
) -> None:
    async_saves_equal_synchronous_ones(tmp_path)  # no start_early here: the writer is spawned


# A rank's start (dtf.rank): one thread, torch imported. The writer is forked then, and used.
FORKED_EARLY = """
import sys
from pathlib import Path

from dtf.train import checkpoint_writer
from tests.unit.test_checkpoint_files import async_saves_equal_synchronous_ones

checkpoint_writer.start_early()
assert checkpoint_writer._early is not None, "not forked"
early = checkpoint_writer._early[1].pid
assert async_saves_equal_synchronous_ones(Path(sys.argv[1])) == early
assert checkpoint_writer._early is None
print("used", early)
"""
# A writer forked early that the run never asks for (the rank fails first) is told to end with the
# rank, and does (status 0, not killed); at exit, multiprocessing would wait forever for a writer
# that ignores SIGTERM.
NEVER_USED = """
import atexit

from dtf.train import checkpoint_writer

writer = []
atexit.register(lambda: print("ended", writer[0].exitcode, flush=True))  # after the writer's own exit handler
checkpoint_writer.start_early()
writer.append(checkpoint_writer._early[1])
print("unused", writer[0].pid, flush=True)
"""


@pytest.mark.parametrize("script", [FORKED_EARLY, NEVER_USED], ids=["used", "never-used"])
def test_a_writer_forked_at_the_ranks_start_writes_its_saves_or_ends_with_the_rank(tmp_path: Path, script: str) -> None:
    import subprocess
    import sys

    import psutil

    repo = Path(__file__).resolve().parents[2]
    # One thread, as a rank forked from the run's forkserver has: numpy's OpenBLAS would start its
    # pool at import (a spawned rank's writer is spawned, as in the test above).
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=repo, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = dict(line.split() for line in done.stdout.splitlines())
    writer = int(said.get("used") or said["unused"])
    if script == NEVER_USED:
        assert said["ended"] == "0", done.stdout
    assert not psutil.pid_exists(writer) or psutil.Process(writer).status() == psutil.STATUS_ZOMBIE


def async_saves_equal_synchronous_ones(tmp_path: Path) -> int:
    """Two asynchronous saves, each equal to a synchronous one; the writer's pid."""
    from dtf.config.schema import CheckpointConfig
    from dtf.train.checkpoint import Checkpointer, load_app_state, read_marker, verify

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()

    def app_state() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    sync = Checkpointer(CheckpointConfig(), tmp_path / "sync", _env(), strategy_name="ddp")
    in_background = Checkpointer(CheckpointConfig(async_save=True), tmp_path / "async", _env(), strategy_name="ddp")
    paths = []
    try:
        assert in_background.writer is not None and in_background.writer.pid not in (None, os.getpid())
        for step in (5, 6):  # the second save reuses the writer's buffers and sends only what is not a tensor
            sync.write(step, app_state(), {"step": step})
            paths.append(in_background.write(step, app_state(), {"step": step}))
            assert in_background.background_step == step and not (paths[-1] / MARKER).exists()  # not yet committed
            with torch.no_grad():  # training goes on at once: the save holds the state as it was at write
                for p in model.parameters():
                    p.add_(1.0)
            optimizer.param_groups[0]["lr"] /= 2
        writer = in_background.writer.pid
        assert writer is not None
        if hasattr(os, "SCHED_IDLE"):  # it takes only the time the ranks leave (after its first save, surely set)
            assert os.sched_getscheduler(writer) == os.SCHED_IDLE
        in_background.close()
    finally:
        if in_background.writer is not None:
            in_background.writer.close()
    for step, path in zip((5, 6), paths, strict=True):
        assert verify(path) == (True, "")
        assert read_marker(path).files.keys() == read_marker(sync.path_of(step)).files.keys()
        assert torch.load(path / "trainer.pt", weights_only=True) == {"step": step}
        loaded = [copy.deepcopy(app_state()), copy.deepcopy(app_state())]  # filled in place, from each checkpoint
        for state, where in zip(loaded, (sync.path_of(step), path), strict=True):
            load_app_state(where, state)
        torch.testing.assert_close(loaded[0], loaded[1], rtol=0, atol=0)
        assert loaded[1]["optim"]["param_groups"][0]["lr"] == 1e-3 / 2 ** (step - 5)
    assert not torch.equal(loaded[1]["model"]["0.weight"], model.state_dict()["0.weight"])  # not the live state
    return writer


def test_the_writers_buffers_are_made_once_per_layout_and_all_but_plain_cpu_tensors_go_to_torchs_stager() -> None:
    from torch.distributed.tensor import DTensor

    from dtf.train.checkpoint_writer import StateBuffers

    buffers = StateBuffers()
    state = {"w": torch.arange(6.0).reshape(2, 3).t(), "groups": [{"lr": 0.1, "params": ["w"]}], "step": (3, None)}
    first = buffers.stage(state)
    assert first is not None and first.buffers is not None
    state["w"].add_(1.0)
    state["groups"][0]["lr"] = 0.05
    second = buffers.stage(state)
    assert second is not None and second.buffers is None  # the writer keeps the buffers it was sent
    state["w"].add_(1.0)  # after the copy: the staged state does not change
    rebuilt = second.rebuild(first.buffers)
    assert torch.equal(rebuilt["w"], torch.arange(6.0).reshape(2, 3).t() + 1)
    assert rebuilt["groups"] == [{"lr": 0.05, "params": ["w"]}] and rebuilt["step"] == (3, None)
    assert first.buffers[0].is_shared()
    grown = buffers.stage({**state, "w": torch.zeros(4)})
    assert grown is not None and grown.buffers is not None and grown.buffers[0].shape == (4,)
    assert buffers.stage({"w": torch.zeros(2).as_subclass(DTensor)}) is None
    assert buffers.stage({"w": torch.nn.Linear(2, 2)}) is None  # an object that may hold tensors
    linear = torch.nn.Linear(2, 2)
    module_state = {"model": linear.state_dict(), "optim": torch.optim.Adam(linear.parameters()).state_dict()}
    assert buffers.stage(module_state) is not None  # a module's OrderedDict and an optimizer's state


def test_tensors_named_later_are_left_to_copy_the_rest_and_the_others_are_copied_at_once() -> None:
    from dtf.train.checkpoint_writer import StateBuffers

    weight, running_mean = torch.zeros(3), torch.zeros(2)
    buffers = StateBuffers()
    staged = buffers.stage({"weight": weight, "running_mean": running_mean}, later=frozenset({weight.data_ptr()}))
    assert staged is not None and staged.buffers is not None
    weight.add_(1.0)  # before copy_the_rest: the copy holds this
    running_mean.add_(1.0)  # after stage returned: the copy does not
    buffers.copy_the_rest()
    rebuilt = staged.rebuild(staged.buffers)
    assert rebuilt["weight"].tolist() == [1.0] * 3 and rebuilt["running_mean"].tolist() == [0.0] * 2
    assert buffers.left_to_copy == []


def _plain(state: object) -> object:
    """state with its OrderedDicts as dicts (a state dict's, not a loaded checkpoint's)."""
    if isinstance(state, dict):
        return {key: _plain(value) for key, value in state.items()}
    return [_plain(v) for v in state] if isinstance(state, list) else state


def test_an_async_save_copies_the_parameters_during_the_next_steps_forward_and_holds_its_own_steps_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop goes on while a thread copies the parameters and optimizer state; it waits for
    the copy before the next optimizer step. The copy slowed here: saved without that wait, each
    checkpoint would hold the next step's parameters, not the state the loop had when it saved."""
    import time

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.utils._pytree import tree_flatten

    from dtf.train import checkpoint_writer
    from dtf.train.checkpoint import Checkpointer
    from dtf.train.trainer import Trainer
    from tests.helpers.inprocess import train_in_process

    copy_the_rest, write = checkpoint_writer.StateBuffers.copy_the_rest, Checkpointer.write
    changed = Trainer._changed_by_optimizer_steps
    left: list[int] = []
    listed: list[int] = []  # the steps at which the trainer listed the tensors to copy later
    when_saved: dict[int, object] = {}

    def slowly(self: checkpoint_writer.StateBuffers) -> None:
        left.append(len(self.left_to_copy))
        time.sleep(0.2)
        copy_the_rest(self)

    def noting(self: Checkpointer, step: int, app_state: dict[str, object], *args: object) -> Path:
        when_saved[step] = copy.deepcopy(app_state)
        return write(self, step, app_state, *args)  # type: ignore[arg-type]

    def counted(self: Trainer) -> frozenset[int]:
        listed.append(self.state.step)
        return changed(self)

    monkeypatch.setattr(checkpoint_writer.StateBuffers, "copy_the_rest", slowly)
    monkeypatch.setattr(Checkpointer, "write", noting)
    monkeypatch.setattr(Trainer, "_changed_by_optimizer_steps", counted)
    overrides = [
        "optimizer=adam",
        "data.dataset.num_points=400",
        "data.dataset.num_test=40",
        "trainer.max_steps=6",
        "trainer.progress=off",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep_last=3",
        "checkpoint.async_save=true",
    ]
    s = train_in_process(overrides, tmp_path / "run")
    assert s["checkpoints_saved"] == 3 and sorted(when_saved) == [2, 4, 6], (s, sorted(when_saved))
    assert len(left) == 3 and all(left), left  # each save left the parameters and the optimizer state to the thread
    assert listed == [2, 4, 6], listed  # at the saves only: not work added to every step
    for path in committed(tmp_path / "run" / "checkpoints"):
        dcp_to_torch_save(path, tmp_path / "whole.pt")
        saved, spec = tree_flatten(_plain(torch.load(tmp_path / "whole.pt", weights_only=False)))
        truth, truth_spec = tree_flatten(_plain(when_saved[int(path.name.split("_")[1])]))
        assert spec == truth_spec
        for mine, true in zip(saved, truth, strict=True):
            assert torch.equal(mine, true) if isinstance(mine, torch.Tensor) else mine == true, path.name


def test_a_background_copy_that_fails_is_the_saves_failure_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dtf.config.schema import CheckpointConfig
    from dtf.train import checkpoint_writer
    from dtf.train.checkpoint import Checkpointer

    def fails(self: checkpoint_writer.StateBuffers) -> None:
        raise RuntimeError("the copy failed")

    monkeypatch.setattr(checkpoint_writer.StateBuffers, "copy_the_rest", fails)
    weight = torch.ones(4)
    in_background = Checkpointer(CheckpointConfig(async_save=True), tmp_path, _env(), strategy_name="ddp")
    try:
        path = in_background.write(5, {"model": {"weight": weight}}, {"step": 5}, later=frozenset({weight.data_ptr()}))
        in_background.wait_staged()  # the loop goes on to its optimizer step: the failure waits for the commit
        with pytest.raises(RuntimeError, match="the copy failed"):
            in_background.finish()
        assert not path.exists() and committed(tmp_path) == []
    finally:
        in_background.close()


def test_the_records_taken_from_the_bytes_dcp_writes_equal_the_files_read_back(tmp_path: Path) -> None:
    from dtf.train.checkpoint import ChecksummedFiles, _storage_writer

    state = _adam_state()
    writer, files = _storage_writer(tmp_path)
    assert isinstance(files, ChecksummedFiles)
    dcp.save(state, storage_writer=writer, no_dist=True)
    on_disk = {f.name: file_record(f) for f in tmp_path.iterdir()}
    assert files.records == on_disk and {".metadata", "__0_0.distcp"} <= on_disk.keys()  # .metadata as renamed
    # A file not written front to back through the stream is read back instead.
    with files.create_stream(tmp_path / "patched", "wb") as stream:
        stream.write(b"abcdef")
        stream.seek(2)
        stream.write(b"Z")
    assert files.records["patched"] == file_record(tmp_path / "patched") == {"size": 6, "crc32": "c6ad8ec4"}


def _adam_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 64)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "note": "not a tensor"}


def test_on_an_object_store_the_records_equal_the_objects_read_back_and_nothing_is_renamed_in_place() -> None:
    """checkpoint.dir as a URL (fsspec's in-memory file system stands in for S3): DCP's fsspec
    writer, whose records are taken from the bytes uploaded, the same as the objects' read back;
    no temporary .metadata is left, and the checkpoint loads through the safe fsspec reader."""
    import fsspec

    from dtf.train.checkpoint import ChecksummedObjects, _storage_writer, load_app_state
    from dtf.train.checkpoint_store import location

    path = location(f"memory://dtf-test-{os.getpid()}/step_000000001")
    try:
        state = _adam_state()
        writer, files = _storage_writer(path)
        assert isinstance(files, ChecksummedObjects)
        dcp.save(state, storage_writer=writer, no_dist=True)
        stored = {p.name: file_record(p) for p in path.iterdir()}
        assert files.records == stored and set(stored) == {".metadata", "__0_0.distcp"}
        loaded = _adam_state()
        for t in loaded["model"].values():  # type: ignore[attr-defined]
            t.zero_()
        load_app_state(path, loaded)
        assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())  # type: ignore[index]
    finally:
        fsspec.filesystem("memory").rm(f"/dtf-test-{os.getpid()}", recursive=True)


def test_checkpoint_dir_and_resume_name_a_folder_or_a_url() -> None:
    from dtf.train.checkpoint_store import RemotePath, checkpoint_root, location

    run_dir = Path("/runs/a")
    assert checkpoint_root(run_dir, "checkpoints") == run_dir / "checkpoints"
    assert checkpoint_root(run_dir, "/shared/ckpt") == Path("/shared/ckpt")
    assert checkpoint_root(run_dir, "file:///shared/ckpt") == Path("/shared/ckpt")
    assert location("file:///shared/ckpt/step_000000010") == Path("/shared/ckpt/step_000000010")
    root = checkpoint_root(run_dir, "s3://bucket/run1/", {"key": "k"})
    assert isinstance(root, RemotePath) and str(root) == "s3://bucket/run1"
    step = root / "step_000000010"
    # what a writer process gets in its requests: the URL, the options and the setting that named it
    back = pickle.loads(pickle.dumps(step))
    assert back == step and back.storage_options == {"key": "k"} and back.key == "checkpoint.dir"
    assert (step.name, step.parent, step.with_name("best.json")) == ("step_000000010", root, root / "best.json")
    assert location("s3://bucket/run1/step_000000010", None, "checkpoint.resume").key == "checkpoint.resume"


def test_a_copy_that_cannot_be_kept_is_named_and_the_checksum_still_taken(tmp_path: Path, capsys) -> None:
    """A resume from an object store keeps the files a rank checks (their copies are what it loads);
    where the copy cannot be written, the file is read from the store again, and a line says so."""
    data = tmp_path / "__0_0.distcp"
    data.write_bytes(os.urandom(1 << 16))
    unwritable = tmp_path / "no-such-folder" / data.name
    assert file_crc32(data, unwritable) == file_crc32(data)
    assert not unwritable.exists()
    line = capsys.readouterr().err.strip()
    assert line.startswith("dtf: warning: no local copy of __0_0.distcp for the load (") and "\n" not in line, line
    kept = tmp_path / "kept"
    assert file_crc32(data, kept) == file_crc32(data) and kept.read_bytes() == data.read_bytes()
