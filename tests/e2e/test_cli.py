"""`python -m dtf` as a user runs it: the default job, --cfg/--help, multirun, a user's own
module, bad input, a failing rank, and an external torchrun."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.run_command import dtf_command, run_command, run_dtf

SHORT = ["trainer.max_epochs=1", "data.dataset.num_points=2000", "data.dataset.num_test=400"]


def test_default_job_trains_and_writes_its_run_dir(dtf) -> None:  # type: ignore[no-untyped-def]
    run = dtf(*SHORT)
    s = run.summary
    for key in (
        "world_size",
        "strategy",
        "launcher",
        "global_step",
        "steps_per_rank",
        "final_train_loss",
        "final_test_loss",
        "samples_per_sec",
        "step_time_s",
        "model_state_bytes",
        "params_sha256",
        "resumed_from_step",
    ):
        assert key in s, key
    assert (s["world_size"], s["strategy"], s["launcher"]) == (2, "ddp", "local")
    assert s["steps_per_rank"] == [25, 25] and s["global_step"] == 25  # 1600 samples / 2 ranks / 32 per batch
    assert s["resumed_from_step"] is None and s["params_sha256_consistent"]
    assert len(s["params_sha256"]) == 64
    # fp32 Adam under DDP: params + grads + 2 moments = 16 bytes per parameter (+ 4 per step counter)
    num_params = (2 * 100 + 100) + (100 * 100 + 100) + (100 + 1)
    assert s["model_state_bytes"] == [16 * num_params + 4 * 6] * 2
    assert s["step_time_s"] > 0 and s["samples_per_sec"] > 0
    assert (run.run_dir / ".hydra" / "config.yaml").exists()
    assert list((run.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "final train loss" in run.stdout and "test loss" in run.stdout
    _loads_by_position(run.run_dir / "model.pt")


def _loads_by_position(weights_file: Path) -> None:
    """model.pt keeps the module's state_dict() order (what torch.save(model.state_dict()) gives),
    so weights map by position: into Maggy's own approximator, whose layers are named fc1..fc3."""
    import torch
    from torch import nn

    from dtf.models.approximator import Approximator

    weights = torch.load(weights_file, weights_only=True)
    assert list(weights) == list(Approximator().state_dict())
    maggy = nn.ModuleDict({"fc1": nn.Linear(2, 100), "fc2": nn.Linear(100, 100), "fc3": nn.Linear(100, 1)})
    maggy.load_state_dict(dict(zip(maggy.state_dict(), weights.values(), strict=True)))
    assert torch.equal(maggy["fc3"].bias, weights["net.4.bias"])


def test_tensorboard_has_the_promised_scalars(dtf) -> None:  # type: ignore[no-untyped-def]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = dtf(*SHORT, "trainer.log_every_n_steps=10", "launcher.nproc=1")
    tags: set[str] = set()
    for events in (run.run_dir / "tensorboard").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {
        "train/loss_rank0",
        "train/lr",
        "train/samples_per_sec",
        "train/epoch_loss",
        "test/loss",
        "test/rmse",
    } <= tags
    assert any(t.startswith("hparam/") for t in tags)


def test_cfg_job_prints_the_composed_config() -> None:
    out = run_command(dtf_command("optimizer.lr=0.5", "--cfg", "job"), timeout=120).stdout
    assert "lr: 0.5" in out and "_target_: dtf.models.approximator.Approximator" in out


def test_help_lists_groups_and_options() -> None:
    out = run_command(dtf_command("--help"), timeout=120).stdout
    for line in (
        "model: approximator, deep_mlp, hf, mnist_cnn",
        "data: digits, fake_images, parquet, petastorm, scalar_field, text",
        "strategy: auto, ddp, fsdp, mics, zero",
        "launcher: local, slurm, spark",
        "debug: fast, limit, overfit, profile",
    ):
        assert line in out
    assert "schema" not in out  # dtf's schemas are not options a user picks


def test_a_quick_check_on_a_validation_split_with_early_stopping_and_the_best_checkpoint(dtf) -> None:  # type: ignore[no-untyped-def]
    # As a user checks a config before a long run: debug=fast with the validation and selection keys on.
    run = dtf(
        "debug=fast",
        "data.val_fraction=0.1",
        "trainer.eval_every_n_steps=1",
        "trainer.early_stopping.patience=5",
        "checkpoint.keep_best=1",
    )
    s = run.summary
    assert s["objective_name"] == "val/loss" and [e["step"] for e in s["evaluations"]] == [1, 2]
    assert s["best_step"] in (1, 2) and s["best_objective"] == min(e["val/loss"] for e in s["evaluations"])
    assert "test at the end: test loss " in run.stdout and "selecting on the test set" not in run.stdout
    assert (run.run_dir / "best_model.pt").is_file() and s["best_weights_file"] == "best_model.pt"


def test_multirun_runs_each_job_in_its_own_dir(tmp_path: Path) -> None:
    run_dtf(["optimizer.lr=1e-3,1e-2", *SHORT], tmp_path / "sweep", multirun=True)
    # two jobs and nothing else: no rank started a sweep of its own by re-parsing the command line
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1"]
    assert {p.name for p in (tmp_path / "sweep").iterdir() if not p.is_dir()} == {
        "multirun.yaml",
        "report.md",  # the sweep's report, and its plots
        "curves.png",
        "objective_vs_optimizer.lr.png",
    }
    summaries = [json.loads((tmp_path / "sweep" / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [s["world_size"] for s in summaries] == [2, 2]
    assert summaries[0]["final_train_loss"] != summaries[1]["final_train_loss"]
    lrs = [json.loads((tmp_path / "sweep" / str(i) / "summary.json").read_text())["lr_final"] for i in (0, 1)]
    assert lrs == [pytest.approx(2e-3), pytest.approx(2e-2)]  # each job got its own override (x2 ranks)


def test_a_sweep_through_hydras_joblib_launcher_runs_its_points_side_by_side(tmp_path: Path) -> None:
    # joblib's loky workers have a start method ("loky") that a spawned rank cannot recreate
    run_dtf(
        ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "optimizer.lr=1e-3,2e-3", "launcher.nproc=1", *SHORT],
        tmp_path / "sweep",
        multirun=True,
    )
    summaries = [json.loads((tmp_path / "sweep" / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [s["lr_final"] for s in summaries] == [pytest.approx(1e-3), pytest.approx(2e-3)]
    assert summaries[0]["params_sha256"] != summaries[1]["params_sha256"]


def test_user_model_from_a_module_outside_the_repo(dtf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pkg = tmp_path / "userland" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    shutil.copy(Path(__file__).parents[1] / "helpers" / "wide.py", pkg / "nets.py")
    run = dtf("model._target_=mypkg.nets.Wide", *SHORT, extra_pythonpath=[tmp_path / "userland"])
    # Wide(in=2, hidden=100 from the default model config, out=1): Linear(2,100) + Linear(100,1)
    assert run.summary["model_state_bytes"][0] == 16 * (2 * 100 + 100 + 100 + 1) + 4 * 4


def test_ranks_on_one_machine_share_its_cores(dtf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # As torchrun does: each rank's OpenMP/BLAS pools and torch's threads get its share of the
    # cores, not pools sized for the whole machine on every rank; and each rank is a session of its
    # own, so the kernel's autogroup scheduler gives every rank a fair share of the cores.
    dtf("model._target_=user_models.ThreadsReport", f"+model.report_dir={tmp_path}", *SHORT)
    share = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))  # a user's own is kept
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"threads_{rank}.json").read_text())
        assert seen == {"OMP_NUM_THREADS": share, "torch_threads": int(share), "own_session": True}, (rank, seen)
    if "OMP_NUM_THREADS" not in os.environ:  # launcher.env sets it for the ranks, from their start
        one = ["launcher.nproc=1", "+launcher.env.OMP_NUM_THREADS=1"]  # 1 rank alone would get every core
        dtf("model._target_=user_models.ThreadsReport", f"+model.report_dir={tmp_path}", *SHORT, *one)
        seen = json.loads((tmp_path / "threads_0.json").read_text())
        assert seen == {"OMP_NUM_THREADS": "1", "torch_threads": 1, "own_session": True}, seen


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["launcher.nproc=0"], "launcher.nproc"),
        (["optimizer.lr=-1"], "optimizer.lr"),
        (["data.batch_size=0"], "data.batch_size"),
        (["model._target_=mypkg.nets.Missing"], "model._target_"),
        (["checkpoint.stop_signals=[SIGTERM,SIGSTOP]"], "checkpoint.stop_signals"),
        # a section your own function never reads (it builds its optimizer): refused, not ignored
        (["trainer=function", "trainer.fn._target_=returned_values.accuracy", "optimizer.lr=0.5"], "optimizer.lr"),
    ],
)
def test_bad_values_give_one_line_and_no_traceback(dtf, args: list[str], key: str) -> None:  # type: ignore[no-untyped-def]
    run = dtf(*args, expect=2)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dtf: error: {key}"), run.stderr
    assert not (run.run_dir / "summary.json").exists()


@pytest.mark.parametrize(
    ("args", "path"),
    [
        (["hydra.run.dir=/proc/dtf-run"], "/proc/dtf-run"),  # a directory that cannot be made
        (["-m", "hydra.sweep.dir=/proc/dtf-sweep", "optimizer.lr=1e-3,2e-3"], "/proc/dtf-sweep"),
    ],
)
def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path: Path, args: list[str], path: str) -> None:
    proc = run_command(dtf_command(*args), expect=2, timeout=120, cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dtf: error: hydra.{'sweep' if '-m' in args else 'run'}.dir={path}")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["strategy=nope"],
            "In 'config': Could not find 'strategy/nope' Available options in 'strategy': auto ddp fsdp",
        ),
        (
            ["trainer.max_step=2"],
            "trainer.max_step is not a setting of dtf's trainer (did you mean trainer.max_steps?)",
        ),
        (["trainer.max_step=1,2"], "trainer.max_step is not a setting of dtf's trainer (did you mean trainer.max_st"),
        # a wrong type: the key, the value and the type it needs
        (
            ["trainer.max_epochs=abc"],
            "Error merging override trainer.max_epochs=abc: Value 'abc' of type 'str' could not be converted to Int",
        ),
        # keys no dtf section reads, as other tools spell them: refused, never silently ignored
        (["+ckpt_path=/x/last.ckpt"], "ckpt_path is not a setting of dtf: a run resumes from checkpoint.resume"),
        (["+loggers=[mlflow]"], "loggers is not a setting of dtf: choose loggers with the logger group: logger=["),
        (["+my_root=/data"], "my_root is not a setting of dtf: a value of your own goes under extra (+extra.my_root"),
    ],
)
def test_a_command_line_hydra_cannot_compose_is_one_line(dtf, args: list[str], line: str) -> None:  # type: ignore[no-untyped-def]
    run = dtf(*args, multirun="," in args[0], expect=2)  # bad input, not a failed rank (Hydra's own exit status is 1)
    lines = [text for text in run.stderr.splitlines() if text.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dtf: error: {line}"), run.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["data.dataset._target_=user_models.one_sample"], "data.dataset has 1 training samples for 2 ranks"),
        # a metric's class, which the ranks of a local run check (the driver does not import torchmetrics)
        (["metrics=accuracy"], "metrics.accuracy (MulticlassAccuracy) judges classes, but the loss (MSELoss)"),
        # raised inside a _target_, which Hydra's instantiate wraps in its own exception
        (["data.dataset.num_points=2000"], "data.dataset.num_test=2000 must be between 1 and num_points-1"),
        # raised on one rank only, in the middle of training
        (["model._target_=user_models.FailingModel", "+model.how=user_error"], "model.fail_rank=1: injected bad"),
        # ... whose rank then dies of a signal on its way out, after it recorded its error
        (
            ["model._target_=user_models.FailingModel", "+model.how=user_error", "+model.abort_at_exit=true"],
            "model.fail_rank=1: injected bad",
        ),
    ],
)
def test_user_error_inside_a_rank_is_one_line(dtf, args: list[str], message: str) -> None:  # type: ignore[no-untyped-def]
    run = dtf(*args, expect=2)  # bad input, wherever it is found (as on the driver)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dtf: error: {message}"), run.stderr


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_raises_fails_the_run_within_seconds(dtf, rank: int) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    run = dtf(
        "model._target_=user_models.FailingModel", f"+model.fail_rank={rank}", "trainer.dist_timeout_s=600", expect=1
    )
    elapsed = time.monotonic() - start
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dtf: error: rank {rank} failed: RuntimeError: injected failure on rank {rank}"), run.stderr
    # whichever rank it is, its traceback is shown once, the same way, just before that line
    assert run.stderr.count(f"--- traceback of rank {rank} ---") == 1, run.stderr
    assert run.stderr.count("Traceback (most recent call last)") == 1, run.stderr
    assert "in forward" in run.stderr
    assert elapsed < 60  # start-up + failure detection; the collective timeout (600 s) never matters
    assert not (run.run_dir / "summary.json").exists()


def test_a_failed_run_leaves_nothing_in_the_temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's spawn writes each failing rank's traceback to a pytorch-errorfile-*.pickle in the temp dir
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    run = run_dtf(["model._target_=user_models.FailingModel", "+model.fail_rank=1", *SHORT], tmp_path / "run", expect=1)
    # nor multiprocessing's temp dirs (a failed rank ends without removing its own)
    left = list(temp.glob("pytorch-errorfile-*")) + list(temp.glob("pymp-*"))
    assert not left, sorted(p.name for p in temp.iterdir())
    # the failed rank's error is kept with the run's logs, in the directory the error line names
    logs = tmp_path / "run" / "logs"
    kept = sorted(str(p.relative_to(logs)) for p in logs.rglob("*"))
    found = list(logs.glob("*/attempt_0/1/error.json"))
    assert found, f"kept with the run's logs instead: {kept}\n{run.stderr[-3000:]}"


def test_a_rank_killed_by_a_signal_fails_the_run_within_seconds(dtf) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    run = dtf("model._target_=user_models.FailingModel", "+model.how=kill", "trainer.dist_timeout_s=600", expect=1)
    assert "rank 1 failed" in run.stderr and "SIGKILL" in run.stderr, run.stderr
    assert time.monotonic() - start < 60


# launcher.max_restarts: tests/e2e/test_checkpoint.py (a restart resumes from the newest checkpoint)
# and tests/e2e/test_multinode.py (an elastic run's restarts after a lost node).


def test_runs_in_place_under_an_external_torchrun(dtf) -> None:  # type: ignore[no-untyped-def]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    external = dtf(*SHORT, python=torchrun)
    spawned = dtf(*SHORT)
    assert external.summary["world_size"] == 2
    assert external.summary["params_sha256"] == spawned.summary["params_sha256"]


def test_a_rendezvous_port_already_taken_is_one_line(dtf) -> None:  # type: ignore[no-untyped-def]
    # The first node of a multi-node run hosts the rendezvous on the port it was given: one taken by
    # another program is bad input (another port), said in one line, not torch's traceback.
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = dtf(
            "launcher.nnodes=2",
            "launcher.node_rank=0",
            f"launcher.rdzv_endpoint=127.0.0.1:{port}",
            "launcher.nproc=1",
            timeout=120,
            expect=2,
        )
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith(f"dtf: error: launcher.rdzv_endpoint=127.0.0.1:{port}: "), lines[0]
    assert "address already in use" in lines[0] and "free port" in lines[0], lines[0]
