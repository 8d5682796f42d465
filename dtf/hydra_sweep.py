"""What the Hydra sweeper that runs this process wants of each point, told by hydra.sweeper._target_.

Hydra's basic sweeper (`-m key=a,b`) runs a fixed list of points and only collects what they
return: a failed point fails the sweep, and on SLURM every point may be submitted before any is
waited for. Any other sweeper (Hydra's Optuna sweeper, for one) chooses its next points from the
values of the last ones, so each point must end with its value (the run's objective): SLURM
points are waited for, and a point that failed or was stopped returns no value (None), which that
sweeper records as a failed point before it goes on (dtf.cli.run_point says why not NaN).
"""

from __future__ import annotations

from typing import Any

from dtf.errors import UserError

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# hydra.sweeper.direction in Optuna's words, by trainer.objective_mode.
_DIRECTIONS = {"min": "minimize", "max": "maximize"}


def _sweeper() -> Any | None:
    """hydra.sweeper of a multirun in progress; None outside one (a single run, dtf.run, a rank)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return HydraConfig.get().sweeper


def sweep_dir() -> str | None:
    """hydra.sweep.dir of a multirun in progress; None outside one."""
    from hydra.core.hydra_config import HydraConfig

    return None if _sweeper() is None else str(HydraConfig.get().sweep.dir)


def in_basic_sweep() -> bool:
    """A point of Hydra's basic sweeper, which needs no value from it."""
    sweeper = _sweeper()
    return sweeper is not None and sweeper.get("_target_") == BASIC_SWEEPER


def wants_values() -> bool:
    """A point of a sweeper that chooses by the points' values (any but the basic one)."""
    sweeper = _sweeper()
    return sweeper is not None and sweeper.get("_target_") != BASIC_SWEEPER


def check_direction(objective_mode: str) -> None:
    """Refuse a sweeper told to minimize what the run says is better when larger, or the reverse
    (hydra.sweeper.direction, as Hydra's Optuna sweeper names it), or several objectives."""
    sweeper = _sweeper()
    if sweeper is None or not wants_values() or sweeper.get("direction") is None:
        return
    direction = sweeper.direction
    if not isinstance(direction, str | int) and not hasattr(direction, "name"):  # a list: several objectives
        raise UserError(
            f"hydra.sweeper.direction={list(direction)} asks for several objectives: a dtf run gives one, "
            f"trainer.objective; set hydra.sweeper.direction={_DIRECTIONS[objective_mode]}"
        )
    name = str(getattr(direction, "name", direction))
    wanted = _DIRECTIONS[objective_mode]
    if name in _DIRECTIONS.values() and name != wanted:
        raise UserError(
            f"hydra.sweeper.direction={name} but trainer.objective_mode={objective_mode}: "
            f"set hydra.sweeper.direction={wanted} (or trainer.objective_mode to match)"
        )
