"""hydra/sweeper=dtf on the driver: Optuna suggests points, `parallel` trials train at once, and
a new one starts as soon as one ends or is pruned (no batches).

Each trial is a whole `python -m dtf` run of its own, in `<sweep dir>/<trial number>`, started
with the sweep's fixed overrides, its sampled values and a `trial` section that links it to the
study: its ranks, its launcher (local processes, a SLURM job, a Spark job), its checkpoints and
its summary.json are those of any run. Its output goes to `<trial dir>/trial.log`; the sweep
prints one line when a trial starts and one when it ends.

The study lives in storage every trial reaches (a journal file in the sweep dir by default), so
a sweep that was interrupted continues with the same command and hydra.sweep.dir: finished
trials are kept, and trials that were running start again in their own run dirs, where they
resume from their newest checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf

from dtf.errors import UserError
from dtf.files import write_json
from dtf.machine import threads_per_rank
from dtf.results import EXIT_FAILED, EXIT_STOPPED, EXIT_USER_ERROR
from dtf.sweep.settings import SweeperSettings
from dtf.sweep.space import SearchSpace, search_space
from dtf.sweep.study import build_pruner, build_sampler, open_storage, storage_spec

TRIAL_FILE = "trial.json"  # the sweep's record of a trial: params, state, value, times
LOG_FILE = "trial.log"
POLL_S = 0.2
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
# Keys of the sweep's own command line that its trials must not inherit.
SWEEP_ONLY = (
    "hydra/sweeper",
    "hydra.sweeper",
    "hydra/launcher",
    "hydra.launcher",
    "hydra.sweep",
    "hydra.mode",
    "hydra.run",
)


@dataclass
class Running:
    trial: optuna.trial.FrozenTrial
    process: subprocess.Popen[bytes]
    record: dict[str, Any]
    log: Any = field(repr=False)


def run_sweep(settings: dict[str, Any], config: DictConfig, arguments: list[str]) -> None:
    """Hydra's Sweeper.sweep for hydra/sweeper=dtf. Bad settings end in one line (exit 2)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep says what happens, a line per trial
    try:
        Sweep(settings, config, arguments).run()
    except UserError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


class Sweep:
    def __init__(self, settings: dict[str, Any], config: DictConfig, arguments: list[str]) -> None:
        s = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SweeperSettings), settings))
        assert isinstance(s, SweeperSettings)
        if s.n_trials < 1 or s.parallel < 1:
            raise UserError(
                f"hydra.sweeper.n_trials={s.n_trials}, hydra.sweeper.parallel={s.parallel}: both must be >= 1"
            )
        self.pruner = build_pruner(s.pruner, s.pruner_options)  # a bad name or option: one line, before anything runs
        self.s = s
        self.config = config
        self.dir = Path(config.hydra.sweep.dir).resolve()
        self.space: SearchSpace = search_space(dict(s.params), list(arguments))
        if not self.space.distributions:
            raise UserError(
                "hydra/sweeper=dtf has nothing to search: give hydra.sweeper.params (or sweep overrides such as "
                "'optimizer.lr=tag(log,interval(1e-4,1e-1))')"
            )
        self.storage = storage_spec(s.storage, self.dir)
        mode = config.trainer.objective_mode
        self.direction = "maximize" if str(getattr(mode, "value", mode)).lower() == "max" else "minimize"
        self.objective = str(config.trainer.objective)
        self.running: list[Running] = []
        self.stopped: list[int] = []  # trials a stop signal of their own stopped (continued by the next run)
        self.stop_signal: str | None = None

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, self.dir / "multirun.yaml")
        study = self.open_study()
        stale = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        done = len(study.get_trials(deepcopy=False, states=FINISHED))
        if done or stale:
            print(
                f"dtf: continuing the sweep in {self.dir}: {done} trial(s) finished, "
                f"{len(stale)} to continue from their checkpoints",
                flush=True,
            )
        to_resume = list(stale)
        started = done + len(stale)
        with self.forwarding_stop_signals():
            while True:
                while self.stop_signal is None and len(self.running) < self.s.parallel:
                    if to_resume:
                        self.start(study, to_resume.pop(0), resumed=True)
                    elif started < self.s.n_trials:
                        self.start(study, study.ask(self.space.distributions), resumed=False)
                        started += 1
                    else:
                        break
                if not self.running:
                    break
                self.reap(study)
                time.sleep(POLL_S)
        if self.stop_signal is not None:
            print(
                f"dtf: sweep stopped by {self.stop_signal}; its running trials stopped at a checkpoint; "
                f"continue with the same command and hydra.sweep.dir={self.dir} (exit status {EXIT_STOPPED})",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(EXIT_STOPPED)
        self.conclude(study)

    def open_study(self) -> optuna.Study:
        storage = open_storage(self.storage)
        s = self.s
        existing = {summary.study_name: summary for summary in optuna.get_all_study_summaries(storage)}
        seed = s.seed
        if s.study_name in existing:
            old = existing[s.study_name]
            if old.direction.name.lower() != self.direction:
                raise UserError(
                    f"hydra.sweeper.study_name={s.study_name} in {self.storage} was made to "
                    f"{old.direction.name.lower()}, trainer.objective_mode now says {self.direction}: "
                    "use another study_name or hydra.sweep.dir"
                )
            # The sampler starts where the interrupted sweep's left off, not at its first suggestions again.
            seed = None if s.seed is None else s.seed + old.n_trials
        return optuna.create_study(
            study_name=s.study_name,
            storage=storage,
            sampler=build_sampler(s.sampler, seed),
            pruner=self.pruner,
            direction=optuna.study.StudyDirection[self.direction.upper()],
            load_if_exists=True,
        )

    def start(self, study: optuna.Study, trial: optuna.Trial | optuna.trial.FrozenTrial, resumed: bool) -> None:
        # Optuna gives a fresh trial's sampled params and id only on the Trial; its frozen record
        # (what a continued trial also is) is read from the storage by that id.
        frozen = trial if isinstance(trial, optuna.trial.FrozenTrial) else study._storage.get_trial(trial._trial_id)
        trial_dir = self.dir / str(frozen.number)
        trial_dir.mkdir(parents=True, exist_ok=True)
        overrides = self.space.overrides(frozen.params)
        cmd = [*self.command(), *overrides, *self.passthrough(), f"hydra.run.dir={trial_dir}"]
        cmd += self.trial_overrides(frozen)
        record = {
            "number": frozen.number,
            "params": frozen.params,
            "overrides": overrides,
            "state": "running",
            "started": time.time(),
            "resumed": resumed,
        }
        write_json(trial_dir / TRIAL_FILE, record)
        log = open(trial_dir / LOG_FILE, "ab")  # noqa: SIM115 (closed when the trial ends)
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.trial_env(), preexec_fn=_end_with_parent
        )
        self.running.append(Running(frozen, process, record, log))
        how = "continues" if resumed else "started"
        params = " ".join(f"{k}={_show(v)}" for k, v in frozen.params.items())
        print(
            f"dtf: trial {frozen.number} {how}: {params} ({len(self.running)} running; log {trial_dir / LOG_FILE})",
            flush=True,
        )

    def reap(self, study: optuna.Study) -> None:
        """Tells the study about every trial that has ended, and says so in one line each."""
        for r in [r for r in self.running if r.process.poll() is not None]:
            self.running.remove(r)
            r.log.close()
            if self.stop_signal is not None:  # stopped with the sweep: continued by the next run of it
                continue
            self.tell(study, r)

    def tell(self, study: optuna.Study, r: Running) -> None:
        trial_dir = self.dir / str(r.trial.number)
        summary = _read_json(trial_dir / "summary.json")
        if summary and summary.get("objective_name"):
            self.objective = str(summary["objective_name"])  # trainer.objective resolved (auto: val/loss, ...)
        code = r.process.returncode
        value = summary.get("objective") if summary and code == 0 else None
        ended = time.time()
        r.record.update(ended=ended, seconds=ended - r.record["started"], exit_status=code)
        if code == EXIT_STOPPED:
            # A stop signal reached the trial alone (not the sweep): it stopped at a checkpoint, and
            # stays running in the study, so that the next run of the sweep continues it from there.
            r.record.update(state="stopped")
            write_json(trial_dir / TRIAL_FILE, r.record)
            self.stopped.append(r.trial.number)
            print(
                f"dtf: trial {r.trial.number} stopped at a checkpoint (by a stop signal); the same command "
                f"with hydra.sweep.dir={self.dir} continues it ({len(self.running)} running)",
                flush=True,
            )
            return
        if summary and code == 0 and summary.get("pruned"):
            state, text = optuna.trial.TrialState.PRUNED, f"pruned after epoch {summary.get('epochs')}"
            study.tell(r.trial.number, state=state)
        elif value is not None and math.isfinite(value):
            state, text = optuna.trial.TrialState.COMPLETE, f"{self.objective} {value:.6g}"
            study.tell(r.trial.number, value)
        else:
            why = f"exit status {code}" if code != 0 else f"no finite {self.objective}"
            state, text = optuna.trial.TrialState.FAIL, f"failed ({why}; see {trial_dir / LOG_FILE})"
            study.tell(r.trial.number, state=state)
        r.record.update(state=state.name.lower(), value=value, epochs=summary.get("epochs") if summary else None)
        write_json(trial_dir / TRIAL_FILE, r.record)
        print(f"dtf: trial {r.trial.number} {text} ({len(self.running)} running)", flush=True)

    def conclude(self, study: optuna.Study) -> None:
        trials = study.get_trials(deepcopy=False)
        counts = {s: sum(t.state == s for t in trials) for s in FINISHED}
        C, P, F = (counts[s] for s in FINISHED)
        best_line = "no trial completed"
        if C:
            best = study.best_trial
            params = " ".join(f"{k}={_show(v)}" for k, v in best.params.items())
            best_line = f"best trial {best.number}: {self.objective} {best.value:.6g} with {params}"
            # The test score of the chosen trial only: the one estimate the search did not choose by.
            finals = (_read_json(self.dir / str(best.number) / "summary.json") or {}).get("final_metrics") or {}
            chose_on_val = self.objective.startswith("val/")
            test = {k: v for k, v in finals.items() if k.startswith("test/")} if chose_on_val else {}
            if test:
                best_line += "; its test score: " + ", ".join(f"{k} {v:.6g}" for k, v in sorted(test.items()))
            record = {"number": best.number, "value": best.value, "params": best.params, "objective": self.objective}
            write_json(self.dir / "best.json", {**record, "test": test or None})
        stopped = f", {len(self.stopped)} stopped (the same command continues them)" if self.stopped else ""
        print(
            f"dtf: sweep done: {len(trials)} trial(s), {C} completed, {P} pruned, {F} failed{stopped}; "
            f"{best_line}; study {self.s.study_name} in {self.storage}",
            flush=True,
        )
        if not C:
            raise SystemExit(EXIT_FAILED)  # nothing to show for it: never a clean exit

    # -- a trial's command line -------------------------------------------------------------
    def command(self) -> list[str]:
        """The program that started the sweep, as a single run: python -m dtf, with the same config."""
        cmd = [sys.executable, "-m", "dtf"]
        job = self.config.hydra.job
        if job.get("config_name") not in (None, "config"):
            cmd.append(f"--config-name={job.config_name}")
        for source in self.config.hydra.runtime.get("config_sources", []):
            if source.get("provider") == "command-line":
                cmd.append(f"--config-dir={source.path.removeprefix('file://')}")
        return cmd

    def trial_env(self) -> dict[str, str]:
        """Local trials side by side share this machine's cores: each rank gets its share of
        threads (a rank alone takes what one of two would; `parallel` trials of `launcher.nproc` ranks each,
        all busy-waiting in their thread pools, would slow each other down many times over).
        An OMP_NUM_THREADS of the user's own is kept."""
        env = dict(os.environ)
        launcher = self.config.get("launcher", {})
        if "OMP_NUM_THREADS" not in env and launcher.get("name") == "local":
            ranks = self.s.parallel * int(launcher.get("nproc", 1))
            env["OMP_NUM_THREADS"] = str(threads_per_rank(ranks))
        return env

    def passthrough(self) -> list[str]:
        """The sweep's own hydra.* overrides that also shape a single run (e.g. hydra.searchpath)."""
        hydra_overrides = self.config.hydra.overrides.get("hydra", [])
        return [o for o in hydra_overrides if not str(o).lstrip("+~").startswith(SWEEP_ONLY)]

    def trial_overrides(self, trial: optuna.trial.FrozenTrial) -> list[str]:
        options = ",".join(f"{k}:{_show(v)}" for k, v in self.s.pruner_options.items())
        return [
            f"+trial.study={self.s.study_name}",
            f"+trial.storage='{self.storage}'",
            f"+trial.id={trial._trial_id}",  # Optuna's id in the storage (a trial's number is per study)
            f"+trial.number={trial.number}",
            f"+trial.pruner={self.s.pruner}",
            f"+trial.pruner_options={{{options}}}",
        ]

    # -- stopping ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def forwarding_stop_signals(self) -> Iterator[None]:
        """SIGTERM, SIGUSR1 or Ctrl-C on the sweep: its running trials stop at a checkpoint (they
        get SIGTERM, a stop signal of every dtf run), and the sweep waits for them."""

        def stop(signum: int, frame: FrameType | None) -> None:
            if self.stop_signal is None:
                self.stop_signal = signal.Signals(signum).name
                for r in self.running:
                    with contextlib.suppress(ProcessLookupError):
                        r.process.send_signal(signal.SIGTERM)

        handled = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
        previous = {s: signal.signal(s, stop) for s in handled}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _end_with_parent() -> None:
    """In the trial's process: SIGTERM when the sweep's process dies, even by SIGKILL, so a trial
    never trains on as an orphan that a continued sweep would start a second time."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    # Ctrl-C in the terminal reaches the sweep, which stops its trials in order (SIGTERM).
    os.setpgrp()


def _show(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
