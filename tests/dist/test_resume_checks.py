"""Before a resume from a local disk, the checkpoint's checksums are checked by the ranks, each its
share of the files, as on an object store (tests/e2e/test_s3_checkpoint.py): no process reads the
whole checkpoint, neither the driver's check of a named one nor rank 0. What a damaged file does
then is tests/e2e/test_checkpoint.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.gloo import run_on_ranks
from tests.helpers.inprocess import compose_config, train_on_ranks

ARGS = ["data.dataset.num_points=640", "data.dataset.num_test=64", "strategy=fsdp"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint at step 10 of 2 FSDP ranks (each wrote a DCP file and an RNG state of its own)."""
    root = tmp_path_factory.mktemp("saved")
    train_on_ranks(2, [("run", [*ARGS, "trainer.max_steps=10", "checkpoint.every_n_steps=10"])], root)
    return root / "run" / "checkpoints" / "step_000000010"


def _checks(rank: int, world_size: int, checkpoint: Path, out: Path) -> None:
    """This rank's choice of the checkpoint; the files whose checksums it read, written to out."""
    from dtf.config.typed import typed
    from dtf.dist import env as dist_env
    from dtf.train import checkpoint as ck
    from dtf.train.loop import choose_checkpoint

    read: list[str] = []
    crc32 = ck.file_crc32

    def recorded(path: Path, copy_to: Path | None = None) -> str:
        read.append(path.name)
        return crc32(path, copy_to)

    ck.file_crc32 = recorded  # type: ignore[assignment]
    env = dist_env.init("cpu", "gloo", 60.0)
    run = typed(compose_config([f"launcher.nproc={world_size}", *ARGS, f"checkpoint.resume={checkpoint}"]))
    chosen, copies = choose_checkpoint(run, env, out / f"run-{world_size}")
    assert chosen == checkpoint and copies is None
    (out / f"{world_size}-{rank}.json").write_text(json.dumps(read))


def test_each_file_of_a_local_checkpoint_is_checked_by_one_rank(checkpoint: Path, tmp_path: Path) -> None:
    run_on_ranks(_checks, 2, checkpoint, tmp_path)
    read = [json.loads((tmp_path / f"2-{rank}.json").read_text()) for rank in range(2)]
    files = sorted(p.name for p in checkpoint.iterdir() if p.name != "COMMITTED.json")
    assert sorted(read[0] + read[1]) == files  # each once, by one rank
    # what rank k of the saving run wrote is checked by rank k (the files it loads); the rest shared
    assert {"__0_0.distcp", "rank_0.pt"} <= set(read[0]) and {"__1_0.distcp", "rank_1.pt"} <= set(read[1])


def test_the_drivers_check_of_a_named_checkpoint_reads_no_file_whole(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dtf.train import checkpoint as ck

    def refused(*args: object) -> str:
        raise AssertionError("the driver read a checkpoint file for its checksum")

    monkeypatch.setattr(ck, "file_crc32", refused)
    assert ck.resolve_resume(str(checkpoint), checkpoint) == checkpoint  # its marker and sizes only
