"""lightning-hydra-template's (LHT, ashleve/lightning-hydra-template) test intents, ported onto dtf's
surface (`python -m dtf`, dtf's Hydra configs, `python -m dtf.eval`), one test per LHT test, each
checking a result against something independent (a count from the data, another run), not an exit 0.

Ported here: test_train.py test_train_fast_dev_run, test_train_cpu, test_train_epoch_double_val_loop,
test_train_ddp_sim, test_train_resume; test_eval.py test_train_eval; test_configs.py
test_train_config/test_eval_config; test_sweeps.py test_experiments, test_hydra_sweep and
test_hydra_sweep_ddp_sim (one multirun);
test_datamodules.py test_mnist_datamodule.
Ported elsewhere: hparams_search/mnist_optuna.yaml with its hydra.mode: MULTIRUN, LHT's test_optuna_sweep
and test_optuna_sweep_ddp_sim (2 ranks a trial; tests/e2e/test_dtf_sweeper.py); LHT's key names
(tests/config/test_compose.py).

Not ported (need a GPU, or a Mac): test_train_gpu / test_train_fast_dev_run_gpu, test_train_epoch_gpu_amp
(CUDA only), test_train_mps (Apple's MPS only).
test_optuna_sweep_ddp_sim_wandb is test_optuna_sweep_ddp_sim with logger=wandb (tests/unit/test_loggers.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.run_command import dtf_command, run_command, run_dtf

# 1600 training points / 2 ranks / 32 per batch = 25 steps an epoch (test_cli's default job).
TINY = ["data.dataset.num_points=2000", "data.dataset.num_test=400"]
ONE_EPOCH = [*TINY, "trainer.max_epochs=1", "data.val_fraction=0.1", "trainer.eval_every_n_epochs=0.5"]


@pytest.fixture(scope="module")
def one_epoch_double_val(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One epoch on 2 CPU ranks, validated every half epoch: shared by the cpu, ddp_sim,
    double_val_loop and eval ports."""
    return run_dtf(ONE_EPOCH, tmp_path_factory.mktemp("lht") / "run")


def test_train_fast_dev_run(tmp_path: Path) -> None:
    """LHT test_train_fast_dev_run (trainer.fast_dev_run=True) -> debug=fast: two optimizer steps,
    no checkpoint, whatever the epoch count says."""
    run = run_dtf([*TINY, "debug=fast"], tmp_path / "run")
    s = run.summary
    assert s["global_step"] == 2 and not (run.run_dir / "checkpoints").exists()


def test_train_cpu(one_epoch_double_val: Any) -> None:
    """LHT test_train_cpu (trainer.accelerator=cpu, one epoch) -> dtf on CPU for max_epochs=1: the
    epoch's steps are counted from the data: 2000 points less 400 for test less 10 % for validation
    leave 1440, 720 a rank, in batches of 32 with the last one partial: 23 steps on each rank."""
    s = one_epoch_double_val.summary
    per_rank = (2000 - 400) * 9 // 10 // 2
    assert s["steps_per_rank"] == [math.ceil(per_rank / 32)] * 2 == [s["global_step"]] * 2
    assert math.isfinite(s["final_train_loss"])


def test_train_resume(one_epoch_double_val: Any, tmp_path: Path) -> None:
    """LHT test_train_resume (a run of one epoch, then the same run resumed from its last.ckpt for a
    second) -> a run stopped at step 12 (mid-epoch, at its first validation) and run again in its run
    dir (checkpoint.resume=auto) ends with the same weights as the run that never stopped."""
    run_dtf([*ONE_EPOCH, "trainer.max_steps=12"], tmp_path / "run")
    resumed = run_dtf(ONE_EPOCH, tmp_path / "run").summary
    straight = one_epoch_double_val.summary
    assert resumed["resumed_from_step"] == 12
    assert (resumed["global_step"], resumed["params_sha256"]) == (straight["global_step"], straight["params_sha256"])


def test_train_epoch_double_val_loop(one_epoch_double_val: Any) -> None:
    """LHT test_train_epoch_double_val_loop (val_check_interval=0.5) -> trainer.eval_every_n_epochs=0.5:
    the run's metrics hold two validations in its one epoch, at the half and at the end."""
    s = one_epoch_double_val.summary
    steps = [e["step"] for e in s["evaluations"]]
    assert steps == [math.ceil(s["global_step"] / 2), s["global_step"]]
    assert all("val/loss" in e for e in s["evaluations"])


def test_train_ddp_sim(one_epoch_double_val: Any) -> None:
    """LHT test_train_ddp_sim (strategy=ddp_spawn, devices=2 on CPU) -> launcher.nproc=2 (dtf's
    default) with strategy=ddp: two ranks, one set of weights at the end."""
    s = one_epoch_double_val.summary
    assert (s["world_size"], s["strategy"]) == (2, "ddp") and s["params_sha256_consistent"]


def test_train_eval(one_epoch_double_val: Any) -> None:
    """LHT test_eval.py test_train_eval (train, then eval.py on its ckpt_path: the test metric equals
    the training run's) -> `python -m dtf.eval <run dir>` on the run's last checkpoint gives the test
    loss the run reported."""
    run_dir, s = one_epoch_double_val.run_dir, one_epoch_double_val.summary
    run_command(dtf_command(run_dir, "trainer.progress=off", module="dtf.eval"), timeout=300)
    checkpoint = run_dir / "checkpoints" / f"step_{s['global_step']:09d}"
    record = json.loads((checkpoint / "eval.json").read_text())
    assert record["step"] == s["global_step"]
    assert record["metrics"]["test/loss"] == pytest.approx(s["final_test_loss"], rel=1e-5)
    assert record["metrics"]["val/loss"] == pytest.approx(s["evaluations"][-1]["val/loss"], rel=1e-5)


@pytest.mark.parametrize("experiment", [None, "digits_cnn", "fake_images_cnn"])
def test_train_config(experiment: str | None) -> None:
    """LHT test_configs.py test_train_config / test_eval_config (the configs compose and their
    datamodule, model and trainer instantiate) -> dtf's config composes and validates as the
    driver does, with each of its experiments, and the model it names builds."""
    import hydra

    from tests.helpers.inprocess import compose_config

    cfg = compose_config([f"+experiment={experiment}"] if experiment else [])
    model = hydra.utils.instantiate(cfg.model)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_experiments_and_hydra_sweep(tmp_path: Path) -> None:
    """LHT test_sweeps.py test_experiments (-m experiment=glob(*) with fast_dev_run) and
    test_hydra_sweep (-m model.optimizer.lr=0.005,0.01 with fast_dev_run) and test_hydra_sweep_ddp_sim
    (the same on 2 CPU processes a job) -> one multirun of dtf's experiments crossed with two learning
    rates under debug=fast on dtf's default 2 CPU ranks: 2 x 2 jobs, each in its own dir, each with
    its own point of the grid, two steps taken and 2 ranks."""
    sweep = tmp_path / "sweep"
    grid = ["+experiment=digits_cnn,fake_images_cnn", "optimizer.lr=0.005,0.01"]
    run_dtf([*grid, "debug=fast"], sweep, multirun=True, timeout=300)
    jobs = sorted((p for p in sweep.iterdir() if p.is_dir()), key=lambda p: int(p.name))
    points = set()
    for job in jobs:
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        summary = json.loads((job / "summary.json").read_text())
        assert (summary["global_step"], summary["world_size"]) == (2, 2), job
        points.add(tuple(o for o in ("digits_cnn", "fake_images_cnn", "lr=0.005", "lr=0.01") if o in overrides))
    assert len(jobs) == 4 and len(points) == 4


def test_mnist_datamodule() -> None:
    """LHT test_datamodules.py test_mnist_datamodule (train + val + test sizes add up to MNIST's 70,000,
    a batch has the images' and labels' shapes) -> dtf's digits data (data=digits, MNIST-shaped) with a
    10 % validation split: its splits add up to scikit-learn's own count of digits, and a training
    batch is data.batch_size images of 1 x 28 x 28 with integer labels."""
    import torch
    from sklearn.datasets import load_digits

    from dtf.config.typed import typed
    from dtf.data import loader
    from tests.helpers.inprocess import compose_config, group_of_one

    cfg = typed(compose_config(["+experiment=digits_cnn", "data.val_fraction=0.1"]))
    with group_of_one() as env:
        splits = loader.build_splits(cfg.data, env, seed=0)
        sizes = [len(split.loader.dataset) for split in (splits.train, splits.val, splits.test)]  # type: ignore[union-attr]
        images, labels = next(iter(splits.train.loader))  # type: ignore[attr-defined]  # the loader-backed TrainData of in-memory data
    assert sum(sizes) == len(load_digits().target) and sizes[1] == round(0.1 * (sizes[0] + sizes[1]))
    assert images.shape == (cfg.data.batch_size, 1, 28, 28) and labels.shape == (cfg.data.batch_size,)
    assert labels.dtype == torch.long
