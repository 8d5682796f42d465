"""checkpoint.dir=s3://... on a real S3 endpoint (moto's server on 127.0.0.1, scripts/local-s3.sh):
checkpoints written there through s3fs over HTTP as they would be to AWS, committed by a marker
uploaded last, pruned there, resumed from there at another world size and strategy, and every
bad store refused in one line before anything is written. The proofs are independent of what is
under test: the bucket listed with s3fs, runs compared with runs that never saw S3."""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from dtf.errors import UserError
from dtf.preflight import validate
from dtf.train.checkpoint import reader
from dtf.train.checkpoint_store import RemotePath
from tests.e2e.test_checkpoint import FAILING, _same_run
from tests.e2e.test_s3 import s3  # noqa: F401  # the S3 endpoint of this module (a server of its own)
from tests.helpers.clusters import script_cluster
from tests.helpers.inprocess import compose, train_in_process, train_on_ranks
from tests.helpers.run_command import run_dtf

BUCKET = "dtf-checkpoints"
DCP_FILES = {".metadata", "trainer.pt", "COMMITTED.json"}


def _fs() -> Any:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)


@pytest.fixture(scope="module")
def bucket(s3: dict[str, str]) -> str:  # noqa: F811
    _fs().mkdir(BUCKET)
    return BUCKET


def _objects(prefix: str) -> list[str]:
    """Every object under s3://<prefix>, relative to it, as the server lists them."""
    return sorted(p[len(prefix) + 1 :] for p in _fs().find(prefix))


def _steps(prefix: str) -> list[int]:
    """The committed checkpoints' steps under s3://<prefix> (a marker uploaded), read from the listing."""
    return sorted(int(p.split("/")[0][5:]) for p in _objects(prefix) if p.endswith("/COMMITTED.json"))


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.fixture
def fetched(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The bytes s3fs fetches in this process, by object: whole objects and ranges (cat_file,
    cat_ranges), and the blocks its file objects read (read-ahead included)."""
    import s3fs.core

    counted: Counter[str] = Counter()
    cat_file = s3fs.core.S3FileSystem._cat_file
    fetch_range = s3fs.core.S3File._fetch_range

    async def counted_cat_file(self: Any, path: str, *args: Any, **kwargs: Any) -> bytes:
        data = await cat_file(self, path, *args, **kwargs)
        counted[self._strip_protocol(path)] += len(data)
        return cast(bytes, data)

    def counted_fetch_range(self: Any, start: int, end: int) -> bytes:
        data = fetch_range(self, start, end)
        counted[self.path] += len(data)
        return cast(bytes, data)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_cat_file", counted_cat_file)
    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", counted_fetch_range)
    return counted


def test_a_kill_9_during_an_asynchronous_save_to_s3_never_commits_it_and_the_rerun_ends_as_the_straight_run(
    bucket: str, tmp_path: Path
) -> None:
    # Rank 1 dies of SIGKILL at step 45 while its writer process (killed with it) uploads step 40's
    # checkpoint in the background; step 40 would be committed only at the exchange of step 50.
    # The straight run keeps its checkpoints on local disk: S3 must change nothing of the training.
    url = f"s3://{bucket}/killed"
    straight = run_dtf([*FAILING, "+model.fail_rank=-1"], tmp_path / "straight")
    kill = ["checkpoint.async_save=true", "+model.how=kill", "+model.fail_at_call=52", f"checkpoint.dir={url}"]
    err = run_dtf([*FAILING, *kill], tmp_path / "run", expect=1).stderr
    assert err.strip().splitlines()[-1].startswith("dtf: error: rank 1 failed: killed by signal SIGKILL"), err[-2000:]
    assert _steps(f"{bucket}/killed") == [20]
    resumed = run_dtf(
        [*FAILING, "+model.fail_rank=-1", "checkpoint.async_save=true", f"checkpoint.dir={url}"], tmp_path / "run"
    )
    assert resumed.summary["resumed_from_step"] == 20
    uploaded_40 = [p for p in _objects(f"{bucket}/killed") if p.startswith("step_000000040/")]
    _same_run(resumed, straight)
    # what the killed writer uploaded of step 40 (if anything) was passed over, never loaded
    assert not uploaded_40 or f"skipping checkpoint {url}/step_000000040: no commit marker" in resumed.stderr
    # the results are beside the checkpoints too, as in the run dir
    assert (tmp_path / "run" / "summary.json").read_bytes() == _fs().cat_file(f"{bucket}/killed/summary.json")
    assert (tmp_path / "run" / "model.pt").read_bytes() == _fs().cat_file(f"{bucket}/killed/model.pt")


def test_keep_last_leaves_exactly_its_checkpoints_and_a_resume_from_2_fsdp_ranks_to_1_ddp_rank_reads_them(
    bucket: str, tmp_path: Path, fetched: Counter[str]
) -> None:
    url = f"s3://{bucket}/fsdp2"
    common = ["data.dataset.num_points=1200", "data.dataset.num_test=200", "checkpoint.every_n_steps=10"]
    saved = [*common, "strategy=fsdp", "trainer.max_steps=45", "checkpoint.keep_last=2", f"checkpoint.dir={url}"]
    train_on_ranks(2, [("fsdp2", [*saved, "checkpoint.export_hf=true"])], tmp_path)
    files = {".metadata", "__0_0.distcp", "__1_0.distcp", "rank_0.pt", "rank_1.pt", "trainer.pt", "COMMITTED.json"}
    expected = [f"step_{s:09d}/{f}" for s in (40, 45) for f in sorted(files)]
    expected += ["model.pt", "summary.json", "hf_export/model.safetensors"]  # the run's results beside them
    assert _objects(f"{bucket}/fsdp2") == sorted(expected)  # no older step, no temporary .metadata.tmp
    # the export read the final checkpoint from S3: the weights model.pt holds
    from safetensors.torch import load

    exported = load(_fs().cat_file(f"{bucket}/fsdp2/hf_export/model.safetensors"))
    whole = _weights(tmp_path / "fsdp2")
    assert exported.keys() == whole.keys() and all(torch.equal(exported[k], whole[k]) for k in whole)
    marker = json.loads(_fs().cat_file(f"{bucket}/fsdp2/step_000000045/COMMITTED.json"))
    assert marker["world_size"] == 2 and set(marker["files"]) == files - {"COMMITTED.json"}

    # The same checkpoint resumed on 1 DDP rank from S3 and from a copy on local disk: the same run.
    local = tmp_path / "copy" / "step_000000045"
    _fs().get(f"{bucket}/fsdp2/step_000000045/", f"{local}/", recursive=True)
    rest = [*common, "trainer.max_steps=60", "checkpoint.at_end=false"]
    fetched.clear()
    from_s3 = train_in_process([*rest, f"checkpoint.resume={url}/step_000000045"], tmp_path / "from_s3")
    # Each data file fetched once: read for its checksum, kept, and loaded from the copy, which is gone.
    shards = {
        f"{bucket}/fsdp2/step_000000045/__{r}_0.distcp": (local / f"__{r}_0.distcp").stat().st_size for r in (0, 1)
    }
    assert {name: fetched[name] for name in shards} == shards
    assert not any(p.name.startswith(".resume") for p in (tmp_path / "from_s3").iterdir())
    from_disk = train_in_process([*rest, f"checkpoint.resume={local}"], tmp_path / "from_disk")
    assert from_s3["resumed_from_step"] == 45 and from_s3["world_size"] == 1
    assert from_s3["resume_s"] is not None and from_s3["resume_s"] > 0
    ours, theirs = _weights(tmp_path / "from_s3"), _weights(tmp_path / "from_disk")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert from_s3["train_loss_per_epoch"] == from_disk["train_loss_per_epoch"]
    # and it continued, not restarted: the first epoch's loss is the FSDP run's, not a fresh one
    fsdp = json.loads((tmp_path / "fsdp2" / "summary.json").read_text())
    assert from_s3["train_loss_per_epoch"][0] == fsdp["train_loss_per_epoch"][0]


def test_a_load_fetches_only_the_byte_ranges_it_reads(bucket: str, fetched: Counter[str]) -> None:
    """Read through s3fs's file objects, DCP's load of one tensor fetched up to 50 MB after it (their
    read-ahead): the tensors saved after it too."""
    first, second = torch.arange(2_000_000, dtype=torch.float32), torch.ones(2_000_000)  # 8 MB each
    url = f"s3://{bucket}/ranges"
    dcp.save({"first": first, "second": second}, storage_writer=FsspecWriter(url), no_dist=True)
    fetched.clear()
    wanted = {"first": torch.zeros_like(first)}  # DCP writes the larger tensors first: "second" lies after it
    dcp.load(wanted, storage_reader=reader(RemotePath(url)), no_dist=True)
    assert torch.equal(wanted["first"], first)
    data = f"{bucket}/ranges/__0_0.distcp"
    assert first.nbytes <= fetched[data] < first.nbytes + 2**16, fetched  # its bytes, and torch.save's header


def test_keep_best_keeps_the_best_evaluations_checkpoint_and_lists_it_in_best_json_there(
    bucket: str, tmp_path: Path
) -> None:
    """Three epochs on one rank, evaluated every half epoch on held-out samples: the newest checkpoint
    and the best evaluation's stay (the best step read from summary.json's evaluations)."""
    url = f"s3://{bucket}/best"
    args = ["data.dataset.num_points=2400", "data.dataset.num_test=400", "data.val_fraction=0.2"]
    args += ["trainer.max_epochs=3", "trainer.eval_every_n_epochs=0.5", "checkpoint.every_n_steps=null"]
    args += ["checkpoint.keep_last=1", "checkpoint.keep_best=1", f"checkpoint.dir={url}"]
    s = train_in_process(args, tmp_path / "best")
    losses = {e["step"]: e["val/loss"] for e in s["evaluations"]}
    best = min(losses, key=lambda k: losses[k])
    steps = sorted({p.split("/")[0] for p in _objects(f"{bucket}/best") if p.startswith("step_")})
    assert steps == sorted({f"step_{best:09d}", f"step_{s['global_step']:09d}"}) and _steps(f"{bucket}/best")
    listed = json.loads(_fs().cat_file(f"{bucket}/best/best.json"))
    assert listed["best"] == [{"step": best, "val/loss": losses[best], "path": f"step_{best:09d}"}]
    assert _fs().cat_file(f"{bucket}/best/best_model.pt") == (tmp_path / "best" / "best_model.pt").read_bytes()


def test_a_damaged_object_is_found_by_the_ranks_checksums_and_never_loaded(bucket: str, tmp_path: Path) -> None:
    url = f"s3://{bucket}/damaged"
    args = ["data.dataset.num_points=640", "data.dataset.num_test=64", "checkpoint.every_n_steps=10"]
    train_on_ranks(2, [("first", [*args, "trainer.max_steps=20", f"checkpoint.dir={url}"])], tmp_path)
    shard = f"{bucket}/damaged/step_000000020/__0_0.distcp"  # all of a small DDP model (dtf.train.save_plan)
    data = bytearray(_fs().cat_file(shard))
    data[-1] ^= 0xFF  # same size: only its checksum tells
    _fs().pipe_file(shard, bytes(data))
    with pytest.raises(UserError) as err:
        train_in_process([*args, "trainer.max_steps=30", f"checkpoint.resume={url}/step_000000020"], tmp_path / "r")
    assert "__0_0.distcp is damaged" in str(err.value)
    again = train_on_ranks(2, [("first", [*args, "trainer.max_steps=30", f"checkpoint.dir={url}"])], tmp_path)
    assert again["first"]["resumed_from_step"] == 10  # resume=auto: the one before it


# ---- bad stores: one line naming the URL and the fix, before anything is written -----------------


def _refused(*overrides: str) -> str:
    with pytest.raises(UserError) as err:
        validate(compose(*overrides))
    line = str(err.value)
    assert "\n" not in line, line
    return line


def test_a_bucket_that_does_not_exist_is_named_in_one_line_and_not_made(bucket: str) -> None:
    line = _refused("checkpoint.dir=s3://no-such-bucket/run1")
    assert line.startswith("checkpoint.dir=s3://no-such-bucket/run1 does not exist"), line
    assert "check the bucket and the path" in line
    assert not _fs().exists("no-such-bucket")


def test_a_prefix_holding_objects_that_are_not_dtfs_is_refused(bucket: str) -> None:
    _fs().pipe_file(f"{bucket}/theirs/data.csv", b"a,b\n")
    line = _refused(f"checkpoint.dir=s3://{bucket}/theirs")
    assert line.startswith(f"checkpoint.dir=s3://{bucket}/theirs holds objects dtf did not write (data.csv)"), line
    assert _objects(f"{bucket}/theirs") == ["data.csv"]


def test_a_fresh_start_in_a_prefix_of_another_runs_checkpoints_is_refused(bucket: str, tmp_path: Path) -> None:
    # an object store has no rename: the earlier run's checkpoints cannot be moved aside as on disk
    url = f"s3://{bucket}/earlier"
    args = ["data.dataset.num_points=320", "data.dataset.num_test=32", "trainer.max_steps=10", f"checkpoint.dir={url}"]
    train_in_process(args, tmp_path / "earlier")
    before = _objects(f"{bucket}/earlier")
    with pytest.raises(UserError) as err:
        train_in_process([*args, "checkpoint.resume=never"], tmp_path / "fresh")
    assert str(err.value).startswith(f"checkpoint.dir={url} holds the checkpoints of an earlier run"), err.value
    assert _objects(f"{bucket}/earlier") == before


def test_an_endpoint_that_does_not_answer_ends_in_one_line_within_the_bounded_wait(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    from dtf import remote

    # shortened to keep the test short: dtf's default is 10 s a read; s3fs's own, 5 tries
    monkeypatch.setattr(remote, "S3_READ_TIMEOUT_S", 1)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes the handshakes; nothing ever answers
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        line = _refused(f"checkpoint.dir=s3://{bucket}/silent")
        took = time.monotonic() - started
    finally:
        silent.close()
    assert line.startswith(f"checkpoint.dir=s3://{bucket}/silent: the storage endpoint did not answer"), line
    assert "AWS_ENDPOINT_URL" in line and took < 30, took


def test_refused_credentials_are_named_in_one_line_with_a_non_zero_exit_and_no_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that checks every request's signature (INITIAL_NO_AUTH_ACTION_COUNT=0), as AWS does
    a key it does not know; through the command line: exit status 2, the line last, no traceback."""
    env = {"DTF_S3_DIR": str(tmp_path / "strict"), "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    with script_cluster("local-s3.sh", "AWS_ENDPOINT_URL", env) as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        done = run_dtf([f"checkpoint.dir=s3://{BUCKET}/run1"], tmp_path / "run", expect=2)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dtf: error: checkpoint.dir=s3://{BUCKET}/run1: access was refused"), done.stderr[-2000:]
    assert "AWS_ACCESS_KEY_ID" in last and "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
