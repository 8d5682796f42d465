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
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import optuna
from omegaconf import DictConfig, ListConfig, OmegaConf

from dtf.errors import UserError
from dtf.files import write_json
from dtf.helper_process import end_with_parent
from dtf.machine import threads_per_rank
from dtf.results import EXIT_FAILED, EXIT_STOPPED, EXIT_USER_ERROR
from dtf.sweep.settings import SweeperSettings
from dtf.sweep.space import SearchSpace, key_of, search_space
from dtf.sweep.study import build_pruner, build_sampler, is_grid, open_storage, storage_spec

RESULTS_FILE = "optimization_results.yaml"  # as hydra-optuna-sweeper writes it: name, best_params, best_value
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
        if "objective" not in (config.get("trainer") or {}):
            raise UserError(
                "hydra/sweeper=dtf runs every trial as a dtf run (python -m dtf with this config), and this "
                "application's config is not dtf's (it has no trainer.objective): sweep it with Hydra's Optuna "
                "sweeper (hydra/sweeper=optuna), or make it a dtf run (docs/sweeps-and-hpo.md)"
            )
        merged = OmegaConf.merge(OmegaConf.structured(SweeperSettings), settings)
        missing = OmegaConf.is_missing(merged, "sampler") or merged.sampler is None
        sampler = {"_target_": "optuna.samplers.TPESampler"} if missing else merged.sampler
        if isinstance(sampler, DictConfig):
            sampler = OmegaConf.to_container(sampler)
        if not isinstance(sampler, dict):
            raise UserError(
                f"hydra.sweeper.sampler={merged.sampler}: choose a sampler with hydra/sweeper/sampler=tpe (or random, "
                "grid, cmaes, nsgaii, qmc, gp) and set its options as hydra.sweeper.sampler.seed=..."
            )
        self.sampler_config: dict[str, Any] = {str(k): v for k, v in sampler.items()}
        merged.sampler = None
        s = OmegaConf.to_object(merged)
        assert isinstance(s, SweeperSettings)
        self.s = s
        self.parallel = self.trials_at_once(s)
        if s.n_trials < 1:
            raise UserError(f"hydra.sweeper.n_trials={s.n_trials}: must be >= 1")
        if s.max_failure_rate is not None and not 0 <= s.max_failure_rate <= 1:
            raise UserError(f"hydra.sweeper.max_failure_rate={s.max_failure_rate}: give a fraction in [0, 1]")
        self.pruner = build_pruner(s.pruner, s.pruner_options)  # a bad name or option: one line, before anything runs
        self.config = config
        self.dir = Path(config.hydra.sweep.dir).resolve()
        legacy = s.search_space if s.params is None else None
        if s.search_space is not None:
            use = "hydra.sweeper.params is used, search_space ignored" if s.params is not None else "use params"
            print(f"dtf: warning: hydra.sweeper.search_space is deprecated ({use})", file=sys.stderr, flush=True)
        self.space: SearchSpace = search_space(dict(s.params or {}), list(arguments), legacy)
        if not self.space.distributions and s.custom_search_space is None:
            raise UserError(
                "hydra/sweeper=dtf has nothing to search: give hydra.sweeper.params (or sweep overrides such as "
                "'optimizer.lr=tag(log,interval(1e-4,1e-1))')"
            )
        self.custom = _function(s.custom_search_space) if s.custom_search_space else None
        self.storage = storage_spec(s.storage, self.dir)
        self.study_name = s.study_name or "dtf"
        self.objectives, self.directions = objectives_and_directions(config.trainer, s.direction)
        if len(self.objectives) > 1 and s.pruner != "none":
            raise UserError(
                f"hydra.sweeper.pruner={s.pruner}: Optuna prunes studies of one objective only, and "
                f"trainer.objective names {len(self.objectives)}: set hydra.sweeper.pruner=none"
            )
        self.objective = self.objectives[0]
        self.n_trials = s.n_trials
        if is_grid(self.sampler_config):
            size = math.prod(len(values) for values in self.space.grid().values())
            if size < self.n_trials:
                print(f"dtf: the grid has {size} point(s): n_trials is {size}, not {self.n_trials}", flush=True)
            self.n_trials = min(self.n_trials, size)
        self.running: list[Running] = []
        self.stopped: list[int] = []  # trials a stop signal of their own stopped (continued by the next run)
        self.stop_signal: str | None = None
        self.failed_out: str | None = None  # why max_failure_rate stopped the sweep

    @staticmethod
    def trials_at_once(s: SweeperSettings) -> int:
        """parallel, or n_jobs (hydra-optuna-sweeper's name for it); 1 if neither is given."""
        if s.parallel is not None and s.n_jobs is not None and s.parallel != s.n_jobs:
            raise UserError(
                f"hydra.sweeper.n_jobs={s.n_jobs} and hydra.sweeper.parallel={s.parallel} are one setting (trials "
                "at once) under two names: give one"
            )
        at_once = s.parallel if s.parallel is not None else s.n_jobs if s.n_jobs is not None else 1
        if at_once < 1:
            raise UserError(f"hydra.sweeper.parallel={at_once}: must be >= 1")
        return at_once

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
                while self.stop_signal is None and self.failed_out is None and len(self.running) < self.parallel:
                    if to_resume:
                        self.start(study, to_resume.pop(0), resumed=True)
                    elif started < self.n_trials:
                        self.start(study, self.ask(study), resumed=False)
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
        if self.failed_out is not None:
            print(f"dtf: error: {self.failed_out}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_FAILED)
        self.conclude(study)

    def open_study(self) -> optuna.Study:
        storage = open_storage(self.storage)
        existing = {summary.study_name: summary for summary in optuna.get_all_study_summaries(storage)}
        seed = self.sampler_config.get("seed")
        if self.study_name in existing:
            old = existing[self.study_name]
            made = [d.name.lower() for d in old.directions]
            if made != self.directions:
                raise UserError(
                    f"hydra.sweeper.study_name={self.study_name} in {self.storage} was made to "
                    f"{' and '.join(made)}, this sweep would {' and '.join(self.directions)} "
                    "(hydra.sweeper.direction, trainer.objective_mode): use another study_name or hydra.sweep.dir"
                )
            # The sampler starts where the interrupted sweep's left off, not at its first suggestions again.
            seed = None if seed is None else int(seed) + old.n_trials
        return optuna.create_study(
            study_name=self.study_name,
            storage=storage,
            sampler=build_sampler(self.sampler_config, seed, self.space.grid),
            pruner=self.pruner,
            directions=[optuna.study.StudyDirection[d.upper()] for d in self.directions],
            load_if_exists=True,
        )

    def ask(self, study: optuna.Study) -> optuna.Trial:
        """A new trial: the search space's values, then hydra.sweeper.custom_search_space's."""
        trial = study.ask(self.space.distributions)
        if self.custom is not None:
            self.custom(self.config, trial)
            fixed = {key_of(line) for line in self.space.fixed}
            if overlap := sorted(fixed & set(trial.params)):
                raise UserError(
                    f"hydra.sweeper.custom_search_space={self.s.custom_search_space} suggests {', '.join(overlap)}, "
                    "which the sweep fixes: search it or fix it, not both"
                )
        return trial

    def start(self, study: optuna.Study, trial: optuna.Trial | optuna.trial.FrozenTrial, resumed: bool) -> None:
        # Optuna gives a fresh trial's sampled params and id only on the Trial; its frozen record
        # (what a continued trial also is) is read from the storage by that id.
        frozen = trial if isinstance(trial, optuna.trial.FrozenTrial) else study._storage.get_trial(trial._trial_id)
        trial_dir = self.dir / str(frozen.number)
        trial_dir.mkdir(parents=True, exist_ok=True)
        overrides = self.space.overrides(frozen.params)
        if len(self.objectives) > 1:  # the run is judged by the first; the sweep reads the others from its summary
            overrides = [o for o in overrides if key_of(o) != "trainer.objective"]
            overrides.append(f"trainer.objective={self.objectives[0]}")
        cmd = [*self.command(), *overrides, *self.passthrough(), f"hydra.run.dir={trial_dir}"]
        # A single run, whatever the config says: lightning-hydra-template's hparams_search files set
        # hydra.mode: MULTIRUN (to sweep without -m), which would make every trial a sweep again.
        cmd += ["hydra.mode=RUN", *self.trial_overrides(frozen)]
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
        if summary and summary.get("objective_name") and len(self.objectives) == 1:
            self.objective = str(summary["objective_name"])  # trainer.objective resolved (auto: val/loss, ...)
        code = r.process.returncode
        values = objective_values(summary, self.objectives) if summary and code == 0 else None
        value = values[0] if values else None
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
            _tell(study, r.trial.number, state=state)
        elif values is not None and all(v is not None and math.isfinite(v) for v in values):
            state = optuna.trial.TrialState.COMPLETE
            names = [self.objective, *self.objectives[1:]]
            text = ", ".join(f"{name} {v:.6g}" for name, v in zip(names, values, strict=True))
            _tell(study, r.trial.number, values=values)
        else:
            why = f"exit status {code}" if code != 0 else f"no finite {', '.join(self.objectives)}"
            error = _last_error(trial_dir / LOG_FILE) if code != 0 else None  # the reason, not only where it is
            why += f": {error.removeprefix('dtf: error: ')}" if error else ""
            state, text = optuna.trial.TrialState.FAIL, f"failed ({why}; see {trial_dir / LOG_FILE})"
            _tell(study, r.trial.number, state=state)
        record_value = values if len(self.objectives) > 1 else value
        r.record.update(state=state.name.lower(), value=record_value, epochs=summary.get("epochs") if summary else None)
        write_json(trial_dir / TRIAL_FILE, r.record)
        print(f"dtf: trial {r.trial.number} {text} ({len(self.running)} running)", flush=True)
        if state == optuna.trial.TrialState.FAIL:
            self.check_failure_rate(study, r.trial.number)

    def check_failure_rate(self, study: optuna.Study, number: int) -> None:
        """hydra.sweeper.max_failure_rate: more failed trials than that fraction of the finished ones
        stops the sweep (no new trial starts; those running finish)."""
        limit = self.s.max_failure_rate
        finished = study.get_trials(deepcopy=False, states=FINISHED)
        failed = sum(t.state == optuna.trial.TrialState.FAIL for t in finished)
        if limit is None or failed / len(finished) <= limit or self.failed_out is not None:
            return
        log = self.dir / str(number) / LOG_FILE
        self.failed_out = (
            f"{failed} of {len(finished)} finished trial(s) failed, more than hydra.sweeper.max_failure_rate={limit}: "
            f"the sweep stops; trial {number}: {_last_error(log) or 'see its log'} ({log})"
        )

    def conclude(self, study: optuna.Study) -> None:
        trials = study.get_trials(deepcopy=False)
        counts = {s: sum(t.state == s for t in trials) for s in FINISHED}
        C, P, F = (counts[s] for s in FINISHED)
        best_line = "no trial completed"
        if C and len(self.objectives) == 1:
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
            results: dict[str, Any] = {"name": "optuna", "best_params": best.params, "best_value": best.value}
            OmegaConf.save(OmegaConf.create(results), self.dir / RESULTS_FILE)
        elif C:
            front = study.best_trials
            best_line = f"{len(front)} Pareto-optimal trial(s) ({', '.join(map(str, self.objectives))}): " + "; ".join(
                f"{t.number}: {', '.join(f'{v:.6g}' for v in t.values)}" for t in front
            )
            solutions = [{"number": t.number, "values": t.values, "params": t.params} for t in front]
            write_json(self.dir / "best.json", {"objectives": self.objectives, "solutions": solutions})
            results = {"name": "optuna", "solutions": [{"params": t.params, "values": t.values} for t in front]}
            OmegaConf.save(OmegaConf.create(results), self.dir / RESULTS_FILE)
        stopped = f", {len(self.stopped)} stopped (the same command continues them)" if self.stopped else ""
        print(
            f"dtf: sweep done: {len(trials)} trial(s), {C} completed, {P} pruned, {F} failed{stopped}; "
            f"{best_line}; study {self.study_name} in {self.storage}",
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
            ranks = self.parallel * int(launcher.get("nproc", 1))
            env["OMP_NUM_THREADS"] = str(threads_per_rank(ranks))
        return env

    def passthrough(self) -> list[str]:
        """The sweep's own hydra.* overrides that also shape a single run (e.g. hydra.searchpath)."""
        hydra_overrides = self.config.hydra.overrides.get("hydra", [])
        return [o for o in hydra_overrides if not str(o).lstrip("+~").startswith(SWEEP_ONLY)]

    def trial_overrides(self, trial: optuna.trial.FrozenTrial) -> list[str]:
        options = ",".join(f"{k}:{_show(v)}" for k, v in self.s.pruner_options.items())
        return [
            f"+trial.study={self.study_name}",
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
    end_with_parent(signal.SIGTERM)
    # Ctrl-C in the terminal reaches the sweep, which stops its trials in order (SIGTERM).
    os.setpgrp()


def objectives_and_directions(trainer: Any, direction: Any) -> tuple[list[str], list[str]]:
    """trainer.objective as a list of names and hydra.sweeper.direction as a list of Optuna's
    directions, as long as each other; the first direction is trainer.objective_mode's."""
    objective = trainer.objective
    names = [str(o) for o in objective] if isinstance(objective, ListConfig | list | tuple) else [str(objective)]
    mode = str(getattr(trainer.objective_mode, "value", trainer.objective_mode)).lower()
    by_mode = "maximize" if mode == "max" else "minimize"
    if direction is None:
        directions = [by_mode] * len(names) if len(names) == 1 else []
        if not directions:
            raise UserError(
                f"trainer.objective={names} names {len(names)} objectives: give hydra.sweeper.direction as a list of "
                f"{len(names)} (minimize or maximize each)"
            )
    elif isinstance(direction, ListConfig | list | tuple):
        directions = [str(getattr(d, "name", d)).lower() for d in direction]
    else:
        directions = [str(getattr(direction, "name", direction)).lower()]
    if len(names) > 1 and (bad := [n for n in names if n.partition("/")[0] not in ("val", "test", "train")]):
        raise UserError(
            f"trainer.objective={names}: {bad[0]} is not <split>/<name> (e.g. val/loss, val/accuracy); a list names "
            "each objective"
        )
    if bad := [d for d in directions if d not in ("minimize", "maximize")]:
        raise UserError(f"hydra.sweeper.direction={bad[0]}: use minimize or maximize (or a list of them)")
    if len(directions) != len(names):
        shown = directions if len(directions) > 1 else directions[0]
        raise UserError(
            f"hydra.sweeper.direction={shown} has {len(directions)} objective(s) but trainer.objective={names} names "
            f"{len(names)}: give trainer.objective a list of {len(directions)} metric names (e.g. [val/loss, val/rmse])"
        )
    if directions[0] != by_mode:
        raise UserError(
            f"hydra.sweeper.direction={directions[0]} but trainer.objective_mode={mode} for {names[0]}: set "
            f"trainer.objective_mode={'max' if directions[0] == 'maximize' else 'min'} (or the direction to match)"
        )
    return names, directions


def objective_values(summary: dict[str, Any], names: list[str]) -> list[float | None]:
    """A finished trial's values of trainer.objective's names: the first is the run's objective,
    the others its final metrics (or, for trainer=function, what the function returned)."""
    values: list[float | None] = [summary.get("objective")]
    finals = dict(summary.get("final_metrics") or {})
    returned = summary.get("result")
    if isinstance(returned, dict):
        finals.update({k: v for k, v in returned.items() if k not in finals})
    for name in names[1:]:
        short = name.partition("/")[2]
        if name not in finals and short not in finals:
            raise UserError(
                f"trainer.objective: {name} is not among the trial's final values ({', '.join(sorted(finals))}): "
                "name one of them"
            )
        values.append(finals.get(name, finals.get(short)))
    return values


def _tell(study: optuna.Study, number: int, **kw: Any) -> None:
    try:
        study.tell(number, **kw)
    except RuntimeError as e:
        # GridSampler stops the study when its grid is done, which Optuna allows only inside optimize();
        # the trial is told all the same (hydra-optuna-sweeper does the same).
        if "Study.stop" not in str(e):
            raise


def _function(path: str) -> Callable[[DictConfig, optuna.Trial], None]:
    from hydra.utils import get_method

    try:
        return get_method(path)
    except Exception as e:  # any import failure of the user's module is theirs to fix
        cause = " ".join(str(e.__cause__ or e).split())
        raise UserError(
            f"hydra.sweeper.custom_search_space={path}: {cause}; give module.function, called as fn(cfg, trial)"
        ) from None


def _last_error(log: Path) -> str | None:
    """The last `dtf: error:` line (or exception line) of a trial's log."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("dtf: error:") or ("Error: " in line and not line.startswith(" ")):
            return line.strip()
    return None


def _show(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
