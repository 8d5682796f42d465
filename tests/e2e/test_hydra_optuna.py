"""Hydra's own Optuna sweeper drives dtf unchanged: `python -m dtf -m hydra/sweeper=optuna ...`.

hydra-optuna-sweeper 1.3.0 needs optuna 2.10 and SQLAlchemy<2, which cannot share dtf's venv
(optuna 5, SQLAlchemy 2): these tests run dtf with the python of a side venv made once
(dtf.sideenv: hydra-optuna) that sees the main venv for everything else."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import side_venv
from tests.helpers.clusters import script_cluster
from tests.helpers.run_command import DtfRun, run_command, run_dtf

SMALL = [
    "trainer.max_epochs=1",
    "data.dataset.num_points=2000",
    "data.dataset.num_test=400",
    "trainer.progress=off",
]


@pytest.fixture(scope="module")
def side_python() -> Path:
    """The side venv's python; made on first use (about 10 s with the package index at hand)."""
    return side_venv.side_python("hydra-optuna")


def optuna_sweep(python: Path, sweep_dir: Path, *args: str, timeout: float = 400) -> DtfRun:
    """`python -m dtf -m hydra/sweeper=optuna ...` with a sqlite study in the sweep dir, to read back."""
    storage = f"sqlite:///{sweep_dir.parent / 'study.db'}"
    study = ["hydra.sweeper.study_name=dtf", f"hydra.sweeper.storage={storage}"]
    return run_dtf(["hydra/sweeper=optuna", *study, *args], sweep_dir, multirun=True, timeout=timeout, python=python)


def trials(python: Path, sweep_dir: Path) -> list[dict]:
    """The study's trials as Optuna stored them: state, value, params (read with optuna 2.10)."""
    code = (
        "import json, sys, optuna; "
        "s = optuna.load_study(study_name='dtf', storage=sys.argv[1]); "
        "print(json.dumps([dict(number=t.number, state=t.state.name, value=t.value, params=t.params) "
        "for t in s.trials]))"
    )
    out = run_command([str(python), "-c", code, f"sqlite:///{sweep_dir.parent / 'study.db'}"]).stdout
    return json.loads(out.strip().splitlines()[-1])


def points(sweep_dir: Path) -> dict[int, Path]:
    """Each point's run dir by its job number."""
    return {int(p.name): p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()}


def overrides(run_dir: Path) -> dict[str, str]:
    """The point's overrides (its .hydra/overrides.yaml) as key -> value."""
    return dict(o.split("=", 1) for o in OmegaConf.load(run_dir / ".hydra" / "overrides.yaml"))


def test_optuna_finds_a_better_lr_than_its_worst_trial(side_python: Path, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    optuna_sweep(
        side_python,
        sweep_dir,
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.seed=0",
        "optimizer.lr=tag(log,interval(1e-5,1e-1))",
        "launcher.nproc=1",
        *SMALL,
    )
    runs = points(sweep_dir)
    assert sorted(runs) == [0, 1]
    objectives = {n: json.loads((d / "summary.json").read_text())["objective"] for n, d in runs.items()}
    swept = {n: float(overrides(d)["optimizer.lr"]) for n, d in runs.items()}
    assert len(set(swept.values())) == 2, swept  # two different LRs
    result = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert result.best_value == min(objectives.values()) < max(objectives.values()), objectives
    best = min(objectives, key=lambda n: objectives[n])
    assert result.best_params["optimizer.lr"] == swept[best]
    # Optuna was told each point's objective (the task's return value), not something else.
    told = trials(side_python, sweep_dir)
    assert [t["state"] for t in told] == ["COMPLETE"] * 2
    assert sorted(t["value"] for t in told) == sorted(objectives.values())


def test_every_rank_of_every_trial_trains_that_trials_config(side_python: Path, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    optuna_sweep(
        side_python,
        sweep_dir,
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.seed=0",
        "optimizer.lr=tag(log,interval(1e-4,1e-2))",
        "launcher.nproc=2",
        *SMALL,
    )
    runs = points(sweep_dir)
    assert sorted(runs) == [0, 1]
    digests = {}
    for n, run_dir in runs.items():
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["world_size"] == 2 and s["config_consistent"]
        first, second = s["config_sha256_by_rank"]
        assert first == second and len(first) == 64
        # The point's own config, as Hydra saved it for this job, resolved here: the ranks trained it.
        saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
        assert first == hashlib.sha256(OmegaConf.to_yaml(saved, resolve=True).encode()).hexdigest()
        assert saved.optimizer.lr == float(overrides(run_dir)["optimizer.lr"])
        digests[n] = first
    assert digests[0] != digests[1]


@pytest.mark.parametrize(
    ("how", "said"),
    [("raise", "dtf: error: rank 0 failed: RuntimeError: injected failure"), ("SIGUSR1", "dtf: stopped by SIGUSR1")],
    ids=["failed", "stopped"],
)
def test_a_failed_or_stopped_trial_is_failed_in_optuna_and_the_sweep_goes_on(
    side_python: Path, tmp_path: Path, how: str, said: str
) -> None:
    sweep_dir = tmp_path / "sweep"
    run = optuna_sweep(
        side_python,
        sweep_dir,
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.sampler.seed=0",
        "optimizer.lr=tag(log,interval(1e-4,1e-2))",
        # rank fail_rank raises, or sends itself a stop signal, at its 3rd forward (-1: no rank does)
        "model._target_=user_models.FailingModel",
        "+model.fail_rank=choice(-1,0)",
        f"+model.how={how}",
        "checkpoint.stop_check_every_n_steps=1",  # the stop lands within this short trial
        "launcher.nproc=1",
        *SMALL,
    )
    told = trials(side_python, sweep_dir)
    assert len(told) == 4
    failing = [t for t in told if t["params"]["+model.fail_rank"] == 0]
    passing = [t for t in told if t["params"]["+model.fail_rank"] == -1]
    assert failing and passing, told  # the seed gives both kinds
    assert all(t["state"] == "FAIL" and t["value"] is None for t in failing), told
    assert all(t["state"] == "COMPLETE" for t in passing), told
    # each failed point said so in its usual line, and left no summary
    assert run.stderr.count(said) == len(failing), run.stderr[-3000:]
    runs = points(sweep_dir)
    assert all(not (d / "summary.json").exists() for d in runs.values() if overrides(d)["+model.fail_rank"] == "0")
    objectives = [
        json.loads((d / "summary.json").read_text())["objective"]
        for d in runs.values()
        if overrides(d)["+model.fail_rank"] == "-1"
    ]
    assert sorted(objectives) == sorted(t["value"] for t in passing)
    result = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert result.best_value == min(objectives)


def test_with_the_basic_sweeper_a_failed_point_fails_the_sweep(tmp_path: Path) -> None:
    """The contrast: Hydra's basic sweeper asks for no value, so a failure ends the sweep non-zero."""
    model = ["model._target_=user_models.FailingModel", "+model.fail_rank=-1,0", "launcher.nproc=1"]
    run = run_dtf([*model, *SMALL], tmp_path / "sweep", multirun=True, expect=1)
    assert "dtf: error: rank 0 failed" in run.stderr
    assert (tmp_path / "sweep" / "0" / "summary.json").exists()


@pytest.fixture
def slurm_conf(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A one-node SLURM cluster (scripts/local-slurm.sh), as the SLURM launcher tests use."""
    with script_cluster("local-slurm.sh", "SLURM_CONF") as conf:
        monkeypatch.setenv("SLURM_CONF", conf)
        yield conf


def test_on_slurm_each_trials_job_is_waited_for_before_the_next_is_chosen(
    side_python: Path, tmp_path: Path, slurm_conf: str
) -> None:
    sweep_dir = tmp_path / "sweep"
    run = optuna_sweep(
        side_python,
        sweep_dir,
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=1",  # one trial asked at a time: the second is chosen knowing the first
        "hydra.sweeper.sampler.seed=0",
        "optimizer.lr=tag(log,interval(1e-4,1e-2))",
        "launcher=slurm",
        "launcher.tasks_per_node=1",
        *SMALL,
    )
    jobs = re.findall(r"submitted SLURM job (\d+)", run.stdout)
    assert len(set(jobs)) == 2, run.stdout
    # the first job was followed to its final line before the second was submitted; none left for the end
    assert run.stdout.index("/sweep/0/summary.json") < run.stdout.index(f"job {jobs[1]};"), run.stdout
    assert " done: " not in run.stdout
    runs = points(sweep_dir)
    summaries = {n: json.loads((d / "summary.json").read_text()) for n, d in runs.items()}
    assert [summaries[n]["slurm_job_id"] for n in (0, 1)] == jobs
    told = trials(side_python, sweep_dir)
    assert [t["state"] for t in told] == ["COMPLETE", "COMPLETE"]
    assert sorted(t["value"] for t in told) == sorted(s["objective"] for s in summaries.values())
