"""The example functions of Hydra's Optuna sweeper (its plugins/hydra_optuna_sweeper/example/),
as dtf runs of trainer=function: each is called as fn(module, hparams, train_set, test_set) and
returns its value(s) as the run's result, so hydra/sweeper=dtf searches them as that plugin does.

    python -m dtf -m trainer=function trainer.fn._target_=dtf.models.optuna_examples.sphere \\
        '+trainer.hparams={x: 1, y: 1}' launcher.nproc=1 hydra/sweeper=dtf hydra.sweeper.sampler.seed=123 \\
        'trainer.hparams.x=range(-5.5,5.5,step=0.5)' 'trainer.hparams.y=choice(-5,0,5)'
"""

from __future__ import annotations

from typing import Any


def sphere(module: Any, hparams: dict[str, Any], train_set: Any, test_set: Any) -> dict[str, float]:
    """example/sphere.py: x^2 + y^2 (the run's test/loss); hparams.error=true fails, as its cfg.error does."""
    if hparams.get("error", False):
        raise RuntimeError("cfg.error is True")
    x, y = float(hparams["x"]), float(hparams["y"])
    return {"loss": x**2 + y**2}


def binh_and_korn(module: Any, hparams: dict[str, Any], train_set: Any, test_set: Any) -> dict[str, float]:
    """example/multi-objective.py: two objectives, v0 = 4x^2 + 4y^2 and v1 = (x - 5)^2 + (y - 5)^2."""
    x, y = float(hparams["x"]), float(hparams["y"])
    return {"v0": 4 * x**2 + 4 * y**2, "v1": (x - 5) ** 2 + (y - 5) ** 2}


def multi_dimensional_sphere(module: Any, hparams: dict[str, Any], train_set: Any, test_set: Any) -> dict[str, float]:
    """example/custom-search-space-objective.py: w^2 + x^2 + y^2 + z^2."""
    return {"loss": sum(float(hparams[k]) ** 2 for k in ("w", "x", "y", "z"))}


def configure(cfg: Any, trial: Any) -> None:
    """example/custom-search-space-objective.py's custom_search_space: z within
    max_z_difference_from_x of x, and a new key w (hence its +)."""
    x = trial.params["trainer.hparams.x"]
    limit = cfg.trainer.hparams.max_z_difference_from_x
    trial.suggest_float("trainer.hparams.z", x - limit, x + limit)
    trial.suggest_float("+trainer.hparams.w", 0.0, 1.0)
