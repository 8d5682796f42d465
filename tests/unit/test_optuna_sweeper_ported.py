"""Hydra's Optuna sweeper's own tests, ported to hydra/sweeper=dtf: the in-process half.

From facebookresearch/hydra, plugins/hydra_optuna_sweeper/tests/test_optuna_sweeper_plugin.py (with
its tests/conf/ and example/ apps), as of v1.3.2 (the 1.3 plugin's) and of main (1.4.0.dev9, for
Optuna 4+). Ported here, in this process:

- test_discovery: the sweeper is a Hydra Sweeper plugin Hydra finds.
- test_create_optuna_distribution_from_override, test_create_params_from_overrides (main's cases,
  `~z` included), test_create_optuna_distribution_from_config (1.3's search_space): every case,
  against dtf.sweep.space (the plugin's _impl functions' jobs).
- test_warnings (1.3): search_space is deprecated, and params wins over it; test_motpe_sampler_removed.
- test_optuna_example (with and without the command line), test_example_with_grid_sampler (10 and
  1 trials), test_optuna_multi_objective_example (both), test_optuna_custom_search_space_example,
  test_example_with_deprecated_search_space (1.3), test_failure_rate (0.5 and 1.0): the whole
  sweep (Sweep.run: ask, start, reap, tell, conclude, optimization_results.yaml) in this process,
  with each trial's `python -m dtf` process stood in by the example's function
  (dtf.models.optuna_examples, tests/helpers/optuna_sweeps.py) on the trial's own command line. The
  example's keys x, y, ... are trainer.hparams.x, ... of a trainer=function run.
  tests/e2e/test_optuna_sweeper_ported.py runs test_optuna_example, test_failure_rate and
  test_example_with_removed_motpe with real dtf trials, and the sphere example against Hydra's
  own plugin.

Not applicable:
- test_launch_jobs: it sweeps hydra.test_utils.a_module (a Hydra app that is not dtf, with
  hydra/launcher=basic) and expects the sweep to return None. hydra/sweeper=dtf runs every trial
  as `python -m dtf` (no Hydra launcher); a Hydra app that is not dtf gets one line saying what the
  sweeper needs instead (tests/e2e/test_optuna_sweeper_ported.py runs one).

Kept with a difference (each assertion of the plugin's holds): the `range` cases keep the
plugin's meaning (stop included), and the grid sampler's grid includes the stop too, where the
plugin's _to_grid_sampler_choices leaves it out (its grid disagrees with its own range).
test_warnings checks dtf's warning line on stderr, not a Python UserWarning.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from dtf.errors import UserError
from dtf.models import optuna_examples
from dtf.sweep.space import distribution_of, distribution_of_config, search_space
from dtf.sweep.study import open_storage
from tests.helpers.optuna_sweeps import run_sweep, sampler, sweep_of


def test_discovery() -> None:
    from hydra_plugins.dtf_sweeper.dtf_sweeper import DtfSweeper

    assert DtfSweeper.__name__ in [x.__name__ for x in Plugins.instance().discover(Sweeper)]


def check_distribution(expected: BaseDistribution, actual: BaseDistribution) -> None:
    if not isinstance(expected, CategoricalDistribution):
        assert expected == actual
        return
    assert isinstance(actual, CategoricalDistribution)
    assert set(expected.choices) == set(actual.choices)  # shuffle() randomizes the order


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("key=choice(1,2)", CategoricalDistribution([1, 2])),
        ("key=choice(true, false)", CategoricalDistribution([True, False])),
        ("key=choice('hello', 'world')", CategoricalDistribution(["hello", "world"])),
        ("key=shuffle(range(1,3))", CategoricalDistribution((1, 2))),
        ("key=range(1,3)", IntDistribution(1, 3)),
        ("key=interval(1, 5)", FloatDistribution(1, 5)),
        ("key=int(interval(1, 5))", IntDistribution(1, 5)),
        ("key=tag(log, interval(1, 5))", FloatDistribution(1, 5, log=True)),
        ("key=tag(log, int(interval(1, 5)))", IntDistribution(1, 5, log=True)),
        ("key=range(0.5, 5.5, step=1)", FloatDistribution(0.5, 5.5, step=1)),
    ],
)
def test_create_optuna_distribution_from_override(line: str, expected: BaseDistribution) -> None:
    parsed = OverridesParser.create().parse_overrides([line])[0]
    check_distribution(expected, distribution_of(parsed))


@pytest.mark.parametrize(
    ("lines", "distributions", "fixed"),
    [
        (["key=choice(1,2)"], {"key": CategoricalDistribution([1, 2])}, []),
        (["key=5"], {}, ["key=5"]),
        (["key1=choice(1,2)", "key2=5"], {"key1": CategoricalDistribution([1, 2])}, ["key2=5"]),
        (
            ["key1=choice(1,2)", "key2=5", "key3=range(1,3)"],
            {"key1": CategoricalDistribution([1, 2]), "key3": IntDistribution(1, 3)},
            ["key2=5"],
        ),
        (["~z"], {}, ["~z"]),
        (["~z=10"], {}, ["~z=10"]),
    ],
)
def test_create_params_from_overrides(
    lines: list[str], distributions: dict[str, BaseDistribution], fixed: list[str]
) -> None:
    space = search_space({}, lines)
    assert space.distributions == distributions and space.fixed == fixed


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"type": "categorical", "choices": [1, 2, 3]}, CategoricalDistribution([1, 2, 3])),
        ({"type": "int", "low": 0, "high": 10}, IntDistribution(0, 10)),
        ({"type": "int", "low": 0, "high": 10, "step": 2}, IntDistribution(0, 10, step=2)),
        ({"type": "int", "low": 0, "high": 5}, IntDistribution(0, 5)),
        ({"type": "int", "low": 1, "high": 100, "log": True}, IntDistribution(1, 100, log=True)),
        ({"type": "float", "low": 0, "high": 1}, FloatDistribution(0, 1)),
        ({"type": "float", "low": 0, "high": 10, "step": 2}, FloatDistribution(0, 10, step=2)),
        ({"type": "float", "low": 1, "high": 100, "log": True}, FloatDistribution(1, 100, log=True)),
    ],
)
def test_create_optuna_distribution_from_config(spec: dict[str, Any], expected: BaseDistribution) -> None:
    """(1.3's hydra.sweeper.search_space; its distributions by their Optuna 3+ names.)"""
    check_distribution(expected, distribution_of_config("key", spec))


@pytest.mark.parametrize(
    ("search_space", "params", "msg"),
    [
        (None, None, None),
        ({}, {}, "hydra.sweeper.search_space is deprecated (hydra.sweeper.params is used, search_space ignored)"),
        ({}, None, "hydra.sweeper.search_space is deprecated (use params)"),
        (None, {}, None),
    ],
)
def test_warnings(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    search_space: dict[str, Any] | None,
    params: dict[str, Any] | None,
    msg: str | None,
) -> None:
    settings: dict[str, Any] = {"search_space": search_space, "arguments": ["trainer.hparams.x=choice(1,2)"]}
    sweep_of(tmp_path, sampler("random"), params, **settings)
    err = capsys.readouterr().err
    assert (msg in err) if msg else ("deprecated" not in err)


def test_example_with_deprecated_search_space(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # tests/conf/test_deprecated_search_space.yaml (1.3)
    search = {"trainer.hparams.x": {"type": "float", "low": -5.5, "high": 5.5, "step": 0.5}}
    sweep = sweep_of(tmp_path, sampler("tpe"), None, {"x": 1, "y": 1}, search_space=search, n_trials=20, n_jobs=1)
    returns = run_sweep(monkeypatch, sweep, optuna_examples.sphere)
    assert returns.name == "optuna"
    assert abs(returns["best_params"]["trainer.hparams.x"]) <= 5.5


def test_motpe_sampler_removed(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=re.escape("the 'motpe' sampler was removed in Optuna 4.0")) as e:
        sweep_of(tmp_path, sampler("motpe"), {"x": "range(0, 5, step=0.5)"}).open_study()
    assert "\n" not in str(e.value)


# -- whole sweeps, each trial's process stood in by the example's function ---------------------
# example/conf/config.yaml
SPHERE = {"x": "range(-5.5, 5.5, step=0.5)", "y": "choice(-5 ,0 ,5)"}


@pytest.mark.parametrize("with_commandline", [True, False])
def test_optuna_example(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, with_commandline: bool) -> None:
    import optuna

    # a journal file (the plugin's test: sqlite, which the real sweep of the e2e half keeps; here it
    # would cost seconds of schema set-up per study)
    storage = str(tmp_path / "test.journal")
    arguments = ["~trainer.hparams.z"]
    if with_commandline:
        arguments += ["trainer.hparams.x=choice(0, 1, 2)", "trainer.hparams.y=0"]  # y: a fixed parameter
    sweep = sweep_of(
        tmp_path / "sweep",
        sampler("tpe", seed=123),
        SPHERE,
        {"x": 1, "y": 1, "z": 1},
        n_trials=20,
        n_jobs=1,
        storage=storage,
        study_name="test-optuna-example",
        arguments=arguments,
    )
    returns = run_sweep(monkeypatch, sweep, optuna_examples.sphere)
    best_trial = optuna.load_study(storage=open_storage(storage), study_name="test-optuna-example").best_trial
    assert returns.name == "optuna"
    assert returns["best_params"]["trainer.hparams.x"] == best_trial.params["trainer.hparams.x"]
    if with_commandline:
        assert "trainer.hparams.y" not in returns["best_params"] and "trainer.hparams.y" not in best_trial.params
    else:
        assert returns["best_params"]["trainer.hparams.y"] == best_trial.params["trainer.hparams.y"]
    assert returns["best_value"] == best_trial.value
    # The plugin's bound: the 95th percentile of TPE's best over 1000 seeds.
    assert returns["best_value"] <= 2.27


@pytest.mark.parametrize("num_trials", [10, 1])
def test_example_with_grid_sampler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, num_trials: int) -> None:
    # tests/conf/test_grid.yaml
    params = {"x": "choice(-1, 1)", "y": "range(-1.0, 1.0, step=1)", "z": 'choice("foo", "bar")'}
    sweep = sweep_of(
        tmp_path / "sweep", sampler("grid"), params, {"x": 1, "y": 1, "z": "foo"}, n_trials=num_trials, n_jobs=1
    )
    returns = run_sweep(monkeypatch, sweep, optuna_examples.sphere)
    bv = returns["best_value"]
    bx, by, bz = (returns["best_params"][f"trainer.hparams.{k}"] for k in "xyz")
    if num_trials >= 12:
        assert bv == 1 and abs(bx) == 1 and by == 0
    else:
        assert bx in [-1, 1] and by in [-1, 0]
    assert bz in ["foo", "bar"]
    # every point of the grid once (2 x 3 x 2 = 12 with y's stop included), never more than asked
    assert len(list((tmp_path / "sweep").glob("*/trial.json"))) == min(num_trials, 12)


def _dominates(values_x: list[float], values_y: list[float]) -> bool:
    return all(x <= y for x, y in zip(values_x, values_y, strict=True)) and any(
        x < y for x, y in zip(values_x, values_y, strict=True)
    )


@pytest.mark.parametrize("with_commandline", [True, False])
def test_optuna_multi_objective_example(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, with_commandline: bool
) -> None:
    # example/multi-objective-conf/config.yaml, with the sampler the plugin's test gives
    params = {"x": "range(0, 5, step=0.5)", "y": "range(0, 3, step=0.5)"}
    arguments = ["trainer.hparams.x=range(0, 5)", "trainer.hparams.y=range(0, 3)"] if with_commandline else []
    sweep = sweep_of(
        tmp_path / "sweep",
        sampler("random", seed=123),
        params,
        objective=["test/v0", "test/v1"],
        direction=["minimize", "minimize"],
        n_trials=20,
        n_jobs=1,
        arguments=arguments,
    )
    returns = run_sweep(monkeypatch, sweep, optuna_examples.binh_and_korn)
    assert returns.name == "optuna" and len(returns["solutions"]) >= 1
    grid = {0} if with_commandline else {0, 0.5}
    for trial_x in returns["solutions"]:
        assert trial_x["params"]["trainer.hparams.x"] % 1 in grid
        assert trial_x["params"]["trainer.hparams.y"] % 1 in grid
        for trial_y in returns["solutions"]:  # the trials must not dominate each other
            assert not _dominates(trial_x["values"], trial_y["values"])
        # the values are the function's, at the trial's params
        x, y = (trial_x["params"][f"trainer.hparams.{k}"] for k in "xy")
        assert list(trial_x["values"]) == [4 * x**2 + 4 * y**2, (x - 5) ** 2 + (y - 5) ** 2]


def test_optuna_custom_search_space_example(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # example/custom-search-space/config.yaml
    max_z_difference_from_x = 0.3
    sweep = sweep_of(
        tmp_path / "sweep",
        sampler("random", seed=123),
        {"x": "range(-5.5, 5.5, 0.5)", "y": "choice(-5, 0, 5)"},
        {"x": 1, "y": 1, "z": 100, "max_z_difference_from_x": max_z_difference_from_x},
        n_trials=20,
        n_jobs=1,
        custom_search_space="dtf.models.optuna_examples.configure",
    )
    returns = run_sweep(monkeypatch, sweep, optuna_examples.multi_dimensional_sphere)
    best = returns["best_params"]
    assert returns.name == "optuna"
    assert abs(best["trainer.hparams.x"] - best["trainer.hparams.z"]) <= max_z_difference_from_x
    assert 0 <= best["+trainer.hparams.w"] <= 1
    # the function saw the suggested z and w: its value is theirs
    assert returns["best_value"] == pytest.approx(sum(best[k] ** 2 for k in best) + 0.0)


@pytest.mark.parametrize("max_failure_rate", [0.5, 1.0])
def test_failure_rate(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], max_failure_rate: float
) -> None:
    sweep = sweep_of(
        tmp_path / "sweep",
        sampler("random", seed=123),
        SPHERE,
        {"x": 1, "y": 1, "error": True},
        n_trials=20,
        n_jobs=2,
        max_failure_rate=max_failure_rate,
    )
    with pytest.raises(SystemExit) as e:
        run_sweep(monkeypatch, sweep, optuna_examples.sphere)
    assert e.value.code == 1
    err = capsys.readouterr().err
    error_string = "RuntimeError: cfg.error is True"
    started = len(list((tmp_path / "sweep").glob("*/trial.json")))
    if max_failure_rate < 1.0:
        assert error_string in err and "more than hydra.sweeper.max_failure_rate=0.5" in err
        assert started == 2  # the two running at once; no new one after
    else:
        assert error_string not in err
        assert started == 20  # every trial ran; none completed, so the sweep still ends non-zero
