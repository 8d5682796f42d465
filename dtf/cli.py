"""`python -m dtf`: compose the config with Hydra, validate it, launch the ranks. Nothing else.

The config is resolved and frozen here, once, on the driver; launchers ship that object
(pickled) to the ranks, which never re-parse the command line.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dtf import hydra_sweep, launch, rundir
from dtf.config.keys import config_error_line
from dtf.config.typed import RunConfig
from dtf.errors import Interrupted, RankFailedError, UserError
from dtf.files import make_dir, require_writable
from dtf.launch.base import WorkerFn
from dtf.mlflow_sweep import link_trial
from dtf.preflight import check_canonical_partitions, refuse_unread_by_function, validate
from dtf.rank import rank_main
from dtf.results import (
    EXIT_FAILED,
    EXIT_INTERRUPTED_BASE,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    Finished,
    RunResult,
    Stopped,
)


def absolute_pythonpath() -> None:
    """PYTHONPATH entries relative to the driver's working directory (PYTHONPATH=src) mean nothing
    where ranks run elsewhere (Spark executors, SLURM nodes): they travel as absolute paths."""
    if "PYTHONPATH" in os.environ:
        entries = os.environ["PYTHONPATH"].split(os.pathsep)
        os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(e) for e in entries if e)


def run(cfg: DictConfig, run_dir: str) -> RunResult | None:
    """Validate, freeze and launch one run. Callable without Hydra's command line."""
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else ()
    return launch_frozen(freeze(cfg, overrides), run_dir)


def freeze(cfg: DictConfig, overrides: Sequence[str] = ()) -> RunConfig:
    """Resolve, check (UserError: one line) and freeze the config; returns it typed. overrides: the
    user's, that made it (what trainer=function would ignore is refused by them)."""
    absolute_pythonpath()
    refuse_unread_by_function(cfg, overrides)
    OmegaConf.resolve(cfg)
    run = check(cfg, starting=True)
    OmegaConf.set_readonly(cfg, True)
    return run


def check(cfg: DictConfig, starting: bool = False) -> RunConfig:
    """Every check a run makes on the driver before anything starts (dtf.validate from Python, which
    makes them all; starting: a run starts now, and leaves to its ranks what they check as they start)."""
    run = validate(cfg, starting)
    hydra_sweep.check_direction(run.trainer.objective_mode.value)
    return run


def launch_frozen(run: RunConfig, run_dir: str, rank_fn: WorkerFn = rank_main) -> RunResult | None:
    # Before anything reads or writes the run dir: another run that holds it refuses this one.
    with rundir.holding(run_dir) if launch.driver_holds_run_dir(run.launcher) else contextlib.nullcontext():
        # Where checkpoint.resume=auto looks is known only now: a recorded data sequence the world size cannot use.
        check_canonical_partitions(run, Path(run_dir))
        return launch.build(run).launch(rank_fn, run, run_dir)


def report_stop(result: Stopped, run_dir: str) -> NoReturn:
    """A stop signal ended the run early: say where it stands and how to continue, exit EXIT_STOPPED."""
    print(stop_line(result, run_dir) + f" (exit status {EXIT_STOPPED})", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_STOPPED)


def stop_line(result: Stopped, run_dir: str) -> str:
    if result.checkpoint:
        where = f"at step {result.step}, saved {result.checkpoint}"
    else:
        where = "before its first checkpoint (a rerun starts from the beginning)"
    return (
        f"dtf: stopped by {result.signal or 'a stop signal (to another rank)'} {where}; continue with the same "
        f"command and hydra.run.dir={run_dir}"
    )


def report_interrupt(e: Interrupted, run_dir: str) -> NoReturn:
    """A signal that is not a stop request ended the run: say so, never as a clean stop (exit
    75 invites a requeue), and exit as a process killed by that signal would (128 + n)."""
    if e.checkpoint:
        where = (
            f"the newest checkpoint is {e.checkpoint} (step {e.step}): the same command with "
            f"hydra.run.dir={run_dir} continues from it"
        )
    else:
        where = "no checkpoint was written"
    # A closed terminal (SIGHUP) takes stderr with it: the line then fails (EIO), the exit status stands.
    with contextlib.suppress(OSError):
        print(f"dtf: interrupted by {e.signal_name}; the ranks were stopped; {where}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_INTERRUPTED_BASE + signal.Signals[e.signal_name].value)


class RunDirCheck(Callback):
    """Hydra makes the run (or sweep) directory before dtf's code runs, and a directory it cannot make
    would end in its traceback: check it first and say which key to fix, in one line."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _make_dir(config.hydra.run.dir, "hydra.run.dir")
        if launch.driver_holds_run_dir(config.launcher):
            # Before Hydra writes .hydra/ there: a run that holds the dir keeps its record of itself.
            try:
                rundir.hold(config.hydra.run.dir)
            except UserError as e:
                print(f"dtf: error: {e}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_USER_ERROR) from None
        # Hydra writes its record of the run (config.yaml, ...) over the one there: a resumed run's
        # .hydra/ may have been left read-only.
        run_dir = Path(config.hydra.run.dir)
        if config.hydra.output_subdir and (run_dir / config.hydra.output_subdir).is_dir():
            try:
                require_writable(run_dir / config.hydra.output_subdir, "hydra.run.dir", run_dir)
            except UserError as e:
                print(f"dtf: error: {e}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_USER_ERROR) from None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _make_dir(config.hydra.sweep.dir, "hydra.sweep.dir")


def _make_dir(path: str, key: str) -> None:
    try:
        make_dir(path, key)
    except UserError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


_task_started = False  # set once Hydra hands dtf a composed config: errors after it are not the command line's


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    global _task_started
    _task_started = True
    return run_point(cfg, HydraConfig.get().runtime.output_dir, value_sweep=hydra_sweep.wants_values())


def run_point(cfg: DictConfig, run_dir: str, value_sweep: bool = False) -> float | None:
    """One run as Hydra's task. Returns its objective (summary.json's `objective`), which a sweeper
    that chooses by values, such as Hydra's Optuna sweeper, is told (hydra.sweeper.direction must
    match trainer.objective_mode: dtf.hydra_sweep.check_direction refuses a mismatch); None where
    there is no value: a SLURM job not waited for, a rank other than 0, a failed point.

    A run whose ranks failed, or that a stop signal ended, exits with its status (1, 75): a failure
    never looks clean, and Hydra's basic sweeper ends there. In a value_sweep it prints the same
    line and returns None instead, and so does a run whose objective is NaN: hydra-optuna-sweeper
    1.3.0 records a None it cannot float() as a failed trial and goes on, while a NaN makes Optuna
    2.10 refuse the value and the sweeper crash on its second tell; an exception would end the
    sweep unless hydra.sweeper.max_failure_rate allowed it.
    """
    try:
        link_trial(cfg, run_dir)
        result = run(cfg, run_dir)
    except KeyboardInterrupt:  # Ctrl-C where no launcher turned it into Interrupted (waiting on SLURM, Spark)
        report_interrupt(Interrupted("SIGINT"), run_dir)
    except Interrupted as e:
        report_interrupt(e, run_dir)
    except RankFailedError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        if value_sweep:
            return None
        raise SystemExit(EXIT_FAILED) from None
    except UserError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
    if result is None:  # a rank other than 0 that torchrun or srun started: rank 0 reports
        return None
    if isinstance(result, Stopped):
        if value_sweep:
            print(stop_line(result, run_dir), file=sys.stderr, flush=True)
            return None
        report_stop(result, run_dir)
    if isinstance(result, Finished):
        objective = result.summary.get("objective")
        if objective is None or math.isnan(objective):
            return None  # the final line showed it; nothing a sweeper could compare
        return float(objective)
    return None  # Submitted: the job runs on; its summary.json will have the objective


def main() -> None:
    with config_errors_in_one_line():
        _hydra_main()


@contextlib.contextmanager
def config_errors_in_one_line() -> Iterator[None]:
    """A command line Hydra cannot compose (a misspelled key, an unknown option, a bad grammar)
    ends with dtf's one line and exit status 2, as every other bad input does: Hydra itself prints
    its message over several lines and exits 1, which dtf's exit statuses keep for a failed rank.

    Hydra reports through hydra._internal.utils.run_and_report (hydra-core 1.3); dtf wraps what it
    runs, so only a config error raised before dtf's task starts is turned into the line, and
    HYDRA_FULL_ERROR=1 still shows Hydra's traceback."""
    from hydra._internal import utils as hydra_utils
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    report = hydra_utils.run_and_report

    def run_and_report(func: Any) -> Any:
        def composing() -> Any:
            try:
                return func()
            except (HydraException, OmegaConfBaseException) as e:
                if _task_started or os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                print(f"dtf: error: {config_error_line(e)}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_USER_ERROR) from None

        return report(composing)

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    finally:
        hydra_utils.run_and_report = report
