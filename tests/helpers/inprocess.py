"""compose: dtf's config as `python -m dtf` composes it, in process; compose_config: validated and
frozen, as a rank runs it.

train_in_process trains in this very process, on one rank (a process group of one): the whole loop,
checkpoints and resume included, in about a second, without starting any process. For the trainer's
own logic (positions, budgets, schedules, accumulation), where a subprocess run would only add time.

train_on_ranks does the same on N gloo ranks in child processes: each rank runs the rank's own
body (dtf.train.loop.run) for a list of runs in a row, so the ranks start once (a few seconds) and
each further run costs about a second, not the ~9 s of `python -m dtf` (driver, agent, imports).
For comparisons of many short multi-rank runs where the launcher is not what is tested."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from dtf.config import store

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def compose(*overrides: str) -> DictConfig:
    """The config `python -m dtf <overrides>` composes (Hydra's compose API on dtf's tree), as
    composed: neither validated nor frozen. The tests' one way to compose it in process."""
    store.register()
    with hydra.initialize_config_module("dtf.conf", version_base="1.3"):
        return hydra.compose("config", overrides=list(overrides))


def compose_config(overrides: list[str]) -> DictConfig:
    """The config `python -m dtf <overrides>` would run on one rank, validated and frozen as the
    driver does (the `composed` fixture: each composed once per session)."""
    from dtf.preflight import validate

    cfg = compose("launcher.nproc=1", "trainer.progress=off", *overrides)
    validate(cfg)
    OmegaConf.resolve(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


@contextlib.contextmanager
def group_of_one() -> Iterator[Any]:
    """A gloo process group of this process alone (its DistEnv); the environment as it was after."""
    from dtf.dist import env as dist_env

    saved = {k: os.environ.get(k) for k in _TORCHRUN_VARS}
    env = dist_env.init("cpu", "gloo", 60.0)
    try:
        yield env
    finally:
        dist_env.destroy()
        # The run's DDP module can be left in a reference cycle. Collected later in a DataLoader
        # worker forked from this process, its reducer's destructor aborted the worker, and the test
        # hung (torch 2.10 on Python 3.10, test_fetch.py). So it is collected here.
        gc.collect()
        for key, value in saved.items():  # init sets MASTER_ADDR/PORT: leave the environment as it was
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def train_in_process(overrides: list[str], run_dir: Path, stop_request: Any = None) -> Any:
    """dtf.train.loop.run on a process group of one; returns the summary, or the Stopped result.
    stop_request: stands in for the signal handlers (a StopRequest or anything with its interface)."""
    from dtf.config.typed import typed
    from dtf.results import Finished
    from dtf.train.loop import run

    cfg = compose_config(overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    with group_of_one() as env:
        result = run(typed(cfg), env, run_dir, stop_request)
    return result.summary if isinstance(result, Finished) else result


def function_in_process(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """trainer=function (dtf.train.function.run) on a process group of one; returns the summary."""
    from dtf.config.typed import typed
    from dtf.train import function

    cfg = compose_config(["trainer=function", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    with group_of_one() as env:
        result = function.run(typed(cfg), env, run_dir, None)
    assert result is not None
    return result.summary


def _train_runs(rank: int, world_size: int, runs: list[tuple[str, list[str]]], root: Path) -> None:
    import torch

    from dtf.config.typed import typed
    from dtf.dist import env as dist_env
    from dtf.train.loop import run

    torch.set_num_threads(1)  # ranks share the machine's cores
    env = dist_env.init("cpu", "gloo", 60.0)  # the group run_on_ranks made
    for name, overrides in runs:
        cfg = compose_config([f"launcher.nproc={world_size}", *overrides])
        (root / name).mkdir(parents=True, exist_ok=True)
        run(typed(cfg), env, root / name)


def train_on_ranks(world_size: int, runs: list[tuple[str, list[str]]], root: Path) -> dict[str, dict[str, Any]]:
    """Each (run dir name, overrides) in order on world_size ranks (a name given twice continues
    in the same run dir: a resume); returns each run dir's summary.json."""
    import json

    from tests.helpers.gloo import run_on_ranks

    run_on_ranks(_train_runs, world_size, runs, root)
    return {name: json.loads((root / name / "summary.json").read_text()) for name, _ in runs}
