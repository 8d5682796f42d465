"""hydra/sweeper=dtf as a user runs it: trials side by side with the median rule pruning the poor
ones, a report, and a killed sweep that continues without training its finished trials again."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.helpers.run_command import TEST_DEFAULTS, dtf_command, run_dtf, start_command

SMALL = ["data.dataset.num_points=2000", "data.dataset.num_test=400", "launcher.nproc=1"]
# seeded: the same points every time (TPE's seed, as Hydra's Optuna sweeper has it, is null by default)
SEARCH = ["hydra/sweeper=dtf", "hydra.sweeper.sampler.seed=0", "optimizer.lr=tag(log,interval(1e-6,1e-1))"]


def trials(sweep_dir: Path) -> dict[int, dict[str, Any]]:
    found = {}
    for record in sweep_dir.glob("*/trial.json"):
        with open(record) as f:
            found[int(record.parent.name)] = json.load(f)
    return found


def most_at_once(records: list[dict[str, Any]]) -> int:
    events = sorted([(r["started"], 1) for r in records] + [(r["ended"], -1) for r in records])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


@pytest.mark.slow
def test_two_trials_at_a_time_and_the_median_rule_prunes_the_poor_ones(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    run = run_dtf(
        [
            *SEARCH,
            *SMALL,
            "data.val_fraction=0.2",  # the search chooses on the validation split (trainer.objective=auto)
            "trainer.max_epochs=4",
            "hydra.sweeper.n_trials=8",
            "hydra.sweeper.parallel=2",
            "hydra.sweeper.pruner=median",
            "+hydra.sweeper.pruner_options={n_startup_trials:2}",
        ],
        sweep_dir,
        multirun=True,
        timeout=600,
    )
    records = trials(sweep_dir)
    assert sorted(records) == list(range(8))
    states = {n: r["state"] for n, r in records.items()}
    pruned = [n for n, state in states.items() if state == "pruned"]
    completed = [n for n, state in states.items() if state == "complete"]
    others = {n: records[n] for n, state in states.items() if state not in ("pruned", "complete")}
    assert not others, f"trials neither pruned nor completed: {others}\n" + "\n".join(
        f"--- trial {n}'s log:\n{(sweep_dir / str(n) / 'trial.log').read_text()[-4000:]}" for n in others
    )
    assert len(pruned) >= 2 and len(pruned) + len(completed) == 8, states
    # Side by side, never more than asked: a new trial starts as soon as one ends.
    assert most_at_once(list(records.values())) == 2
    for n in pruned:  # stopped early, with its checkpoint and a summary that says so
        summary = json.loads((sweep_dir / str(n) / "summary.json").read_text())
        assert summary["pruned"] is True and summary["epochs"] < 4
        assert list((sweep_dir / str(n) / "checkpoints").glob("step_*"))
    for n in completed:
        summary = json.loads((sweep_dir / str(n) / "summary.json").read_text())
        assert summary["pruned"] is False and summary["epochs"] == 4
        assert records[n]["value"] == summary["objective"]
    best = min(completed, key=lambda n: records[n]["value"])
    summaries = {n: json.loads((sweep_dir / str(n) / "summary.json").read_text()) for n in completed}
    assert all(s["objective_name"] == "val/loss" and s["objective"] == s["final_val_loss"] for s in summaries.values())
    test_loss = summaries[best]["final_test_loss"]
    assert f"best trial {best}: val/loss {records[best]['value']:.6g}" in run.stdout
    assert f"its test score: test/loss {test_loss:.6g}" in run.stdout
    chosen = json.loads((sweep_dir / "best.json").read_text())
    assert chosen["number"] == best and chosen["test"]["test/loss"] == test_loss
    # The report: a table of every trial, and plots that open as images; the test score of the best only.
    report = (sweep_dir / "report.md").read_text()
    assert "pruned" in report
    assert "Its test score (evaluated once at its end" in report
    assert all(f"{s['final_test_loss']:.6g}" not in report for n, s in summaries.items() if n != best)
    pngs = list(sweep_dir.glob("*.png"))
    assert {"curves.png", "objective_vs_optimizer.lr.png"} <= {p.name for p in pngs}, pngs
    for png in pngs:
        with Image.open(png) as image:
            image.verify()


def sweep_processes(sweep_dir: Path) -> list[int]:
    """PIDs of processes (the sweep's trials and their ranks) whose command line names sweep_dir."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(sweep_dir).encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


@pytest.mark.slow
def test_a_killed_sweep_continues_without_training_its_finished_trials_again(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    args = [
        *SEARCH,
        *SMALL,
        "launcher.nproc=2",  # the ranks of a continued trial resume together
        "trainer.max_epochs=3",
        "checkpoint.every_n_steps=5",
        "hydra.sweeper.n_trials=3",
    ]
    cmd = dtf_command("-m", *TEST_DEFAULTS, *args, f"hydra.sweep.dir={sweep_dir}")
    try:
        with start_command(cmd, tmp_path / "sweep.log", cwd=tmp_path) as sweep:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:  # trial 0 done, trial 1 past its first checkpoint
                records = trials(sweep_dir)
                # (committed: a step_* folder is there from the save's start, its marker comes last)
                if records.get(0, {}).get("state") == "complete" and list(
                    (sweep_dir / "1" / "checkpoints").glob("step_*/COMMITTED.json")
                ):
                    break
                assert sweep.poll() is None, "the sweep ended before it could be killed"
                time.sleep(0.2)
            else:
                pytest.fail("trial 1 never reached a checkpoint")
            finished_at = (sweep_dir / "0" / "summary.json").stat().st_mtime_ns
            sweep.send_signal(signal.SIGKILL)  # no chance to clean up: its trials are orphans now
            sweep.wait()
            deadline = time.monotonic() + 120
            while sweep_processes(sweep_dir) and time.monotonic() < deadline:
                time.sleep(0.2)  # the orphaned trial got SIGTERM (its parent died) and stops at a checkpoint
            assert not sweep_processes(sweep_dir), "a trial outlived its sweep"
    finally:
        for pid in sweep_processes(sweep_dir):
            os.kill(pid, signal.SIGKILL)
    assert trials(sweep_dir)[1]["state"] == "running"  # the study never heard of its end

    again = run_dtf(args, sweep_dir, multirun=True, timeout=400)
    assert "continuing the sweep" in again.stdout and "1 trial(s) finished, 1 to continue" in again.stdout
    assert "dtf: trial 0" not in again.stdout  # finished: not trained again
    assert (sweep_dir / "0" / "summary.json").stat().st_mtime_ns == finished_at
    records = trials(sweep_dir)
    assert sorted(records) == [0, 1, 2] and {r["state"] for r in records.values()} == {"complete"}
    resumed = json.loads((sweep_dir / "1" / "summary.json").read_text())
    assert resumed["resumed_from_step"] is not None and resumed["steps_per_rank"] == [resumed["global_step"]] * 2
    assert records[1]["resumed"] is True


@pytest.mark.slow
def test_a_failed_trial_is_failed_a_stopped_one_waits_for_the_next_run_and_the_sweep_goes_on(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    run = run_dtf(
        [
            "hydra/sweeper=dtf",
            "hydra.sweeper.n_trials=4",
            "hydra.sweeper.parallel=2",
            "hydra/sweeper/sampler=random",
            "hydra.sweeper.sampler.seed=5",  # gives: stopped, failed, completed, completed
            # rank fail_rank raises, or sends itself a stop signal, at its 3rd forward (-1: no rank does)
            "model._target_=user_models.FailingModel",
            "+model.fail_rank=choice(-1,0)",
            "+model.how=choice(raise,SIGUSR1)",
            "checkpoint.stop_check_every_n_steps=1",  # the stop lands within this short trial
            *SMALL,
            "trainer.max_epochs=1",
        ],
        sweep_dir,
        multirun=True,
    )
    records = trials(sweep_dir)
    expected = {(-1, "raise"): "complete", (-1, "SIGUSR1"): "complete", (0, "raise"): "fail", (0, "SIGUSR1"): "stopped"}
    kinds = {n: (r["params"]["+model.fail_rank"], r["params"]["+model.how"]) for n, r in records.items()}
    assert {n: r["state"] for n, r in records.items()} == {n: expected[k] for n, k in kinds.items()}
    assert set(expected[k] for k in kinds.values()) == {"complete", "fail", "stopped"}, kinds
    (failed,) = [n for n, k in kinds.items() if k == (0, "raise")]
    # the reason in the sweep's own line, not only in the trial's log
    (line,) = [x for x in run.stdout.splitlines() if x.startswith(f"dtf: trial {failed} failed")]
    assert line.startswith(f"dtf: trial {failed} failed (exit status 1: rank 0 failed: RuntimeError: injected failure")
    assert f"; see {sweep_dir / str(failed) / 'trial.log'})" in line, line
    assert "RuntimeError: injected failure" in (sweep_dir / str(failed) / "trial.log").read_text()
    (stopped,) = [n for n, k in kinds.items() if k == (0, "SIGUSR1")]
    assert f"dtf: trial {stopped} stopped at a checkpoint" in run.stdout
    assert "2 completed, 0 pruned, 1 failed, 1 stopped (the same command continues them)" in run.stdout


# lightning-hydra-template's configs/hparams_search/mnist_optuna.yaml as a user ports it to dtf: its
# sweeper (dtf's for Hydra's Optuna sweeper), its metric and search space (dtf's keys), and its
# `hydra: mode: "MULTIRUN"` line kept, so that `python -m dtf hparams_search=...` sweeps without -m;
# each trial on 2 ranks, as LHT's test_optuna_sweep_ddp_sim has it (its test_optuna_sweep on one is
# this file's other sweeps).
LHT_SEARCH = """\
# @package _global_

# example hyperparameter optimization of some experiment with Optuna:
# python -m dtf +hparams_search=mnist_optuna

defaults:
  - override /hydra/sweeper: dtf

trainer:
  objective: test/loss

hydra:
  mode: "MULTIRUN" # set hydra to multirun by default if this config is attached

  sweeper:
    direction: minimize
    n_trials: 2
    sampler:
      seed: 1234
      n_startup_trials: 10 # number of random sampling runs before optimization starts
    params:
      optimizer.lr: interval(0.0001, 0.1)
"""


def test_lightning_hydra_templates_hparams_search_with_its_multirun_mode_runs_each_trial_once(tmp_path: Path) -> None:
    conf = tmp_path / "conf" / "hparams_search"
    conf.mkdir(parents=True)
    (conf / "mnist_optuna.yaml").write_text(LHT_SEARCH)
    sweep_dir = tmp_path / "sweep"
    run = run_dtf(  # no -m: the config's hydra.mode makes it a sweep
        [
            *SMALL,
            "launcher.nproc=2",
            "trainer.max_steps=3",
            "+hparams_search=mnist_optuna",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        tmp_path / "not_a_run",
        options=[f"--config-dir={tmp_path / 'conf'}"],
    )
    assert "2 trial(s), 2 completed, 0 pruned, 0 failed" in run.stdout, run.stdout[-3000:]
    found = trials(sweep_dir)
    assert sorted(found) == [0, 1] and all(t["state"] == "complete" for t in found.values())
    for number in found:  # each a single run in its own directory, not a sweep of its own
        summary = json.loads((sweep_dir / str(number) / "summary.json").read_text())
        assert summary["global_step"] == 3 and summary["world_size"] == 2
