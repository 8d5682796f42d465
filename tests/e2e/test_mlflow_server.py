"""logger=mlflow against a real tracking server (scripts/local-mlflow.sh: `mlflow server` with a
SQLite store and served artifacts on 127.0.0.1), read back through MLflow's own client only: the
run is found, its params are the resolved config, its metric history is TensorBoard's scalars step
for step, a killed-and-resumed run is one run, and a server that dies mid-run costs no training.
Runs are in process (train_in_process) but one: `python -m dtf` on the default job."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from tests.helpers.clusters import run_script, script_cluster
from tests.helpers.inprocess import compose_config, train_in_process
from tests.helpers.run_command import run_dtf
from tests.helpers.tracking import as_float32, flattened, training_scalars

RUN = [
    "data.dataset.num_points=400",
    "data.dataset.num_test=64",
    "trainer.log_every_n_steps=1",
    "trainer.eval_every_n_steps=3",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The project's tracking server for this module (its own store), as MLFLOW_TRACKING_URI."""
    env = {"DTF_MLFLOW_DIR": str(tmp_path_factory.mktemp("mlflow-server"))}
    with script_cluster("local-mlflow.sh", "MLFLOW_TRACKING_URI", env) as uri, pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        yield {**env, "MLFLOW_TRACKING_URI": uri}


def runs_of(run_dir: Path) -> list[Any]:
    """The MLflow runs that logged this run dir (mlflow.search_runs, over every experiment)."""
    import mlflow

    found = mlflow.search_runs(
        search_all_experiments=True, filter_string=f"tags.`dtf.run_dir` = '{run_dir.resolve()}'", output_format="list"
    )
    return list(found)


def assert_history_is_tensorboards(run: Any, run_dir: Path, client: Any = None) -> None:
    from mlflow.tracking import MlflowClient

    client = client or MlflowClient()
    scalars = training_scalars(run_dir)
    assert {"train/loss_rank0", "train/lr", "train/samples_per_sec", "test/loss"} <= set(scalars)
    for tag, by_step in scalars.items():
        history = client.get_metric_history(run.info.run_id, tag)
        assert len(history) == len(by_step), tag  # once per step: nothing logged twice
        assert as_float32({m.step: m.value for m in history}) == by_step, tag


def test_a_run_is_read_back_by_mlflows_client(server: dict[str, str], tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    overrides = [*RUN, "trainer.max_steps=6", "logger=[tensorboard,mlflow,csv]", "+logger.mlflow.tags.team=ml"]
    train_in_process(overrides, tmp_path)
    [run] = runs_of(tmp_path)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert run.data.params == flattened(compose_config(overrides))
    tags = run.data.tags
    assert (tags["dtf.strategy"], tags["dtf.world_size"], tags["dtf.launcher"], tags["team"]) == (
        "ddp",
        "1",
        "local",
        "ml",
    )
    assert_history_is_tensorboards(run, tmp_path)
    client = MlflowClient()
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"summary.json", "model.pt"}
    (tmp_path / "dl").mkdir()  # MLflow 2.x downloads only into a directory that exists
    summary = json.loads(
        Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path / "dl"))).read_text()
    )
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert run.data.metrics["hparam/objective"] == summary["objective"]


def test_a_killed_and_resumed_run_is_one_mlflow_run(
    server: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = [*RUN, "trainer.max_steps=4", "logger=[tensorboard,mlflow]", "checkpoint.every_n_steps=2"]
    train_in_process(first, tmp_path)
    [before] = runs_of(tmp_path)
    summary = train_in_process([*first[:-2], "trainer.max_steps=8", *first[-2:]], tmp_path)
    assert summary["resumed_from_step"] == 4 and summary["global_step"] == 8
    [run] = runs_of(tmp_path)
    assert run.info.run_id == before.info.run_id and run.info.status == "FINISHED"
    assert_history_is_tensorboards(run, tmp_path)
    assert sorted(m for m in training_scalars(tmp_path)["train/loss_rank0"]) == list(range(1, 9))
    assert run.data.params["trainer.max_steps"] == "4"  # MLflow keeps a param's first value, and dtf says so
    assert "this resumed run has trainer.max_steps=8" in capsys.readouterr().out


def test_a_sqlite_uri_needs_no_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """logger.mlflow.tracking_uri=sqlite:///... (MLflow keeps the artifacts in ./mlruns beside it)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train_in_process(
        [*RUN, "trainer.max_steps=3", "logger=[tensorboard,mlflow]", f"logger.mlflow.tracking_uri={uri}"],
        tmp_path / "run",
    )
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("dtf").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["dtf.run_dir"] == str((tmp_path / "run").resolve())
    assert_history_is_tensorboards(run, tmp_path / "run", client)


def test_the_default_job_through_the_command_line(server: dict[str, str], tmp_path: Path) -> None:
    """python -m dtf logger=[tensorboard,mlflow,csv] on the default job (2 ranks): rank 0 logs it all."""
    args = ["logger=[tensorboard,mlflow,csv]", "trainer.max_steps=6", "trainer.log_every_n_steps=2"]
    done = run_dtf([*args, "data.dataset.num_points=2000", "data.dataset.num_test=200"], tmp_path / "run")
    [run] = runs_of(done.run_dir)
    job = OmegaConf.load(done.run_dir / ".hydra" / "config.yaml")  # what `--cfg job` prints
    assert run.data.params == flattened(job)
    assert run.data.tags["dtf.world_size"] == "2"
    assert_history_is_tensorboards(run, done.run_dir)
    assert done.stdout.count("MLflow run ") == 1  # one rank logs


def sweep_runs(sweep_dir: Path) -> tuple[Any, list[Any]]:
    """The sweep's parent run (tagged with its sweep dir) and its children, by MLflow's parent tag."""
    import mlflow

    [parent] = mlflow.search_runs(
        search_all_experiments=True,
        filter_string=f"tags.`dtf.sweep_dir` = '{sweep_dir.resolve()}'",
        output_format="list",
    )
    children = mlflow.search_runs(
        search_all_experiments=True,
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
        output_format="list",
    )
    return parent, list(children)


SWEEP = ["launcher.nproc=1", "data.dataset.num_points=400", "data.dataset.num_test=64", "trainer.max_steps=4"]


# Hydra's basic sweeper takes the Optuna sweeper's path (a Hydra multirun, its points in the sweep's
# process): the two below cover both ways a trial finds its parent.
@pytest.mark.parametrize("sweeper", ["dtf", "optuna"])
def test_a_sweep_is_one_parent_run_with_a_child_per_trial_and_its_best_marked(
    server: dict[str, str], tmp_path: Path, sweeper: str
) -> None:
    """hydra/sweeper=dtf (trials as processes of their own, two at once) and Hydra's own Optuna
    sweeper (a Hydra multirun, in its side venv, which sees the main venv's MLflow): one parent, a
    child per point, and the best child marked on the parent is the point whose summary.json has the
    lowest objective."""
    sweep_dir = tmp_path / "sweep"
    python: str | Path = sys.executable
    if sweeper == "optuna":
        from tests.helpers import side_venv

        python = side_venv.side_python("hydra-optuna")
        search = ["hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "optimizer.lr=interval(0.001,0.05)"]
    else:
        search = [
            "hydra/sweeper=dtf",
            "optimizer.lr=interval(0.001,0.05)",
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.parallel=2",
        ]
    run_dtf([*SWEEP, *search, "logger=[tensorboard,mlflow]"], sweep_dir, multirun=True, timeout=400, python=python)
    parent, children = sweep_runs(sweep_dir)
    points = {p.parent for p in sweep_dir.glob("*/summary.json")}
    assert len(points) == 2 and {Path(c.data.tags["dtf.run_dir"]) for c in children} == {p.resolve() for p in points}
    objectives = {p.resolve(): json.loads((p / "summary.json").read_text())["objective"] for p in points}
    best = min(objectives, key=lambda p: objectives[p])
    assert parent.info.status == "FINISHED" and parent.data.tags["dtf.best_run_dir"] == str(best)
    assert parent.data.metrics["best/objective"] == objectives[best]
    assert parent.data.tags["dtf.trials"] == "2" and parent.data.tags["dtf.trials_pruned"] == "0"
    for child in children:
        assert child.info.status == "FINISHED"
        assert_history_is_tensorboards(child, Path(child.data.tags["dtf.run_dir"]))
    if sweeper == "dtf":
        assert json.loads((sweep_dir / "best.json").read_text())["number"] == int(best.name)


def test_a_server_that_dies_mid_run_costs_no_training(
    server: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Last in this module: it stops the module's server. The run's MLflow calls are retried
    (logger.mlflow.max_retries), reported once, and training ends as it would have without MLflow."""
    from dtf.train.loggers import mlflow as mlflow_logger

    log_metrics = mlflow_logger.MlflowLogger._log_metrics

    def server_dies_at_step_3(self: Any, step: int, values: dict[str, float]) -> None:
        if step == 3:
            assert run_script("local-mlflow.sh", "stop", server).returncode == 0
        log_metrics(self, step, values)

    monkeypatch.setattr(mlflow_logger.MlflowLogger, "_log_metrics", server_dies_at_step_3)
    overrides = [*RUN, "trainer.max_steps=6"]
    tracked = train_in_process([*overrides, "logger=[tensorboard,mlflow]"], tmp_path / "tracked")
    out = capsys.readouterr().out
    untracked = train_in_process([*overrides, "logger=[]"], tmp_path / "untracked")
    assert out.count("dtf: warning: MLflow failed logging step 3") == 1 and out.count("MLflow failed") == 1
    assert tracked["params_sha256"] == untracked["params_sha256"]
    assert tracked["final_metrics"] == untracked["final_metrics"]
