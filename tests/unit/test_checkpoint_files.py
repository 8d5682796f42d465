"""What makes a checkpoint loadable: a commit marker, every file at its size, metadata that
unpickles to DCP's own classes only. And RNG states survive a weights_only round trip."""

from __future__ import annotations

import json
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
from dtf.train.checkpoint import MARKER, committed, is_complete, resolve_resume, rng_state, set_rng_state


def _checkpoint(root: Path, step: int) -> Path:
    path = root / f"step_{step:09d}"
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(path), no_dist=True)
    files = {f.name: f.stat().st_size for f in path.iterdir()}
    (path / MARKER).write_text(json.dumps({"step": step, "world_size": 1, "strategy": "ddp", "files": files}))
    return path


class _Exploit:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch pwned",))


def test_only_complete_untampered_checkpoints_count(
    tmp_path: Path, recwarn: pytest.WarningsRecorder, monkeypatch: pytest.MonkeyPatch
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
    reasons = " ".join(str(w.message) for w in recwarn)
    assert "step_000000020: no commit marker" in reasons
    assert "step_000000030" in reasons and "truncated" in reasons
    assert "step_000000040: unsafe or corrupt .metadata" in reasons
    assert "system is not part of a checkpoint's metadata" in reasons
    assert resolve_resume("auto", tmp_path) == good
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
