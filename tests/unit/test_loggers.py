"""The logger group (logger=[tensorboard,csv,mlflow]): in process, against files and stores with
no server (MLflow's file store; tests/e2e/test_mlflow_server.py runs a real tracking server and
MLflow's SQLite store, whose first use makes its tables for seconds)."""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pandas as pd
import pytest

from dtf.errors import UserError
from tests.helpers.inprocess import compose_config, train_in_process
from tests.helpers.tracking import as_float32, flattened, training_scalars, wandb_history

# 6 steps of 32 samples; a train line every 2 steps, an evaluation every 3 (and at the end).
RUN = [
    "data.dataset.num_points=400",
    "data.dataset.num_test=64",
    "trainer.max_steps=6",
    "trainer.log_every_n_steps=2",
    "trainer.eval_every_n_steps=3",
]


@pytest.fixture(scope="module")
def csv_and_sqlite_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[str]]:
    """One run logging to TensorBoard, metrics.csv and an MLflow file store (no server)."""
    root = tmp_path_factory.mktemp("loggers")
    uri = (root / "mlruns").as_uri()  # a file store: no server, no database to make
    overrides = [*RUN, "logger=[tensorboard,csv,mlflow]", f"logger.mlflow.tracking_uri={uri}"]
    train_in_process(overrides, root / "run")
    return root / "run", uri, overrides


def test_metrics_csv_has_one_row_per_logged_step_with_tensorboards_values(csv_and_sqlite_run) -> None:  # type: ignore[no-untyped-def]
    run_dir, _, _ = csv_and_sqlite_run
    table = pd.read_csv(run_dir / "metrics.csv")
    assert table["step"].is_unique and table["step"].is_monotonic_increasing
    scalars = training_scalars(run_dir)
    assert set(table.columns) - {"step"} == set(scalars)
    assert set(table["step"]) == {s for by_step in scalars.values() for s in by_step}
    for tag, by_step in scalars.items():
        column = table.set_index("step")[tag].dropna()
        assert as_float32(column.to_dict()) == by_step, tag
    assert {"train/loss_rank0", "train/lr", "test/loss", "test/rmse", "train/epoch_loss"} <= set(scalars)


def test_an_mlflow_file_store_gets_the_config_and_tensorboards_scalars(csv_and_sqlite_run) -> None:  # type: ignore[no-untyped-def]
    from mlflow.tracking import MlflowClient

    run_dir, uri, overrides = csv_and_sqlite_run
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("dtf").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params == flattened(compose_config(overrides))
    assert run.data.tags["dtf.run_dir"] == str(run_dir.resolve())
    assert (run.data.tags["dtf.strategy"], run.data.tags["dtf.world_size"]) == ("ddp", "1")
    for tag, by_step in training_scalars(run_dir).items():
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
        assert as_float32(history) == by_step, tag
    summary = json.loads((run_dir / "summary.json").read_text())
    assert run.data.metrics["hparam/objective"] == summary["objective"]  # TensorBoard's hparams figure, at the end
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "model.pt"} <= artifacts


def test_logger_choices_compose_and_unknown_ones_are_refused() -> None:
    assert set(compose_config(["logger=[tensorboard,csv]"]).logger) == {"tensorboard", "csv"}
    assert compose_config(["logger=[]"]).get("logger") is None
    assert set(compose_config(["logger=many_loggers"]).logger) == {"tensorboard", "csv", "mlflow"}
    assert list(compose_config(["+logger=[csv]"]).logger) == ["tensorboard", "csv"]  # Hydra's +: added to the default
    with pytest.raises(UserError, match=r"logger.neptune is not one of dtf's loggers"):
        compose_config(["+logger.neptune.project=x"])
    with pytest.raises(UserError, match=r"logger.mlflow: Key 'uri' not in"):
        compose_config(["logger=[mlflow]", "+logger.mlflow.uri=x"])


def test_no_logger_writes_no_tensorboard(tmp_path: Path) -> None:
    train_in_process([*RUN, "trainer.max_steps=2", "logger=[]"], tmp_path)
    assert (tmp_path / "summary.json").exists() and not (tmp_path / "tensorboard").exists()


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError, match=r"logger=wandb needs the wandb package.*pip install 'dtf\[wandb\]'"):
        compose_config(["logger=[tensorboard,wandb]"])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def test_an_unreachable_tracking_server_refuses_the_run_before_it_starts() -> None:
    uri = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(UserError) as refused:
        compose_config(["logger=[mlflow]", f"logger.mlflow.tracking_uri={uri}"])
    line = str(refused.value)
    assert "\n" not in line and "cannot be reached" in line and "logger.mlflow.on_error=warn" in line


def test_with_on_error_warn_an_unreachable_server_trains_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = f"http://127.0.0.1:{_closed_port()}"
    summary = train_in_process(
        [*RUN, "logger=[tensorboard,mlflow]", f"logger.mlflow.tracking_uri={uri}", "logger.mlflow.on_error=warn"],
        tmp_path,
    )
    out = capsys.readouterr().out
    assert summary["global_step"] == 6
    assert "cannot be reached" in out and out.count("MLflow failed") == 1


def test_a_run_started_from_another_runs_checkpoint_gets_an_mlflow_run_of_its_own(
    csv_and_sqlite_run, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """checkpoint.resume=<path> of another run dir: that run's MLflow run is left as it is."""
    from mlflow.tracking import MlflowClient

    run_dir, uri, overrides = csv_and_sqlite_run
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    train_in_process([*overrides, "trainer.max_steps=8", f"checkpoint.resume={checkpoint}"], tmp_path)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("dtf").experiment_id])
    by_dir = {r.data.tags["dtf.run_dir"]: r for r in runs}
    assert set(by_dir) == {str(run_dir.resolve()), str(tmp_path.resolve())}
    assert (
        max(m.step for m in client.get_metric_history(by_dir[str(run_dir.resolve())].info.run_id, "train/loss_rank0"))
        == 6
    )


def test_a_pruned_trial_is_a_finished_run_tagged_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial its search prunes (here after its first epoch) ends FINISHED with dtf.pruned=true, which
    keeps it from being the sweep's best; an unpruned run carries no such tag."""
    from mlflow.tracking import MlflowClient

    from dtf.train import loop

    class PruneAtOnce:
        def should_prune(self, epoch: int, figures: object) -> bool:
            return True

    monkeypatch.setattr(loop, "trial_pruning", lambda run, objective, env: PruneAtOnce())
    uri = (tmp_path / "mlruns").as_uri()
    overrides = ["data.dataset.num_points=400", "data.dataset.num_test=64", "trainer.max_epochs=3"]
    summary = train_in_process([*overrides, "logger=[mlflow]", f"logger.mlflow.tracking_uri={uri}"], tmp_path / "run")
    assert summary["pruned"] is True and summary["epochs"] == 1
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("dtf").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["dtf.pruned"] == "true"


def test_a_sweeps_parent_marks_its_best_finished_unpruned_child(tmp_path: Path) -> None:
    """dtf.mlflow_sweep.end_parent over children made with MLflow's client: a pruned child with a lower
    objective, a failed one and a stopped one are never the best; the counts are tagged."""
    from mlflow.tracking import MlflowClient
    from omegaconf import OmegaConf

    from dtf import mlflow_sweep

    uri = (tmp_path / "mlruns").as_uri()
    sweep = OmegaConf.create(
        {
            "logger": {"mlflow": {"tracking_uri": uri}},
            "trainer": {"objective": "val/loss", "objective_mode": "min"},
            "hydra": {
                "sweep": {"dir": str(tmp_path / "sweep")},
                "sweeper": {"_target_": "basic"},
                "overrides": {"task": ["optimizer.lr=1,2"]},
            },
        }
    )
    (tmp_path / "sweep").mkdir()
    settings = mlflow_sweep.mlflow_settings(sweep)
    assert settings is not None
    mlflow_sweep.start_parent(settings, sweep)
    parent = json.loads((tmp_path / "sweep" / mlflow_sweep.PARENT_FILE).read_text())["run_id"]
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("dtf").experiment_id
    children = {}
    for name, objective, status, pruned in [
        ("0", 0.5, "FINISHED", False),
        ("1", 0.1, "FINISHED", True),
        ("2", 0.4, "FINISHED", False),
        ("3", 0.05, "FAILED", False),
        ("4", 0.01, "KILLED", False),
    ]:
        tags = {
            "mlflow.parentRunId": parent,
            "dtf.run_dir": f"/sweep/{name}",
            **({"dtf.pruned": "true"} if pruned else {}),
        }
        child = client.create_run(experiment, run_name=name, tags=tags)
        client.log_metric(child.info.run_id, "hparam/objective", objective)
        client.set_terminated(child.info.run_id, status)
        children[name] = child.info.run_id
    mlflow_sweep.end_parent(settings, sweep)
    run = client.get_run(parent)
    assert run.info.status == "FINISHED"
    assert run.data.tags["dtf.best_run_id"] == children["2"] and run.data.tags["dtf.best_run_dir"] == "/sweep/2"
    assert run.data.metrics["best/objective"] == 0.4
    assert (run.data.tags["dtf.trials"], run.data.tags["dtf.trials_pruned"], run.data.tags["dtf.trials_failed"]) == (
        "5",
        "1",
        "1",
    )
    assert client.get_run(children["2"]).data.tags["dtf.best"] == "true"
    # The sweep continued (the same sweep dir) is the same parent run, running again.
    mlflow_sweep.start_parent(settings, sweep)
    assert json.loads((tmp_path / "sweep" / mlflow_sweep.PARENT_FILE).read_text())["run_id"] == parent
    assert client.get_run(parent).info.status == "RUNNING"


def test_wandb_offline_logs_tensorboards_scalars_and_a_resumed_run_continues_its_run(tmp_path: Path) -> None:
    """logger=wandb in offline mode (no network): its run file, decoded with wandb's own record types,
    holds TensorBoard's scalars step for step, and a run trained to step 4 and resumed to step 6 is one
    W&B run (the id kept in the checkpoint) whose history covers steps 1-6."""
    first = [*RUN[:2], "trainer.log_every_n_steps=1", "logger=[tensorboard,wandb]", "checkpoint.every_n_steps=2"]
    train_in_process([*first, "trainer.max_steps=4"], tmp_path)
    [first_id], _ = wandb_history(tmp_path)
    summary = train_in_process([*first, "trainer.max_steps=6"], tmp_path)
    assert summary["resumed_from_step"] == 4
    ids, history = wandb_history(tmp_path)
    assert ids == {first_id}
    scalars = training_scalars(tmp_path)
    assert set(history) == set(scalars)
    for tag, by_step in scalars.items():
        assert as_float32(history[tag]) == by_step, tag
    assert sorted(history["train/loss_rank0"]) == list(range(1, 7))


def test_a_function_runs_result_is_logged_at_its_last_step(tmp_path: Path) -> None:
    """trainer=function: the loggers get the function's averaged result (summary.json's `result`) at its
    last step, the objective, and the run's files."""
    from mlflow.tracking import MlflowClient

    from tests.helpers.inprocess import function_in_process

    uri = (tmp_path / "mlruns").as_uri()
    overrides = ["trainer.fn._target_=returned_values.accuracy", "trainer.objective=test/accuracy", *RUN[:2]]
    overrides += ["trainer.objective_mode=max", "logger=[csv,mlflow]"]
    summary = function_in_process([*overrides, f"logger.mlflow.tracking_uri={uri}"], tmp_path / "run")
    result = summary["result"] if isinstance(summary["result"], dict) else {"result": summary["result"]}
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("dtf").experiment_id])
    assert run.info.status == "FINISHED"
    for name, value in result.items():
        [logged] = client.get_metric_history(run.info.run_id, name)
        assert (logged.step, logged.value) == (summary["global_step"], value), name
    assert run.data.metrics["hparam/objective"] == summary["objective"]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"summary.json"}
    table = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert table.to_dict("records") == [{"step": summary["global_step"], **result}]


def test_a_trial_is_the_sweeps_child_also_when_the_sweep_names_a_parent_run(tmp_path: Path) -> None:
    """logger.mlflow.parent_run_id given to a sweep nests the sweep's parent run under it; each trial is
    still the sweep parent's child (a trial of hydra/sweeper=dtf here: its run dir is <sweep dir>/<n>)."""
    from omegaconf import OmegaConf

    from dtf import mlflow_sweep

    (tmp_path / "sweep").mkdir()
    uri = "sqlite:///unused.db"
    (tmp_path / "sweep" / mlflow_sweep.PARENT_FILE).write_text(
        json.dumps({"run_id": "sweep-parent", "experiment_id": "1", "tracking_uri": uri})
    )
    cfg = OmegaConf.create(
        {"logger": {"mlflow": {"tracking_uri": uri, "parent_run_id": "users-run"}}, "trial": {"number": 0}}
    )
    mlflow_sweep.link_trial(cfg, str(tmp_path / "sweep" / "0"))
    assert cfg.logger.mlflow.parent_run_id == "sweep-parent"


@pytest.mark.parametrize("on_error", ["fail", "warn"])
def test_a_sweep_whose_tracking_server_is_unreachable_is_refused_or_has_no_parent(
    tmp_path: Path, on_error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """When the multirun starts (dtf.mlflow_sweep.MlflowSweep): one line and exit 2, or with on_error=warn
    a warning and no parent run (each trial then checks the server itself, as any run does)."""
    from omegaconf import OmegaConf

    from dtf.mlflow_sweep import PARENT_FILE, MlflowSweep

    uri = f"http://127.0.0.1:{_closed_port()}"
    sweep = OmegaConf.create(
        {
            "logger": {"mlflow": {"tracking_uri": uri, "on_error": on_error, "timeout_s": 2}},
            "hydra": {"sweep": {"dir": str(tmp_path)}},
        }
    )
    if on_error == "fail":
        with pytest.raises(SystemExit) as ended:
            MlflowSweep().on_multirun_start(sweep)
        assert ended.value.code == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("dtf: error: logger.mlflow.tracking_uri=") and "or sweep without it" in line
    else:
        MlflowSweep().on_multirun_start(sweep)
        assert "the sweep has no MLflow parent run" in capsys.readouterr().out
    assert not (tmp_path / PARENT_FILE).exists()
