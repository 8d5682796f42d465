"""Every config option composes and builds; overrides land where expected; bad input is refused
with a message that names the key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dtf.errors import UserError
from dtf.models import build_model
from dtf.preflight import validate
from tests.helpers.inprocess import compose
from tests.helpers.run_command import dtf_command, run_command

CONF = Path(__file__).parents[2] / "conf"  # the config tree, at the top of the repository
DOCS = Path(__file__).parents[2] / "docs"


def options(group: str) -> list[str]:
    found = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    assert found, f"no options in {CONF / group}"  # a wrong path must not parametrize nothing
    return found


# model=hf needs a folder save_pretrained wrote: tests/unit/test_hf_model.py covers it.
@pytest.mark.parametrize("name", [n for n in options("model") if n != "hf"])
def test_every_model_builds_and_runs_forward(name: str) -> None:
    cfg = compose(f"model={name}")
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


# data=parquet (and data=petastorm, its former name) reads files instead of building a Dataset:
# tests/unit/test_parquet_config.py covers it; data=text, tests/unit/test_text_data.py.
@pytest.mark.parametrize("name", [n for n in options("data") if n not in ("parquet", "petastorm", "text")])
def test_every_data_option_builds_train_and_test(name: str) -> None:
    cfg = compose(f"data={name}")
    validate(cfg)
    train, test = instantiate(cfg.data.dataset)
    assert len(train) > len(test) > 0
    x, _ = train[0]
    model = build_model(compose("model=approximator" if name == "scalar_field" else "model=mnist_cnn").model)
    assert model(x.unsqueeze(0)).shape[0] == 1


@pytest.mark.parametrize("name", options("optimizer"))
def test_every_optimizer_builds_from_parameters(name: str) -> None:
    cfg = compose(f"optimizer={name}")
    validate(cfg)
    opt = instantiate(cfg.optimizer)(torch.nn.Linear(2, 1).parameters())
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups[0]["lr"] == cfg.optimizer.lr


@pytest.mark.parametrize("name", options("scheduler"))
def test_every_scheduler_builds(name: str) -> None:
    from dtf.train.schedule import build_scheduler

    cfg = compose(f"scheduler={name}")
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
    cfg = compose(f"loss={name}")
    assert isinstance(instantiate(cfg.loss), torch.nn.Module)


@pytest.mark.parametrize("group", ["strategy", "launcher", "trainer", "experiment"])
def test_every_option_of_dtf_owned_groups_composes_and_validates(group: str) -> None:
    # what an option needs from the user besides its name
    needs = {"trainer=function": ["trainer.fn._target_=maggy_function.train"]}  # tests/helpers
    for name in options(group):
        prefix = "+" if group == "experiment" else ""
        validate(compose(f"{prefix}{group}={name}", *needs.get(f"{group}={name}", [])))


def test_overrides_land_where_expected() -> None:
    cfg = compose("launcher.nproc=1", "optimizer.lr=3e-3", "trainer.max_epochs=3", "data.batch_size=128")
    assert (cfg.launcher.nproc, cfg.optimizer.lr, cfg.trainer.max_epochs, cfg.data.batch_size) == (1, 3e-3, 3, 128)
    cnn = compose("+experiment=digits_cnn")
    assert cnn.model._target_.endswith("MnistCNN") and cnn.loss._target_ == "torch.nn.NLLLoss"
    assert cnn.data.dataset._target_.endswith("digits")


def test_user_target_swaps_in_without_changing_dtf() -> None:
    cfg = compose("model._target_=wide.Wide", "model.hidden=8")  # tests/helpers/wide.py, outside dtf
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
        compose(override)
    text = str(err.value) + str(err.value.__cause__ or "")
    for name in names:
        assert name in text


@pytest.mark.parametrize(
    ("override", "line"),
    [
        # lightning-hydra-template's spelling of an experiment: a group the defaults do not choose from
        (
            "experiment=digits_cnn",
            "experiment is a config group the defaults do not choose from: add one of its "
            "options with +experiment=digits_cnn",
        ),
        # Lightning Trainer's arguments: their equivalents, not a list of dtf's keys
        ("trainer.fast_dev_run=true", "trainer.fast_dev_run is not a setting of dtf's trainer (use debug=fast:"),
        (
            "trainer.val_check_interval=0.5",
            "trainer.val_check_interval is not a setting of dtf's trainer (use trainer.eval_every_n_epochs",
        ),
        ("trainer.devices=4", "trainer.devices is not a setting of dtf's trainer (use launcher.nproc"),
        ("trainer.accumulate_grad_batches=4", "(use trainer.grad_accum_steps)"),
        ("trainer.max_time=00:01:00", "(dtf has no time limit: bound the run with trainer.max_steps"),
        ("trainer.max_step=3", "trainer.max_step is not a setting of dtf's trainer (did you mean trainer.max_steps?)"),
    ],
)
def test_a_composition_error_is_dtfs_line_with_the_equivalent(override: str, line: str) -> None:
    from dtf.config.keys import config_error_line

    with pytest.raises(ConfigCompositionException) as err:
        compose(override)
    assert line in config_error_line(err.value)


def test_a_lightning_key_added_with_a_plus_is_refused_naming_its_equivalent() -> None:
    with pytest.raises(UserError, match=r"trainer.fast_dev_run is not a setting of dtf's trainer \(use debug=fast"):
        validate(compose("+trainer.fast_dev_run=1"))


BF16_ACROSS_KEY = "strategy.cross_group_dtype"
BF16_ACROSS = [f"{BF16_ACROSS_KEY}=bfloat16"]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["launcher.nproc=0"], "launcher.nproc"),
        (["launcher.start_method=forkservr"], "launcher.start_method"),
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
        (["strategy=ddp", "strategy.bucket_cap_mb=0"], "strategy.bucket_cap_mb"),
        (["strategy=mics", "launcher.nproc=4", "strategy.partition_group_size=3"], "strategy.partition_group_size"),
        (["strategy=mics", "launcher.nproc=2", "strategy.partition_group_size=4"], "strategy.partition_group_size"),
        (["strategy=mics", "strategy.partition_group_size=some"], "strategy.partition_group_size"),
        (["strategy=mics", "strategy.cross_group_dtype=float16"], "strategy.cross_group_dtype"),
        (["strategy=mics", "launcher.nproc=2", "strategy.partition_group_size=2", *BF16_ACROSS], BF16_ACROSS_KEY),
        (["strategy=mics", "trainer.precision=bf16-true", *BF16_ACROSS], BF16_ACROSS_KEY),
        (["strategy=fsdp", "strategy.block_classes=[NoSuchBlock]"], "strategy.block_classes"),
        (["strategy=fsdp", "strategy.param_dtype=bf17"], "strategy.param_dtype"),
        # no gcsfs here or on CI: the line names the package to install (s3:// is written to: test_s3_checkpoint.py)
        (["checkpoint.dir=gs://bucket/run1"], "checkpoint.dir=gs://bucket/run1: no file system for gs://"),
        (["checkpoint.resume=gs://bucket/run1/step_000000010"], "checkpoint.resume=gs://bucket/run1/step_000000010"),
        # options for a store where dir and resume are both local folders would reach nothing
        (["+checkpoint.storage_options.key=k"], "checkpoint.storage_options"),
    ],
)
def test_validation_errors_name_the_key_and_the_fix(overrides: list[str], key: str) -> None:
    with pytest.raises(UserError) as err:
        validate(compose(*overrides))
    message = str(err.value)
    assert message.startswith(key) and "\n" not in message


# A fresh interpreter that imports hydra (and omegaconf, to print) and nothing of dtf: Hydra imports
# dtf.conf to read the tree, and that must be all the tree needs. argv: a config dir of one's own
# (or "-": dtf's tree), the primary config's name, then the overrides.
FRESH_COMPOSE = """
import sys
from hydra import compose, initialize_config_dir, initialize_config_module
from omegaconf import OmegaConf

config_dir, name, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
if config_dir == "-":
    init = initialize_config_module("dtf.conf", version_base="1.3")
else:
    init = initialize_config_dir(config_dir, version_base="1.3")
with init:
    cfg = compose(name, overrides=overrides)
assert "dtf.cli" not in sys.modules and "dtf.api" not in sys.modules, "composing imported dtf's entry points"
print(OmegaConf.to_yaml(cfg), end="")
"""


def _fresh_compose(config_dir: str, name: str, *overrides: str, cwd: Path) -> str:
    return run_command([sys.executable, "-c", FRESH_COMPOSE, config_dir, name, *overrides], timeout=120, cwd=cwd).stdout


def test_hydras_compose_api_in_a_fresh_interpreter_gives_the_command_lines_config(tmp_path: Path) -> None:
    overrides = ["strategy=zero", "launcher.nproc=4"]
    composed = _fresh_compose("-", "config", *overrides, cwd=tmp_path)
    printed = run_command(dtf_command(*overrides, "--cfg", "job"), timeout=120, cwd=tmp_path).stdout
    assert composed == printed
    assert "name: zero" in composed and "nproc: 4" in composed


def test_a_users_tree_that_puts_dtfs_on_its_search_path_composes_in_a_fresh_interpreter(tmp_path: Path) -> None:
    # a primary config of the user's own, dtf's config.yaml under it (from pkg://dtf.conf), and an
    # option of the user's in one of dtf's groups
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "train.yaml").write_text("defaults:\n  - config\n  - _self_\nhydra:\n  searchpath:\n    - pkg://dtf.conf\n")
    (conf / "model" / "my_mlp.yaml").write_text("_target_: my_models.MyMLP\nhidden: 16\n")
    overrides = ["model=my_mlp", "strategy=zero", "launcher.nproc=4"]
    composed = _fresh_compose(str(conf), "train", *overrides, cwd=tmp_path)
    printed = run_command(
        dtf_command("--config-dir", conf, *overrides, "--cfg", "job"), timeout=120, cwd=tmp_path
    ).stdout
    assert composed == printed
    assert "_target_: my_models.MyMLP" in composed and "name: zero" in composed


def test_dtf_validate_raises_the_command_lines_one_line(tmp_path: Path) -> None:
    import dtf

    overrides = ["strategy=mics", "launcher.nproc=4", "strategy.partition_group_size=3"]
    cfg = compose(*overrides)
    with pytest.raises(dtf.UserError) as err:
        dtf.validate(cfg)
    cli = run_command(dtf_command(*overrides, f"hydra.run.dir={tmp_path / 'run'}"), expect=2, timeout=120, cwd=tmp_path)
    assert cli.stderr.strip() == f"dtf: error: {err.value}"
    assert "\n" not in str(err.value)


def test_dtf_validate_returns_the_typed_sections_and_leaves_the_config_as_composed() -> None:
    import dtf

    cfg = compose("strategy=zero", "launcher.nproc=4")
    sections = dtf.validate(cfg)
    assert sections.launcher.nproc == 4 and sections.strategy.stage == 1
    assert cfg == compose("strategy=zero", "launcher.nproc=4") and not OmegaConf.is_readonly(cfg)


def test_partition_size_error_lists_the_valid_sizes() -> None:
    with pytest.raises(UserError, match=r"does not divide the world size 4: use one of 1, 2, 4"):
        validate(compose("strategy=mics", "launcher.nproc=4", "strategy.partition_group_size=3"))


def test_block_class_error_lists_the_model_classes() -> None:
    with pytest.raises(UserError, match=r"no module of class NoSuchBlock in the model; its classes are: .*Conv2d"):
        validate(compose("strategy=fsdp", "model=mnist_cnn", "strategy.block_classes=[NoSuchBlock]"))
    validate(compose("strategy=fsdp", "model=mnist_cnn", "strategy.block_classes=[Conv2d,Linear]"))


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
        validate(compose(*overrides))
    assert "\n" not in str(e.value)
    validate(compose(*overrides, "trainer.device=cpu"))  # on the CPU there is no such limit


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

    cfg = compose()
    train = cfg.data.dataset.num_points - cfg.data.dataset.num_test
    steps = cfg.trainer.max_epochs * math.ceil(train / (cfg.launcher.nproc * cfg.data.batch_size))
    every, keep = cfg.checkpoint.every_n_steps, cfg.checkpoint.keep_last
    left = {steps} | {s for s in range(every, steps + 1, every)}
    left = set(sorted(left)[-keep:])
    page = (DOCS / "checkpoints.md").read_text()
    named = {int(n) for n in re.findall(r"checkpoints/step_(\d{9})", page)}
    assert named and named <= left, (named, left)
