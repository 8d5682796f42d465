"""hydra/sweeper=dtf's whole sweep (dtf.sweep.sweeper.Sweep.run) in this process, with each
trial's `python -m dtf` process stood in by a function of Hydra's Optuna sweeper's examples
(dtf.models.optuna_examples) evaluated on the trial's own command line: the sweeper's logic (ask,
start, reap, tell, conclude) without the seconds a real trial takes to start."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from dtf.files import write_json
from dtf.sweep import sweeper as sweeper_module
from dtf.sweep.settings import SAMPLERS
from dtf.sweep.sweeper import Sweep


def sampler(name: str, **options: Any) -> dict[str, Any]:
    """hydra/sweeper/sampler=<name> with options, as Hydra composes it."""
    return {**dataclasses.asdict(SAMPLERS[name]()), **options}


def sweep_of(
    sweep_dir: Path,
    sampler_config: dict[str, Any],
    params: dict[str, str] | None,
    hparams: dict[str, Any] | None = None,
    objective: Any = "auto",
    **settings: Any,
) -> Sweep:
    """A Sweep of the example app whose config is trainer.hparams (its x, y, ...); params keys
    are the example's, e.g. x -> trainer.hparams.x."""
    config = OmegaConf.create(
        {
            "trainer": {"objective": objective, "objective_mode": "min", "hparams": hparams or {"x": 1, "y": 1}},
            "launcher": {"name": "local", "nproc": 1},
            "hydra": {
                "sweep": {"dir": str(sweep_dir)},
                "job": {"config_name": "config"},
                "overrides": {"hydra": []},
                "runtime": {"config_sources": []},
            },
        }
    )
    ours = None if params is None else {f"trainer.hparams.{k}": v for k, v in params.items()}
    arguments = settings.pop("arguments", [])
    return Sweep({"sampler": sampler_config, "params": ours, **settings}, config, arguments)


class FinishedTrial:
    """A trial's process that has already ended with returncode."""

    def __init__(self, returncode: int) -> None:
        self.returncode = returncode

    def poll(self) -> int:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        pass


def standing_in(fn: Callable[..., dict[str, float]], base: dict[str, Any]) -> Callable[..., FinishedTrial]:
    """subprocess.Popen for a trial: fn on the trial's trainer.hparams (base, then the command
    line's trainer.hparams.* overrides and deletions), its summary.json written as a
    trainer=function run writes it."""

    def popen(cmd: list[str], stdout: io.BufferedWriter, **kw: Any) -> FinishedTrial:
        assert cmd[1:3] == ["-m", "dtf"], cmd  # each trial is a dtf run
        hparams = dict(base)
        run_dir, objective = None, "test/loss"
        for arg in cmd[3:]:
            key, _, value = arg.partition("=")
            name = key.lstrip("+~").removeprefix("trainer.hparams.")
            if key == "hydra.run.dir":
                run_dir = Path(value)
            elif key == "trainer.objective":
                objective = value
            elif key.startswith("~trainer.hparams."):
                hparams.pop(name, None)
            elif key.lstrip("+").startswith("trainer.hparams."):
                hparams[name] = yaml.safe_load(value)
        assert run_dir is not None
        try:
            result = fn(None, hparams, None, None)
        except RuntimeError as e:
            stdout.write(f"dtf: error: rank 0 failed: RuntimeError: {e}\n".encode())
            return FinishedTrial(1)
        value = result[objective.partition("/")[2]]
        write_json(run_dir / "summary.json", {"objective": value, "objective_name": objective, "result": result})
        return FinishedTrial(0)

    return popen


def run_sweep(monkeypatch: pytest.MonkeyPatch, sweep: Sweep, fn: Callable[..., dict[str, float]]) -> Any:
    """Sweep.run() with fn standing in for each trial; returns optimization_results.yaml."""
    monkeypatch.setattr(sweeper_module.subprocess, "Popen", standing_in(fn, dict(sweep.config.trainer.hparams)))
    monkeypatch.setattr(sweeper_module, "POLL_S", 0.0)
    sweep.run()
    return OmegaConf.load(sweep.dir / "optimization_results.yaml")
