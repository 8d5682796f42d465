"""dtf from Python: the run `python -m dtf <overrides>` makes, in your own process (a notebook
cell, a script, a test, an HPO loop), with the same config tree, checks, launchers and run
directory. Errors are raised, not printed: a bad setting is a `dtf.UserError` carrying the one
line the command line prints.

    import dtf
    summary = dtf.run(["strategy=zero", "trainer.max_epochs=5"])
    summaries = dtf.sweep(["optimizer.lr=1e-3,3e-3"])   # Hydra's basic sweeper's grammar
    dtf.validate(cfg)   # a config from Hydra's compose API: the run's checks, without the run
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf, open_dict

from dtf.config.keys import config_error_line
from dtf.errors import UserError
from dtf.files import make_dir
from dtf.results import Finished, Stopped, Submitted

if TYPE_CHECKING:
    from dtf.config.typed import RunConfig


class RunStopped(Exception):
    """A stop signal ended the run at a checkpoint (the command line's exit status 75): run the
    same call with run_dir=<its run dir> to continue it. result: where it stopped."""

    def __init__(self, message: str, result: Stopped, run_dir: str) -> None:
        super().__init__(message)
        self.result = result
        self.run_dir = run_dir


def run(
    overrides: list[str] | None = None, *, config_dir: str | None = None, run_dir: str | None = None
) -> dict[str, Any]:
    """One run; returns rank 0's summary (summary.json, with `run_dir` in it).

    overrides: what follows `python -m dtf` on a command line. config_dir: a directory of your
    own configs added to dtf's search path, as Hydra's --config-dir does (your options of dtf's
    groups, e.g. <config_dir>/model/mine.yaml for model=mine). run_dir: where the run writes
    (default: hydra.run.dir, outputs/<date>/<time> under the working directory); an existing
    run directory with a checkpoint continues that run, as on the command line.

    Raises dtf.UserError for a bad setting or a failed rank (RankFailedError), dtf.api.RunStopped
    when a stop signal ended it, dtf.errors.Interrupted on Ctrl-C and other signals.
    """
    from dtf.cli import freeze, launch_frozen, stop_line

    cfg, default_dir, _ = _compose(list(overrides or []), config_dir, "run")
    frozen = freeze(cfg, list(overrides or []))  # bad input raises here, before anything is written
    directory = make_dir(run_dir or default_dir, "run_dir" if run_dir else "hydra.run.dir")
    with _holding(frozen, directory, "run_dir" if run_dir else "hydra.run.dir"):
        _write_hydra_files(cfg, list(overrides or []), directory)
        result = launch_frozen(frozen, str(directory))
    return _summary(result, str(directory), stop_line)


def validate(cfg: DictConfig) -> RunConfig:
    """The checks `python -m dtf` makes before anything starts, on a config you composed yourself
    (Hydra's compose API on `dtf.conf`, or on a tree of your own that puts `pkg://dtf.conf` on its
    search path). Raises dtf.UserError with the line the command line prints after `dtf: error:`;
    returns it typed (dtf.config.typed.RunConfig). cfg is left as it is (a resolved copy is checked; a
    `hydra` node, from compose(..., return_hydra_config=True), is not the run's and is left out)."""
    from dtf.cli import check

    job = copy.deepcopy(cfg)
    with open_dict(job):
        job.pop("hydra", None)
    OmegaConf.resolve(job)
    return check(job)


def run_function(
    fn: Callable[..., Any],
    *args: Any,
    mode: str = "function",
    kwargs: dict[str, Any] | None = None,
    module: Callable[..., Any] | None = None,
    train_set: Any = None,
    test_set: Any = None,
    hparams: dict[str, Any] | None = None,
    val_set: Any = None,
    overrides: list[str] | None = None,
    config_dir: str | None = None,
    run_dir: str | None = None,
) -> Any:
    """Your own training function, made distributed, with the strategy, launcher and run directory
    of `overrides`. Two modes (dtf.train.function says what each gets on a rank):

    mode="function" (Maggy's lagom, HorovodRunner's run without Horovod): on every rank
    fn(module, hparams, train_set, test_set) -> float | dict, with no distributed code in it.
    module: the model's class (or any callable returning an nn.Module); default: the config's
    `model`. train_set, test_set: datasets (shipped to the ranks by pickle); default: the config's
    `data.dataset`. val_set: a validation set, which fn then gets as its keyword val_set.
    hparams: passed to fn (over trainer.hparams). Returns rank 0's summary:
    `result` is what fn returned, averaged over the ranks exactly.

    mode="torchrun" (TorchDistributor's contract): on every rank fn(*args, **kwargs), with
    MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK set and no process group: fn makes
    its own (init_process_group, or hvd.init() of dtf.horovod). Returns rank 0's return value.

    fn, module, the datasets and the arguments may be defined in a notebook or a script: they
    travel to the ranks as code (cloudpickle)."""
    from dtf.cli import freeze, launch_frozen, stop_line
    from dtf.rank import rank_main
    from dtf.train.function import FUNCTION, TORCHRUN, Payload, dump

    if mode == FUNCTION:
        if args or kwargs:
            raise UserError(
                'run_function: args and kwargs go to a function of mode="torchrun"; in mode="function" the '
                "function is called as fn(module, hparams, train_set, test_set): pass hparams="
            )
        if (test_set is not None or val_set is not None) and train_set is None:
            raise UserError(
                "test_set or val_set without train_set: give the datasets, or none (the config's data.dataset)"
            )
    elif mode == TORCHRUN:
        given = [
            k
            for k, v in dict(
                module=module, train_set=train_set, test_set=test_set, val_set=val_set, hparams=hparams
            ).items()
            if v
        ]
        if given:
            raise UserError(
                f'run_function: {", ".join(given)} are for mode="function"; a function of mode="torchrun" gets '
                "its arguments as run_function(fn, *args, kwargs={...})"
            )
    else:
        raise UserError(f'run_function: mode={mode!r} is not a mode: use mode="function" or mode="torchrun"')
    cfg, default_dir = _function_config(list(overrides or []), config_dir)
    frozen = freeze(cfg, list(overrides or []))
    payload = dump(
        Payload(fn, module, train_set, test_set, dict(hparams or {}), mode, args, dict(kwargs or {}), val_set)
    )
    directory = make_dir(run_dir or default_dir, "run_dir" if run_dir else "hydra.run.dir")
    with _holding(frozen, directory, "run_dir" if run_dir else "hydra.run.dir"):
        _write_hydra_files(cfg, list(overrides or []), directory)
        # a name for the launchers' logs (a partial has none)
        rank_fn = functools.update_wrapper(functools.partial(rank_main, payload=payload), rank_main)
        result = launch_frozen(frozen, str(directory), rank_fn)
    summary = _summary(result, str(directory), stop_line)
    return summary.get("returned") if mode == TORCHRUN else summary


def _function_config(overrides: list[str], config_dir: str | None) -> tuple[DictConfig, str]:
    """The config of a dtf.run_function run: trainer.fn names the placeholder of a shipped function
    (its objective is then any key the function returns, dtf.preflight). The function builds its
    own models, which no memory check sees beforehand."""
    from dtf.train.function import SHIPPED

    fn = f"trainer.fn={{_target_:{SHIPPED},_partial_:true}}"
    cfg, default_dir, _ = _compose([*overrides, fn, "trainer.memory_check=off"], config_dir, "run")
    return cfg, default_dir


def sweep(
    overrides: list[str] | None = None, *, config_dir: str | None = None, sweep_dir: str | None = None
) -> list[dict[str, Any]]:
    """A sweep as `python -m dtf -m <overrides>` with Hydra's basic sweeper: every combination of
    the comma lists (and range()/choice() sweeps), one run after another, each in
    <sweep_dir>/<n>, then the sweep's report (report.md and plots, dtf.sweep.report). Returns the
    points' summaries in order. For a sweeper that chooses points by their values (Optuna),
    call run() from its objective, or use the command line with hydra/sweeper=..."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from dtf.sweep.report import build

    given = list(overrides or [])
    try:
        parsed = OverridesParser.create().parse_overrides(given)
    except HydraException as e:
        raise UserError(config_error_line(e)) from None
    # The config's own sweep (hydra.sweeper.params, e.g. a recipe's) comes first, then the arguments,
    # as in Hydra's BasicSweeper.sweep; the sweep's directory is named by the fixed overrides.
    fixed = [str(o.input_line) for o in parsed if not o.is_sweep_override()]
    _, default_dir, hydra_cfg = _compose(fixed, config_dir, "sweep")
    params = hydra_cfg.sweeper.get("params") or {}
    in_config = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    points = [p for batch in BasicSweeper.split_arguments([*in_config, *parsed], None) for p in batch]
    root = make_dir(sweep_dir or default_dir, "sweep_dir" if sweep_dir else "hydra.sweep.dir")
    summaries = []
    for num, point in enumerate(points):
        summaries.append(run(point, config_dir=config_dir, run_dir=str(root / str(num))))
    try:
        build(root)  # report.md and plots, as at the end of `python -m dtf -m`
    except UserError as e:  # the points' outcomes stand without it
        warnings.warn(f"dtf: no sweep report for {root}: {e}", stacklevel=2)
    return summaries


def _compose(overrides: list[str], config_dir: str | None, mode: str) -> tuple[DictConfig, str, DictConfig]:
    """The job's config (without its `hydra` node, as a Hydra task receives it), the run (or
    sweep) directory hydra.run.dir (hydra.sweep.dir) names, and that `hydra` node, from dtf's tree
    and config_dir."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException

    if config_dir is not None:
        if not Path(config_dir).is_dir():
            raise UserError(f"config_dir={config_dir} is not a directory: give the directory of your config groups")
        overrides = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]", *overrides]
    try:
        with _no_hydra_running(), initialize_config_module("dtf.conf", version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
    except HydraException as e:  # an unknown group option, a key not in the config, a bad grammar
        message = config_error_line(e)
        raise UserError(f"{_unparsable(overrides)}: {message}" if _unparsable(overrides) else message) from None
    hydra_cfg = cfg.hydra
    directory = str(hydra_cfg.run.dir if mode == "run" else hydra_cfg.sweep.dir)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, directory, hydra_cfg


def _unparsable(overrides: list[str]) -> str | None:
    """The first override Hydra's grammar refuses (its message does not say which), if any."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_override(override)
        except HydraException:
            return override
    return None


@contextlib.contextmanager
def _no_hydra_running() -> Iterator[None]:
    """Hydra allows one initialised instance per process: a run started from within a Hydra app
    (a task of `python -m dtf -m`, a user's own @hydra.main) composes on its own, then leaves the
    app's instance as it was."""
    from hydra.core.global_hydra import GlobalHydra

    outer = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        yield
    finally:
        GlobalHydra.instance().clear()
        if outer is not None:
            GlobalHydra.instance().initialize(outer)


def _holding(run: RunConfig, run_dir: Path, key: str) -> contextlib.AbstractContextManager[None]:
    """The run dir held by this process while the run uses it, where the driver holds it (dtf.rundir)."""
    from dtf import launch, rundir

    if launch.driver_holds_run_dir(run.launcher):
        return rundir.holding(run_dir, key)
    return contextlib.nullcontext()


def _write_hydra_files(cfg: DictConfig, overrides: list[str], run_dir: Path) -> None:
    """What Hydra leaves in every run directory and the sweep report reads: .hydra/config.yaml
    (the composed job config) and .hydra/overrides.yaml."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(exist_ok=True)
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), hydra_dir / "overrides.yaml")


def _summary(result: Any, run_dir: str, stop_line: Any) -> dict[str, Any]:
    if result is None:  # a node of a multi-node run without rank 0: that node reports
        return {"run_dir": run_dir, "summary_on_rank_0_node": True}
    if isinstance(result, Finished):
        return result.summary
    if isinstance(result, Stopped):
        raise RunStopped(
            stop_line(result, run_dir).replace("the same command and hydra.run.dir", "run_dir"), result, run_dir
        )
    if isinstance(result, Submitted):  # launcher.wait=false: the job runs on; its summary.json comes later
        return {"job_id": result.job_id, "run_dir": run_dir, "submitted_at": datetime.now().isoformat()}
    raise AssertionError(f"rank 0 returned {result!r}")  # rank 0 always reports; a bug otherwise
