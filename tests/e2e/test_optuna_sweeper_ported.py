"""Hydra's Optuna sweeper's own tests, ported to hydra/sweeper=dtf with dtf as the task: the half
whose trials really run (`python -m dtf` each). The in-process half, and the list of what was
ported and what cannot apply, is tests/unit/test_optuna_sweeper_ported.py.

- The plugin's sphere example (example/sphere.py and conf/config.yaml, copied in
  optuna_sweeper/hydra_example/: x in range(-5.5,5.5,step=0.5), y in choice(-5,0,5), TPE with
  seed 123, 20 trials) as a dtf run (optuna_sweeper/experiment/sphere.yaml: trainer=function with
  dtf.models.optuna_examples.sphere), against Hydra's own sweeper running its own example in its
  venv (dtf.sideenv hydra-optuna). Both end at the same best value (0.25, at x=0.5, y=0). The points
  are the same for the first 13 trials (TPE's 10 random start-up ones and its first 3 own), then
  differ: that venv has Optuna 2.10 (all the plugin runs on), dtf has Optuna 5, and their TPE
  proposes differently from the 14th trial on, from the same told values (Optuna 2.10's TPE samples
  the stepped x as a continuous value rounded to the step, Optuna 5's with a discrete kernel over
  the steps). Those 20 trials run with each trial stood in by the function
  (tests/helpers/optuna_sweeps); N_REAL trials of them run for real, as dtf runs, and give the
  plugin's first N_REAL points.
  test_optuna_example's assertions run on that real sweep.
- test_failure_rate (0.5): a failing trial stops the sweep with the trial's error.
- test_example_with_removed_motpe: refused in one line.
- A Hydra application that is not dtf (optuna_sweeper/not_dtf_app.py) under hydra/sweeper=dtf: one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from omegaconf import OmegaConf

from dtf.models import optuna_examples
from tests.helpers import side_venv
from tests.helpers.optuna_sweeps import run_sweep, sampler, sweep_of
from tests.helpers.run_command import DtfRun, run_command, run_dtf

HERE = Path(__file__).resolve().parent / "optuna_sweeper"
SPHERE = ["+experiment=sphere"]
# (--config-dir before the overrides: Hydra's argument parser takes no option after them)
CONFIG_DIR = [f"--config-dir={HERE}"]
N_REAL = 2  # real dtf trials: ~5 s each
SAME_POINTS = 13  # Optuna 2.10's TPE and Optuna 5's agree this far on this example (see above)
STUDY = "test-optuna-example"


@pytest.fixture(scope="module")
def hydra_sphere(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hydra's own Optuna sweeper running its own sphere example, as its docs do (20 trials)."""
    python = side_venv.side_python("hydra-optuna")
    sweep_dir = tmp_path_factory.mktemp("hydra_sphere") / "sweep"
    cmd = [str(python), str(HERE / "hydra_example" / "sphere.py"), "-m", f"hydra.sweep.dir={sweep_dir}"]
    run_command(cmd, timeout=300)
    return sweep_dir


@pytest.fixture(scope="module")
def dtf_sphere(tmp_path_factory: pytest.TempPathFactory) -> tuple[DtfRun, str]:
    """The sphere example searched by hydra/sweeper=dtf: N_REAL real dtf runs, one at a time."""
    root = tmp_path_factory.mktemp("dtf_sphere")
    storage = f"sqlite:///{root / 'test.db'}"
    args = [*SPHERE, f"hydra.sweeper.n_trials={N_REAL}", f"hydra.sweeper.storage={storage}"]
    run = run_dtf(
        [*args, f"hydra.sweeper.study_name={STUDY}"], root / "sweep", multirun=True, timeout=600, options=CONFIG_DIR
    )
    return run, storage


def points_of_dtf(sweep_dir: Path) -> list[tuple[float, int]]:
    records = {int(p.parent.name): json.loads(p.read_text()) for p in sweep_dir.glob("*/trial.json")}
    return [
        (records[n]["params"]["trainer.hparams.x"], records[n]["params"]["trainer.hparams.y"]) for n in sorted(records)
    ]


def points_of_hydra(sweep_dir: Path) -> list[tuple[float, int]]:
    jobs = sorted((int(p.name), p) for p in sweep_dir.iterdir() if p.name.isdigit())
    points = []
    for _, job in jobs:
        values: dict[str, Any] = {}
        for line in OmegaConf.load(job / ".hydra" / "overrides.yaml"):
            key, _, value = str(line).partition("=")
            values[key] = float(value) if key == "x" else int(value)
        points.append((values["x"], values["y"]))
    return points


def test_the_sphere_ends_at_hydras_own_sweepers_best_value_by_the_same_points(
    hydra_sphere: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = OmegaConf.load(HERE / "experiment" / "sphere.yaml")
    settings = config.hydra.sweeper
    params = {key.removeprefix("trainer.hparams."): value for key, value in settings.params.items()}
    sweep = sweep_of(
        tmp_path / "sweep",
        sampler("tpe", seed=settings.sampler.seed),
        params,
        dict(config.trainer.hparams),
        n_trials=settings.n_trials,
        n_jobs=settings.n_jobs,
    )
    mine = run_sweep(monkeypatch, sweep, optuna_examples.sphere)
    hydras = OmegaConf.load(hydra_sphere / "optimization_results.yaml")
    assert mine.best_value == hydras.best_value == 0.25
    assert [mine.best_params[f"trainer.hparams.{k}"] for k in "xy"] == [hydras.best_params[k] for k in "xy"]
    ours, theirs = points_of_dtf(tmp_path / "sweep"), points_of_hydra(hydra_sphere)
    assert len(ours) == len(theirs) == 20
    assert ours[:SAME_POINTS] == theirs[:SAME_POINTS]


def test_real_dtf_trials_search_the_same_points(dtf_sphere: tuple[DtfRun, str], hydra_sphere: Path) -> None:
    run, _ = dtf_sphere
    ours = points_of_dtf(run.run_dir)
    assert ours == points_of_hydra(hydra_sphere)[:N_REAL]
    # each value Optuna was told is the dtf run's own result: x^2 + y^2 at its point
    for n, (x, y) in enumerate(ours):
        summary = json.loads((run.run_dir / str(n) / "summary.json").read_text())
        assert summary["objective"] == x**2 + y**2 and summary["objective_name"] == "test/loss"


def test_optuna_example(dtf_sphere: tuple[DtfRun, str]) -> None:
    run, storage = dtf_sphere
    returns = OmegaConf.load(run.run_dir / "optimization_results.yaml")
    best_trial = optuna.load_study(storage=storage, study_name=STUDY).best_trial
    assert returns.name == "optuna"
    assert dict(returns["best_params"]) == best_trial.params
    assert returns["best_value"] == best_trial.value
    assert set(OmegaConf.to_container(returns)) == {"name", "best_params", "best_value"}  # type: ignore[arg-type]
    # beside dtf's own record of the best trial
    best = json.loads((run.run_dir / "best.json").read_text())
    assert best["number"] == best_trial.number and best["value"] == best_trial.value


def test_failure_rate(tmp_path: Path) -> None:
    run = run_dtf(
        [
            *SPHERE,
            "hydra.sweeper.n_trials=20",
            "hydra.sweeper.n_jobs=1",
            "hydra/sweeper/sampler=random",
            "hydra.sweeper.sampler.seed=123",
            "hydra.sweeper.max_failure_rate=0.5",
            "trainer.hparams.error=true",
        ],
        tmp_path / "sweep",
        multirun=True,
        options=CONFIG_DIR,
        expect=1,
    )
    assert "RuntimeError: cfg.error is True" in run.stderr
    assert "more than hydra.sweeper.max_failure_rate=0.5: the sweep stops" in run.stderr
    assert len(list((tmp_path / "sweep").glob("*/trial.json"))) == 1  # 1 of 1 failed: no other starts


def test_example_with_removed_motpe(tmp_path: Path) -> None:
    run = run_dtf(
        [*SPHERE, "hydra/sweeper/sampler=motpe"], tmp_path / "sweep", multirun=True, options=CONFIG_DIR, expect=2
    )
    assert "motpe" in run.stderr and "sampler was removed in Optuna 4.0" in run.stderr
    assert "Traceback" not in run.stderr and not list((tmp_path / "sweep").glob("*/trial.json"))


def test_a_hydra_app_that_is_not_dtf_gets_one_line(tmp_path: Path) -> None:
    """(It got omegaconf's ConfigAttributeError traceback: "Key 'trainer' is not in struct".)"""
    app = HERE / "not_dtf_app.py"
    sweep = ["-m", "hydra/sweeper=dtf", "+x=interval(0,1)", f"hydra.sweep.dir={tmp_path / 's'}"]
    proc = run_command([sys.executable, str(app), *sweep], expect=2, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dtf: error:")]
    assert errors == [
        "dtf: error: hydra/sweeper=dtf runs every trial as a dtf run (python -m dtf with this config), and this "
        "application's config is not dtf's (it has no trainer.objective): sweep it with Hydra's Optuna sweeper "
        "(hydra/sweeper=optuna), or make it a dtf run (docs/sweeps-and-hpo.md)"
    ]
    assert "Traceback" not in proc.stderr
