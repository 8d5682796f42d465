"""hydra/sweeper=dtf without training: the search space from Hydra's override syntax, the seeded
sequence of points (also when a sweep continues), one-line refusals, and the pruning answer that
reaches every rank although only rank 0 asks the study."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest
import torch
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from dtf.config.schema import TrialConfig
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.sweep.space import search_space
from dtf.sweep.study import TrialPruning, open_storage
from dtf.sweep.sweeper import Sweep
from tests.helpers.gloo import run_on_ranks


def test_the_override_grammar_becomes_optuna_distributions() -> None:
    space = search_space(
        {"optimizer.lr": "tag(log, interval(1e-4, 1e-1))", "model.hidden": "choice(16,32,64)"},
        [
            "trainer.max_epochs=3",
            "trainer.seed=range(0,9,3)",
            "optimizer=choice(adam,sgd)",
            "a.b=interval(1,4)",
            "a.c=int(interval(1,4))",
        ],
    )
    assert space.fixed == ["trainer.max_epochs=3"]
    d = space.distributions
    assert d["optimizer.lr"] == FloatDistribution(1e-4, 1e-1, log=True)
    assert d["model.hidden"] == CategoricalDistribution([16, 32, 64])
    # range's stop is included, as in Hydra's Optuna sweeper (not its basic one): 0, 3, 6, 9
    assert d["trainer.seed"] == IntDistribution(0, 9, step=3)
    assert d["optimizer"] == CategoricalDistribution(["adam", "sgd"])
    assert d["a.b"] == FloatDistribution(1.0, 4.0)  # Hydra's interval is a float interval
    # int(interval(...)): an int (it was sampled as a float: trainer.max_epochs=2.0976 failed the trial)
    assert d["a.c"] == IntDistribution(1, 4)
    params = {"optimizer.lr": 0.001, "model.hidden": 32, "trainer.seed": 6, "optimizer": "sgd", "a.b": 2}
    assert space.overrides(params) == [
        "trainer.max_epochs=3",
        "optimizer.lr=0.001",
        "model.hidden=32",
        "trainer.seed=6",
        "optimizer=sgd",
        "a.b=2",
    ]


def test_the_command_line_wins_over_params_for_the_same_key() -> None:
    space = search_space({"optimizer.lr": "interval(0.1, 0.2)"}, ["optimizer.lr=choice(0.5,0.6)"])
    assert space.distributions == {"optimizer.lr": CategoricalDistribution([0.5, 0.6])}


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"optimizer.lr": "tag(log, interval(0, 1))"}, "positive low end"),
        ({"optimizer.lr": "interval(0.5, 0.1)"}, "low < high"),
        ({"trainer.seed": "range(5,1)"}, "empty range"),
        ({"optimizer.lr": "interval(0.1"}, "hydra.sweeper.params"),
    ],
)
def test_a_bad_search_space_is_one_line(params: dict[str, str], says: str) -> None:
    with pytest.raises(UserError, match=says) as e:
        search_space(params, [])
    assert "\n" not in str(e.value)


def sweep_config(sweep_dir: Path, **settings: object) -> tuple[dict[str, object], object]:
    config = OmegaConf.create(
        {
            "trainer": {"objective": "test/loss", "objective_mode": "min"},
            "hydra": {"sweep": {"dir": str(sweep_dir)}, "job": {"config_name": "config"}, "overrides": {"hydra": []}},
        }
    )
    return {"params": {"optimizer.lr": "tag(log, interval(1e-5, 1e-1))"}, **settings}, config


def suggested(sweep_dir: Path, n: int, **settings: object) -> list[float]:
    """The first n points a sweep asks for (nothing is trained: each is told a value at once)."""
    s, config = sweep_config(sweep_dir, **settings)
    sweep = Sweep(s, config, [])  # type: ignore[arg-type]
    study = sweep.open_study()
    points = []
    for _ in range(n):
        trial = sweep.ask(study)
        points.append(trial.params["optimizer.lr"])
        study.tell(trial, 1.0)
    return points


@pytest.mark.parametrize("sampler", ["TPESampler", "RandomSampler"])
def test_the_same_seed_gives_the_same_points(tmp_path: Path, sampler: str) -> None:
    def seeded(seed: int) -> dict[str, object]:
        return {"_target_": f"optuna.samplers.{sampler}", "seed": seed}

    first = suggested(tmp_path / "a", 4, sampler=seeded(7))
    assert first == suggested(tmp_path / "b", 4, sampler=seeded(7))
    assert first != suggested(tmp_path / "c", 4, sampler=seeded(8))
    # A sweep that continues in the same dir goes on to new points, not the first ones again.
    assert not set(suggested(tmp_path / "a", 2, sampler=seeded(7))) & set(first)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"pruner": "early"}, "hydra.sweeper.pruner=early: choose one of none, median, asha, hyperband"),
        ({"parallel": 0}, "hydra.sweeper.parallel=0: must be >= 1"),
        ({"params": {}}, "nothing to search"),
        ({"parallel": 2, "n_jobs": 3}, "hydra.sweeper.n_jobs=3 and hydra.sweeper.parallel=2 are one setting"),
        ({"max_failure_rate": 1.5}, r"hydra.sweeper.max_failure_rate=1.5: give a fraction in \[0, 1\]"),
        ({"direction": "maximize"}, "hydra.sweeper.direction=maximize but trainer.objective_mode=min for test/loss"),
        ({"direction": ["minimize", "minimize"]}, "has 2 objective.s. but trainer.objective=.'test/loss'. names 1"),
        ({"direction": "down"}, "hydra.sweeper.direction=down: use minimize or maximize"),
        ({"sampler": "random"}, "choose a sampler with hydra/sweeper/sampler=tpe"),
        ({"custom_search_space": "no_such_module.fn"}, "hydra.sweeper.custom_search_space=no_such_module.fn: "),
    ],
)
def test_bad_sweeper_settings_are_one_line(tmp_path: Path, settings: dict[str, object], says: str) -> None:
    s, config = sweep_config(tmp_path, **settings)
    with pytest.raises(UserError, match=says) as e:
        Sweep(s, config, [])  # type: ignore[arg-type]
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("objective", "settings", "says"),
    [
        (["test/loss", "test/rmse"], {}, "names 2 objectives: give hydra.sweeper.direction as a list of 2"),
        (["test/loss"], {"direction": ["minimize", "maximize"]}, "has 2 objective.s. but trainer.objective"),
        (["test/loss", "rmse"], {"direction": ["minimize"] * 2}, "rmse is not <split>/<name>"),
        (
            ["test/loss", "test/rmse"],
            {"direction": ["minimize"] * 2, "pruner": "median"},
            "Optuna prunes studies of one objective only",
        ),
    ],
)
def test_several_objectives_need_as_many_directions_and_no_pruner(
    tmp_path: Path, objective: list[str], settings: dict[str, object], says: str
) -> None:
    s, config = sweep_config(tmp_path, **settings)
    config.trainer.objective = objective  # type: ignore[attr-defined]
    with pytest.raises(UserError, match=says):
        Sweep(s, config, [])  # type: ignore[arg-type]


def test_a_single_run_refuses_a_list_of_objectives() -> None:
    from dtf.config.schema import TrainerConfig

    with pytest.raises(UserError, match="a run is judged by one objective"):
        TrainerConfig(objective=["val/loss", "val/rmse"])


def test_a_study_made_to_minimize_is_not_continued_to_maximize(tmp_path: Path) -> None:
    suggested(tmp_path, 1)
    s, config = sweep_config(tmp_path)
    config.trainer.objective_mode = "max"  # type: ignore[attr-defined]
    with pytest.raises(UserError, match="was made to minimize"):
        Sweep(s, config, []).open_study()  # type: ignore[arg-type]


def _pruning_on_rank(rank: int, world_size: int, journal: str, trial_id: int, results: str) -> None:
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    cfg = TrialConfig(study="s", storage=journal, id=trial_id, number=1, pruner="median")
    cfg.pruner_options = {"n_startup_trials": 1, "n_warmup_steps": 0}
    pruning = TrialPruning(cfg, "test/loss", env)
    assert (pruning.trial is not None) == (rank == 0)  # only rank 0 talks to the study
    # An epoch without an evaluation reports nothing and prunes nothing (no collective either).
    assert not pruning.should_prune(1, {"train/loss": 9.0})
    answer = pruning.should_prune(1, {"train/loss": 9.0, "test/loss": 5.0})  # worse than the finished trial
    Path(results, f"rank{rank}").write_text(str(answer))


def test_the_pruning_answer_reaches_every_rank(tmp_path: Path) -> None:
    journal = str(tmp_path / "optuna.journal")
    study = optuna.create_study(study_name="s", storage=open_storage(journal))
    done = study.ask()
    done.report(1.0, 1)
    study.tell(done, 1.0)
    trial = study.ask()
    run_on_ranks(_pruning_on_rank, 2, journal, trial._trial_id, str(tmp_path))
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["True", "True"]
    assert study.trials[1].intermediate_values == {1: 5.0}  # reported once, by rank 0
    assert math.isclose(study.trials[0].value or 0.0, 1.0)


def test_local_trials_side_by_side_split_the_cores_unless_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s, config = sweep_config(tmp_path, parallel=2)
    config.launcher = {"name": "local", "nproc": 1}  # type: ignore[attr-defined]
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert Sweep(s, config, []).trial_env()["OMP_NUM_THREADS"] == "4"  # type: ignore[arg-type]
    config.launcher.nproc = 4  # type: ignore[attr-defined]
    assert Sweep(s, config, []).trial_env()["OMP_NUM_THREADS"] == "1"  # type: ignore[arg-type]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own is kept
    assert Sweep(s, config, []).trial_env()["OMP_NUM_THREADS"] == "3"  # type: ignore[arg-type]
    config.launcher = {"name": "slurm"}  # type: ignore[attr-defined]
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert "OMP_NUM_THREADS" not in Sweep(s, config, []).trial_env()  # type: ignore[arg-type]


def test_the_other_objectives_are_read_from_a_trials_final_metrics() -> None:
    from dtf.sweep.sweeper import objective_values

    loop = {"objective": 0.5, "objective_name": "val/loss", "final_metrics": {"val/loss": 0.5, "train/loss": 0.7}}
    assert objective_values(loop, ["val/loss", "train/loss"]) == [0.5, 0.7]
    function = {"objective": 1.0, "objective_name": "test/v0", "result": {"v0": 1.0, "v1": 2.0}}
    assert objective_values(function, ["test/v0", "test/v1"]) == [1.0, 2.0]
    with pytest.raises(UserError, match=r"test/rmse is not among the trial's final values \(train/loss, val/loss\)"):
        objective_values(loop, ["val/loss", "test/rmse"])
