"""The built-in scenarios learn for real, and a user's several-module model trains by its own step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dtf.config.store import recipe_names
from dtf.testing import experiments

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def test_mnist_cnn_reaches_97_percent_on_the_real_digits_with_the_experiments_defaults(dtf) -> None:  # type: ignore[no-untyped-def]
    # Horovod's MNIST example's recipe on 2 ranks, as a user runs it: python -m dtf +experiment=digits_cnn
    run = dtf("+experiment=digits_cnn", "checkpoint.every_n_steps=null")
    s = run.summary
    assert s["world_size"] == 2 and s["objective_name"] == "test/accuracy" and s["objective_mode"] == "max"
    assert s["objective"] == s["final_metrics"]["test/accuracy"] >= 0.97, s["final_metrics"]  # chance: 0.10


def test_fake_images_throughput_run(dtf) -> None:  # type: ignore[no-untyped-def]
    run = dtf(
        "model=mnist_cnn",
        "data=fake_images",
        "loss=nll",
        "metrics=accuracy",
        "data.dataset.num_samples=512",
        "data.dataset.num_test=64",
        "trainer.max_epochs=1",
    )
    assert run.summary["global_step"] == 4 and run.summary["samples_per_sec"] > 0


def test_several_modules_with_a_user_step_function(dtf) -> None:  # type: ignore[no-untyped-def]
    run = dtf(
        f"hydra.searchpath=[file://{HELPERS / 'user_conf'}]",
        "model=two_tower",
        "+trainer.step_fn._target_=user_models.encoder_head_step",
        "+trainer.step_fn._partial_=true",
        "trainer.max_epochs=3",
    )
    s = run.summary
    assert s["params_sha256_consistent"]
    assert s["final_test_loss"] < 0.5  # z = sin(y) + cos(x) has variance ~1; a trained net is far below


# ---- every experiment and recipe (conf/experiment/*.yaml, recipes/*.yaml), so that none can rot ----
# With dtf's own pytest plugin (dtf.testing), as a user's project tests its own: dtf_run's tiny
# budget (2 steps on 2 local ranks), and a smaller model where the recipe's is the point (its
# measured run: recipes/README.md).
SMALLER = {"+recipe=sagemaker_vit": ["model.num_hidden_layers=1"]}


def test_the_recipes_are_found() -> None:
    assert {"maggy_approximator", "horovod_mnist", "alcf_scaling", "slurm_preemption"} <= set(recipe_names())
    assert {f"+recipe={name}" for name in recipe_names()} < set(experiments())
    assert "+experiment=digits_cnn" in experiments()


def _sweep_points(experiment: str) -> list[list[str]]:
    """The points of the sweep an experiment or recipe defines (hydra.sweeper.params), if any."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dtf.api import _compose

    params = _compose([experiment], None, "sweep")[2].sweeper.get("params") or {}
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    return [p for batch in BasicSweeper.split_arguments(parsed, None) for p in batch]


@pytest.fixture(scope="module")
def stdlib_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hf_causal_lm's starting point as its prepare script makes it, smaller: 300 docstrings, a
    2-layer Llama of hidden size 64."""
    out = tmp_path_factory.mktemp("stdlib_lm")
    script = Path(__file__).parents[2] / "recipes" / "hf_causal_lm_prepare.py"
    small = ["--max-docs=300", "--vocab-size=400", "--hidden-size=64", "--layers=2", "--max-positions=128"]
    subprocess.run([sys.executable, str(script), f"--out={out}", *small], check=True, capture_output=True)
    return out


def _its_files(experiment: str, request: pytest.FixtureRequest) -> list[str]:
    """Where a recipe reads files its own script prepares: those, made small."""
    if experiment != "+recipe=hf_causal_lm":
        return []
    lm = request.getfixturevalue("stdlib_lm")
    return [f"model.name_or_path={lm / 'model'}", f"data.path={lm / 'corpus' / 'train.jsonl'}", "data.seq_len=64"]


@pytest.mark.parametrize("experiment", experiments())
def test_every_experiment_and_recipe_composes_validates_and_runs_for_a_tiny_budget(  # type: ignore[no-untyped-def]
    dtf_compose, dtf_run, experiment: str, request: pytest.FixtureRequest
) -> None:
    files = _its_files(experiment, request)
    dtf_compose(experiment, *files)  # as written (but for the files it reads), its own launcher included
    for point in _sweep_points(experiment):  # a sweep recipe: each of its points composes and validates too
        dtf_compose(experiment, *files, *point)
    # and it trains, for a few steps on 2 local ranks
    summary = dtf_run(experiment, *files, *SMALLER.get(experiment, []))
    assert summary["global_step"] == 2 and summary["world_size"] == 2 and summary["params_sha256_consistent"]


def test_ddp_of_the_632m_vit_is_refused_before_it_starts_in_one_line(dtf) -> None:  # type: ignore[no-untyped-def]
    from dtf.memory import host_memory_available

    # 4 DDP replicas of the 32-layer ViT-H with AdamW's state: 37.6 GiB. On a machine with more
    # free memory than that, deepen it until 4 replicas cannot fit there either (each layer of
    # width 1280 adds 19.7 M parameters, 16 bytes each, on every rank).
    per_layer = 4 * 16 * 19.7e6
    layers = max(32, int((host_memory_available() or 0) / per_layer) + 1)
    run = dtf("+recipe=sagemaker_vit", "model=vit_huge", f"model.num_hidden_layers={layers}", "strategy=ddp", expect=2)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("dtf: error: trainer.memory_check: the model's state needs"), lines[0]
    assert "M parameters" in lines[0] and "DDP: a full replica on every rank" in lines[0]
    # refused on the driver: no rank started (none named; no rank's logs), nothing written
    assert lines[0].endswith("or set trainer.memory_check=warn to run anyway"), lines[0]
    assert not (run.run_dir / "logs").exists()
    assert not (run.run_dir / "summary.json").exists() and not (run.run_dir / "checkpoints").exists()


def test_strategy_auto_with_a_model_that_fits_under_no_strategy_is_refused_in_one_line(dtf) -> None:  # type: ignore[no-untyped-def]
    from dtf.memory import host_memory_available

    # Sharded over the node's 4 ranks, the node holds one model's state in all: deepen ViT-H until
    # even that cannot fit here (each layer: 19.7 M parameters, 16 bytes each with AdamW), with half
    # the free memory again to spare (it moves while other tests run).
    layers = max(32, int(1.5 * (host_memory_available() or 0) / (16 * 19.7e6)) + 1)
    run = dtf("+recipe=sagemaker_vit", "model=vit_huge", f"model.num_hidden_layers={layers}", "strategy=auto", expect=2)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("dtf: error: trainer.memory_check: the model's state needs"), lines[0]
    assert (
        "ZeRO-3: all sharded over 4 ranks" in lines[0] and "strategy=auto finds no strategy it fits under" in lines[0]
    )
    assert not (run.run_dir / "logs").exists() and not (run.run_dir / "summary.json").exists()
