"""`python -m dtf`: compose the config with Hydra, validate it, launch the ranks. Nothing else.

The config is resolved and frozen here, once, on the driver; launchers ship that object
(pickled) to the ranks, which never re-parse the command line.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dtf import launch
from dtf.config import store
from dtf.config.validate import validate
from dtf.errors import Interrupted, RankFailedError, UserError
from dtf.launch.rank import rank_main
from dtf.train.stop import EXIT_STOPPED

EXIT_FAILED = 1
EXIT_USER_ERROR = 2


def _run_stamp() -> str:
    """The default run directory's name: a timestamp, or under an external torchrun (or srun)
    the run id (job and step) that all its ranks share, so they agree on one directory."""
    if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
        return f"torchrun/{os.environ['TORCHELASTIC_RUN_ID']}"
    if "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ:  # tasks of one srun: one directory
        return f"slurm/{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
    return datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")


store.register()
OmegaConf.register_new_resolver("dtf_stamp", _run_stamp, use_cache=True, replace=True)


def absolute_pythonpath() -> None:
    """PYTHONPATH entries relative to the driver's working directory (PYTHONPATH=src) mean nothing
    where ranks run elsewhere (Spark executors, SLURM nodes): they travel as absolute paths."""
    if "PYTHONPATH" in os.environ:
        entries = os.environ["PYTHONPATH"].split(os.pathsep)
        os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(e) for e in entries if e)


def run(cfg: DictConfig, run_dir: str) -> Any:
    """Validate, freeze and launch one run; returns rank 0's summary. Callable without Hydra's CLI."""
    absolute_pythonpath()
    validate(cfg)
    OmegaConf.resolve(cfg)
    OmegaConf.set_readonly(cfg, True)
    launcher = launch.build(cfg.launcher)
    return launcher.launch(rank_main, cfg, run_dir)


def report_stop(result: dict[str, Any], run_dir: str) -> None:
    """A stop signal ended the run early: say where it stands and how to continue, exit EXIT_STOPPED."""
    if result["checkpoint"]:
        where = f"at step {result['step']}, saved {result['checkpoint']}"
    else:
        where = "before its first checkpoint (a rerun starts from the beginning)"
    print(
        f"dtf: stopped by {result['stopped_by']} {where}; continue with the same command and "
        f"hydra.run.dir={run_dir} (exit status {EXIT_STOPPED})",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(EXIT_STOPPED)


def report_interrupt(e: Interrupted, run_dir: str) -> None:
    """A signal that is not a stop request ended the run: say so, never as a clean stop (exit
    75 invites a requeue), and exit as a process killed by that signal would (128 + n)."""
    if e.checkpoint:
        where = (
            f"the newest checkpoint is {e.checkpoint} (step {e.step}): the same command with "
            f"hydra.run.dir={run_dir} continues from it"
        )
    else:
        where = "no checkpoint was written"
    print(f"dtf: interrupted by {e.signal_name}; the ranks were stopped; {where}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signal.Signals[e.signal_name].value)


class RunDirCheck(Callback):
    """Hydra makes the run (or sweep) directory before dtf's code runs, and a directory it cannot make
    would end in its traceback: check it first and say which key to fix, in one line."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _make_dir(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _make_dir(config.hydra.sweep.dir, "hydra.sweep.dir")


def _make_dir(path: str, key: str) -> None:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(
            f"dtf: error: {key}={path} cannot be made ({e.strerror or type(e).__name__}): "
            f"give {key} a directory you can write to",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_USER_ERROR) from None


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> Any:
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        result = run(cfg, run_dir)
    except KeyboardInterrupt:  # Ctrl-C where no launcher turned it into Interrupted (waiting on SLURM, Spark)
        report_interrupt(Interrupted("SIGINT"), run_dir)
    except Interrupted as e:
        report_interrupt(e, run_dir)
    except RankFailedError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_FAILED) from None
    except UserError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
    if isinstance(result, dict) and "stopped_by" in result:
        report_stop(result, run_dir)
    return result


def main() -> None:
    _hydra_main()
