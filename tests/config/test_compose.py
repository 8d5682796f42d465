"""Every config option composes and builds; overrides land where expected; bad input is refused
with a message that names the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import DictConfig

from dtf.config.validate import validate
from dtf.errors import UserError
from dtf.worker import build_model

CONF = Path(__file__).parents[2] / "conf"  # the config tree, at the top of the repository
DOCS = Path(__file__).parents[2] / "docs"


def options(group: str) -> list[str]:
    found = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    assert found, f"no options in {CONF / group}"  # a wrong path must not parametrize nothing
    return found


def make(*overrides: str) -> DictConfig:
    with initialize_config_module(config_module="dtf.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("name", options("model"))
def test_every_model_builds_and_runs_forward(name: str) -> None:
    cfg = make(f"model={name}")
    validate(cfg)
    m = cfg.model
    # the big ViTs on the meta device: shapes, no memory
    with torch.device("meta" if name in ("vit_large", "vit_huge") else "cpu"):
        model = build_model(m)
        if name.startswith("vit"):
            x = torch.randn(3, m.num_channels, m.image_size, m.image_size)
        else:
            x = torch.randn(3, 1, 28, 28) if name == "mnist_cnn" else torch.randn(3, 2)
        assert model(x).shape[0] == 3


# data=petastorm reads files instead of building a Dataset: tests/unit/test_parquet_config.py covers it.
@pytest.mark.parametrize("name", [n for n in options("data") if n != "petastorm"])
def test_every_data_option_builds_train_and_test(name: str) -> None:
    cfg = make(f"data={name}")
    validate(cfg)
    train, test = instantiate(cfg.data.dataset)
    assert len(train) > len(test) > 0
    x, _ = train[0]
    model = build_model(make("model=approximator" if name == "scalar_field" else "model=mnist_cnn").model)
    assert model(x.unsqueeze(0)).shape[0] == 1


@pytest.mark.parametrize("name", options("optimizer"))
def test_every_optimizer_builds_from_parameters(name: str) -> None:
    cfg = make(f"optimizer={name}")
    validate(cfg)
    opt = instantiate(cfg.optimizer)(torch.nn.Linear(2, 1).parameters())
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups[0]["lr"] == cfg.optimizer.lr


@pytest.mark.parametrize("name", options("scheduler"))
def test_every_scheduler_builds(name: str) -> None:
    from dtf.train.schedule import build_scheduler

    cfg = make(f"scheduler={name}")
    validate(cfg)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    factory = instantiate(cfg.scheduler) if cfg.scheduler else None
    sched = build_scheduler(opt, factory, total_steps=100, warmup_steps=5, warmup_start_factor=0.1)
    assert sched is not None
    for _ in range(100):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] <= 0.1


@pytest.mark.parametrize("name", options("loss"))
def test_every_loss_builds(name: str) -> None:
    cfg = make(f"loss={name}")
    assert isinstance(instantiate(cfg.loss), torch.nn.Module)


@pytest.mark.parametrize("group", ["strategy", "launcher", "trainer", "experiment"])
def test_every_option_of_dtf_owned_groups_composes_and_validates(group: str) -> None:
    # what an option needs from the user besides its name
    needs = {"trainer=function": ["trainer.fn._target_=maggy_function.train"]}  # tests/helpers
    for name in options(group):
        prefix = "+" if group == "experiment" else ""
        validate(make(f"{prefix}{group}={name}", *needs.get(f"{group}={name}", [])))


def test_overrides_land_where_expected() -> None:
    cfg = make("launcher.nproc=1", "optimizer.lr=3e-3", "trainer.max_epochs=3", "data.batch_size=128")
    assert (cfg.launcher.nproc, cfg.optimizer.lr, cfg.trainer.max_epochs, cfg.data.batch_size) == (1, 3e-3, 3, 128)
    cnn = make("+experiment=digits_cnn")
    assert cnn.model._target_.endswith("MnistCNN") and cnn.loss._target_ == "torch.nn.NLLLoss"
    assert cnn.data.dataset._target_.endswith("digits")


def test_user_target_swaps_in_without_changing_dtf() -> None:
    cfg = make("model._target_=wide.Wide", "model.hidden=8")  # tests/helpers/wide.py, outside dtf
    validate(cfg)
    assert type(build_model(cfg.model)).__name__ == "Wide"


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("strategy=nope", ["strategy", "ddp"]),  # unknown option lists the valid ones
        ("trainer.max_epoch=3", ["max_epoch", "TrainerConfig"]),  # misspelled key of a dtf schema
        ("trainer.lr_scaling=cubic", ["none", "linear", "sqrt"]),  # wrong enum value lists the choices
        ("launcher.nproc=two", ["launcher.nproc"]),  # wrong type
    ],
)
def test_composition_errors_name_the_key(override: str, names: list[str]) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        make(override)
    text = str(err.value) + str(err.value.__cause__ or "")
    for name in names:
        assert name in text


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["launcher.nproc=0"], "launcher.nproc"),
        (["optimizer.lr=-1"], "optimizer.lr"),
        (["data.batch_size=0"], "data.batch_size"),
        (["trainer.grad_accum_steps=0"], "trainer.grad_accum_steps"),
        (["trainer.max_steps=0"], "trainer.max_steps"),
        (["trainer.grad_clip_norm=-1"], "trainer.grad_clip_norm"),
        (["trainer.dist_backend=mpii"], "trainer.dist_backend"),
        (["model._target_=no_such_pkg.Net"], "model._target_"),
        (["+optimizer.lrr=1"], "optimizer.lrr"),
        (["loss._target_=torch.nn.NoSuchLoss"], "loss._target_"),
        (["+trainer.max_epoch=3"], "trainer.max_epoch"),  # `+` would otherwise add an ignored key
        (["strategy=zero", "strategy.stage=4"], "strategy.stage"),
        (["strategy=mics", "launcher.nproc=4", "strategy.partition_group_size=3"], "strategy.partition_group_size"),
        (["strategy=fsdp", "strategy.block_classes=[NoSuchBlock]"], "strategy.block_classes"),
        (["strategy=fsdp", "strategy.param_dtype=bf17"], "strategy.param_dtype"),
    ],
)
def test_validation_errors_name_the_key_and_the_fix(overrides: list[str], key: str) -> None:
    with pytest.raises(UserError) as err:
        validate(make(*overrides))
    message = str(err.value)
    assert message.startswith(key) and "\n" not in message


def test_partition_size_error_lists_the_valid_sizes() -> None:
    with pytest.raises(UserError, match=r"does not divide the world size 4: use one of 1, 2, 4"):
        validate(make("strategy=mics", "launcher.nproc=4", "strategy.partition_group_size=3"))


def test_block_class_error_lists_the_model_classes() -> None:
    with pytest.raises(UserError, match=r"no module of class NoSuchBlock in the model; its classes are: .*Conv2d"):
        validate(make("strategy=fsdp", "model=mnist_cnn", "strategy.block_classes=[NoSuchBlock]"))
    validate(make("strategy=fsdp", "model=mnist_cnn", "strategy.block_classes=[Conv2d,Linear]"))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["launcher.nproc=2"], "launcher.nproc=2"),  # one GPU per rank, and only one GPU
        (["launcher=slurm", "launcher.tasks_per_node=4", "launcher.gpus_per_node=2"], "launcher.tasks_per_node=4"),
    ],
)
def test_more_ranks_than_gpus_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, overrides: list[str], key: str
) -> None:
    # read, not run, here: no GPU on this machine, so CUDA is faked for the driver's checks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=rf"^{key}.*GPU") as e:
        validate(make(*overrides))
    assert "\n" not in str(e.value)
    validate(make(*overrides, "trainer.device=cpu"))  # on the CPU there is no such limit


def test_deterministic_runs_set_what_cublas_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers.inprocess import train_in_process

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    train_in_process(
        [
            "trainer.deterministic=true",
            "trainer.max_steps=1",
            "data.dataset.num_points=200",
            "data.dataset.num_test=20",
        ],
        tmp_path / "run",
    )
    import os

    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")
    torch.use_deterministic_algorithms(False)


def test_the_configuration_page_lists_every_option_of_every_group() -> None:
    page = (DOCS / "configuration.md").read_text()
    rows = {
        line.split("|")[1].strip(" `"): line.split("|")[2]
        for line in page.splitlines()
        if line.startswith("| `") and line.count("|") >= 4
    }
    groups = sorted(p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("_"))
    for group in groups:
        assert group in rows, f"docs/configuration.md's config table has no row for {group}"
        listed = {o.strip(" `") for o in rows[group].split(",")}
        assert set(options(group)) <= listed, (group, set(options(group)) - listed)


def test_the_launchers_page_gives_the_spark_launchers_default_master() -> None:
    from dtf.config.schema import SparkLauncherConfig
    from dtf.launch.spark import DEFAULT_MASTER

    page = " ".join((DOCS / "launchers.md").read_text().split())
    assert SparkLauncherConfig().master is None  # unset: the active SparkSession, or else ...
    assert f"`launcher.master` (unset: `{DEFAULT_MASTER}`" in page


def test_the_checkpoints_pages_resume_example_names_a_checkpoint_the_default_job_leaves() -> None:
    import math
    import re

    cfg = make()
    train = cfg.data.dataset.num_points - cfg.data.dataset.num_test
    steps = cfg.trainer.max_epochs * math.ceil(train / (cfg.launcher.nproc * cfg.data.batch_size))
    every, keep = cfg.checkpoint.every_n_steps, cfg.checkpoint.keep_last
    left = {steps} | {s for s in range(every, steps + 1, every)}
    left = set(sorted(left)[-keep:])
    page = (DOCS / "checkpoints.md").read_text()
    named = {int(n) for n in re.findall(r"checkpoints/step_(\d{9})", page)}
    assert named and named <= left, (named, left)
