"""What Hydra's task returns (dtf.cli.run_point) and what a sweeper other than the basic one gets:
the objective, no value for a failed or stopped point, SLURM points waited for, a direction that
matches trainer.objective_mode. In process, with the run and the SLURM job stood in for."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hydra.conf import HydraConf
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from dtf import cli, hydra_sweep
from dtf.config.schema import SlurmLauncherConfig
from dtf.errors import RankFailedError, UserError
from dtf.launch import slurm
from dtf.results import EXIT_FAILED, EXIT_STOPPED, Finished, Stopped, Submitted

OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


@pytest.fixture
def sweep() -> Iterator[Any]:
    """sweep(target, mode=MULTIRUN, **sweeper keys): makes this process a point of that sweep."""

    def _set(target: str = hydra_sweep.BASIC_SWEEPER, mode: RunMode = RunMode.MULTIRUN, **keys: Any) -> None:
        hydra = OmegaConf.structured(HydraConf)
        hydra.mode = mode
        hydra.sweeper = {"_target_": target, **keys}
        HydraConfig.instance().set_config(OmegaConf.create({"hydra": hydra}))

    yield _set
    HydraConfig.instance().cfg = None


def point(monkeypatch: pytest.MonkeyPatch, outcome: Any, value_sweep: bool) -> float | None:
    """run_point with dtf.cli.run standing in: returns outcome, or raises it."""

    def fake_run(cfg: Any, run_dir: str) -> Any:
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(cli, "run", fake_run)
    return cli.run_point(OmegaConf.create({}), "/runs/0", value_sweep=value_sweep)


@pytest.mark.parametrize("value_sweep", [False, True])
def test_a_finished_point_returns_its_objective_as_a_float(monkeypatch: pytest.MonkeyPatch, value_sweep: bool) -> None:
    value = point(monkeypatch, Finished({"objective": 0.25, "final_train_loss": 0.5}), value_sweep)
    assert value == 0.25 and type(value) is float


@pytest.mark.parametrize("objective", [None, math.nan])
def test_a_point_without_a_comparable_objective_returns_no_value(
    monkeypatch: pytest.MonkeyPatch, objective: float | None
) -> None:
    # NaN would crash Hydra's Optuna sweeper (see run_point); None is told as a failed trial
    assert point(monkeypatch, Finished({"objective": objective}), value_sweep=True) is None


def test_a_failed_point_returns_no_value_to_a_value_sweeper_and_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert point(monkeypatch, RankFailedError("rank 1 failed: boom"), value_sweep=True) is None
    assert capsys.readouterr().err == "dtf: error: rank 1 failed: boom\n"


def test_a_failed_point_elsewhere_exits_non_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as e:
        point(monkeypatch, RankFailedError("rank 1 failed: boom"), value_sweep=False)
    assert e.value.code == EXIT_FAILED


def test_a_stopped_point_returns_no_value_to_a_value_sweeper_and_says_where_it_stands(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stopped = Stopped("SIGUSR1", 40, "/runs/0/checkpoints/step_40")
    assert point(monkeypatch, stopped, value_sweep=True) is None
    assert "dtf: stopped by SIGUSR1 at step 40, saved /runs/0/checkpoints/step_40" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        point(monkeypatch, stopped, value_sweep=False)
    assert e.value.code == EXIT_STOPPED


def test_a_bad_setting_ends_even_a_value_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as e:
        point(monkeypatch, UserError("trainer.x=1 is invalid"), value_sweep=True)
    assert e.value.code == 2


def test_a_submitted_job_has_no_value_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    assert point(monkeypatch, Submitted("123"), value_sweep=False) is None


def test_which_sweeper_wants_values(sweep: Any) -> None:
    assert not hydra_sweep.wants_values() and not hydra_sweep.in_basic_sweep()  # no Hydra at all
    sweep(mode=RunMode.RUN)
    assert not hydra_sweep.wants_values() and not hydra_sweep.in_basic_sweep()  # a single run
    sweep()
    assert not hydra_sweep.wants_values() and hydra_sweep.in_basic_sweep()
    sweep(OPTUNA)
    assert hydra_sweep.wants_values() and not hydra_sweep.in_basic_sweep()


@pytest.mark.parametrize(
    ("direction", "mode", "refused"),
    [
        ("minimize", "min", None),
        ("maximize", "max", None),
        ("minimize", "max", "hydra.sweeper.direction=minimize but trainer.objective_mode=max: set "),
        ("maximize", "min", "hydra.sweeper.direction=maximize but trainer.objective_mode=min: set "),
        (["maximize", "minimize"], "max", "asks for several objectives"),
    ],
)
def test_the_sweepers_direction_must_match_the_objective_mode(
    sweep: Any, direction: Any, mode: str, refused: str | None
) -> None:
    sweep(OPTUNA, direction=direction)
    if refused is None:
        hydra_sweep.check_direction(mode)
    else:
        with pytest.raises(UserError, match=re.escape(refused)):
            hydra_sweep.check_direction(mode)


def test_the_optuna_sweepers_default_direction_is_its_enum(sweep: Any) -> None:
    """Without hydra.sweeper.direction on the command line, the plugin's config holds its Direction enum."""
    from enum import Enum

    direction = Enum("Direction", ["minimize", "maximize"])
    sweep(OPTUNA, direction=direction.minimize)
    hydra_sweep.check_direction("min")
    with pytest.raises(UserError, match=re.escape("set hydra.sweeper.direction=maximize")):
        hydra_sweep.check_direction("max")


def test_the_basic_sweeper_has_no_direction_to_check(sweep: Any) -> None:
    sweep()
    hydra_sweep.check_direction("max")


class FakeExecutor:
    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, fn: Any) -> Any:
        self.submitted += 1
        return SimpleNamespace(job_id=str(100 + self.submitted), paths=SimpleNamespace(folder="/runs/0/slurm"))


@pytest.fixture
def slurm_launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """launcher(**config) -> (SlurmLauncher, executor, waited job ids), submitting nowhere."""
    waited: list[str] = []
    executor = FakeExecutor()
    monkeypatch.setattr(slurm.SlurmLauncher, "_executor", lambda self, run_dir, nodes: executor)

    def fake_wait_for(job: Any, run_dir: str, tasks: int, elastic: bool, asked: str, stream: bool = True) -> Finished:
        waited.append(job.job_id)
        return Finished({"objective": 0.5})

    monkeypatch.setattr(slurm, "wait_for", fake_wait_for)
    yield lambda **c: (slurm.SlurmLauncher(SlurmLauncherConfig(**c)), executor, waited)
    slurm.SUBMITTED.clear()


def test_under_the_basic_sweeper_slurm_points_are_submitted_and_waited_for_at_the_end(
    sweep: Any, slurm_launcher: Any
) -> None:
    sweep()
    launcher, _, waited = slurm_launcher()
    assert launcher._submit(print, OmegaConf.create({}), "/runs/0") == Submitted("101")
    assert waited == [] and [job.job_id for job, *_ in slurm.SUBMITTED] == ["101"]


def test_under_another_sweeper_each_slurm_point_is_waited_for(sweep: Any, slurm_launcher: Any) -> None:
    sweep(OPTUNA)
    launcher, _, waited = slurm_launcher()
    assert launcher._submit(print, OmegaConf.create({}), "/runs/0") == Finished({"objective": 0.5})
    assert waited == ["101"] and slurm.SUBMITTED == []


def test_under_another_sweeper_launcher_wait_false_is_refused_before_submitting(
    sweep: Any, slurm_launcher: Any
) -> None:
    sweep(OPTUNA)
    launcher, executor, _ = slurm_launcher(wait=False)
    with pytest.raises(UserError, match=re.escape("launcher.wait=false: this sweeper chooses its next points")):
        launcher._submit(print, OmegaConf.create({}), "/runs/0")
    assert executor.submitted == 0
