"""logger=mlflow: one MLflow run per dtf run, through MLflow's own client.

Params: the resolved config, flattened (`trainer.max_epochs`). Metrics: every scalar TensorBoard
gets, by the same name at the same step, and at the end its hparams' figures (`hparam/objective`).
Artifacts at the end: summary.json, model.pt and .hydra/. Tags: dtf.strategy, dtf.world_size,
dtf.launcher, dtf.run_dir; in a sweep, MLflow's mlflow.parentRunId (the sweep's run, dtf.mlflow_sweep)
and dtf.pruned on a pruned trial. The run's id is kept in the checkpoint (TrainState.mlflow_run_id), so
a resumed run continues the same MLflow run.

A tracking server that fails is MLflow's to retry (MLFLOW_HTTP_REQUEST_MAX_RETRIES, _BACKOFF_FACTOR
and _TIMEOUT, set from logger.mlflow's settings unless the environment has them); a call that still
fails is reported once, and training goes on without MLflow: a tracking server never costs a run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dtf.config.schema import MlflowLoggerConfig
from dtf.train.loggers import flat_config

MAX_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit
STATUS = {"finished": "FINISHED", "pruned": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
PRUNED_TAG = "dtf.pruned"  # a trial its search pruned: finished early, never a sweep's best


class MlflowLogger:
    def __init__(self, settings: MlflowLoggerConfig, run: Any, run_dir: Path, world_size: int) -> None:
        self.settings = settings
        self.params = flat_config(OmegaConf.to_container(run.composed, resolve=True, enum_to_str=True))
        self.tags = {
            **({"mlflow.parentRunId": settings.parent_run_id} if settings.parent_run_id else {}),
            **({"dtf.trial": str(run.trial.number)} if run.trial is not None else {}),
            "dtf.strategy": run.strategy.name,
            "dtf.world_size": str(world_size),
            "dtf.launcher": run.launcher.name,
            "dtf.run_dir": str(run_dir.resolve()),
            **{str(k): str(v) for k, v in settings.tags.items()},
        }
        self.run_name = settings.run_name or run_dir.name
        self.client: Any = None
        self.run_id: str | None = None
        self.state: Any = None
        self.failed = False  # reported; nothing more is sent

    def start(self, state: Any) -> None:
        self.state = state
        self._call("starting the run", lambda: self._start(client(self.settings), state))

    def _start(self, client: Any, state: Any) -> None:
        if state.mlflow_run_id and self._same_run_dir(client, state.mlflow_run_id):
            run = client.get_run(state.mlflow_run_id)
            client.update_run(state.mlflow_run_id, status="RUNNING")
            self._log_params_of_resumed(client, state.mlflow_run_id, run.data.params)
            print(f"dtf: MLflow run {self.run_id} continues ({client.tracking_uri})", flush=True)
            return
        experiment = self.settings.experiment_name
        run = client.create_run(experiment_id(client, experiment), run_name=self.run_name, tags=self.tags)
        self.client, self.run_id = client, run.info.run_id
        state.mlflow_run_id = self.run_id
        self._log_params(self.params)
        print(f"dtf: MLflow run {self.run_id} in experiment {experiment} ({client.tracking_uri})", flush=True)

    def _same_run_dir(self, client: Any, run_id: str) -> bool:
        """The checkpoint's MLflow run is this run dir's (not a run whose checkpoint this one starts from,
        checkpoint.resume=<path>, nor one deleted since): only then is it continued."""
        from mlflow.exceptions import MlflowException

        try:
            return bool(client.get_run(run_id).data.tags.get("dtf.run_dir") == self.tags["dtf.run_dir"])
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def _log_params_of_resumed(self, client: Any, run_id: str, logged: dict[str, str]) -> None:
        """MLflow keeps a param's first value: the new ones are added, the changed ones said once."""
        self.client, self.run_id = client, run_id
        self._log_params({k: v for k, v in self.params.items() if k not in logged})
        changed = [f"{k}={v}" for k, v in self.params.items() if k in logged and logged[k] != v]
        if changed:
            print(
                f"dtf: note: the MLflow run keeps its params' first values (MLflow never changes a param); "
                f"this resumed run has {', '.join(changed)}",
                flush=True,
            )

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_PER_BATCH], synchronous=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self._active():
            self._call(f"logging step {step}", lambda: self._log_metrics(step, values))

    def _log_metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float | None]) -> None:
        """TensorBoard's hparams figures, by its names (hparam/objective, ...), at the last step; the
        settings are the params already."""
        figures = {f"hparam/{k}": v for k, v in metrics.items() if v is not None}
        if figures:
            self.scalars(self.state.step, figures)

    def finish(self, run_dir: Path) -> None:
        if not self._active():
            return
        for name in ("summary.json", "model.pt", "best_model.pt"):
            if (run_dir / name).exists():
                self._call(f"uploading {name}", lambda n=name: self.client.log_artifact(self.run_id, str(run_dir / n)))
        if (run_dir / ".hydra").is_dir():
            self._call(
                "uploading .hydra/",
                lambda: self.client.log_artifacts(self.run_id, str(run_dir / ".hydra"), artifact_path=".hydra"),
            )

    def close(self, status: str) -> None:
        if self._active() and status == "pruned":  # a finished run, which its sweep does not choose from
            self._call("tagging the run pruned", lambda: self.client.set_tag(self.run_id, PRUNED_TAG, "true"))
        if self._active():
            self._call("ending the run", lambda: self.client.set_terminated(self.run_id, STATUS[status]))
        self.client = None

    def _active(self) -> bool:
        return self.client is not None and not self.failed

    def _call(self, what: str, call: Any) -> None:
        """call(), or once it failed (after MLflow's own retries): one line, and no more MLflow."""
        if self.failed:
            return
        try:
            call()
        except Exception as e:  # any failure of the tracking server or store: training matters more
            self.failed = True
            reason = " ".join(str(e).split())[:300]
            print(
                f"dtf: warning: MLflow failed {what} ({type(e).__name__}: {reason}); training goes on without MLflow "
                f"(what was logged before is kept in run {self.run_id or '(none)'})",
                flush=True,
            )


def client(settings: MlflowLoggerConfig) -> Any:
    """MLflow's client for logger.mlflow's tracking URI (null: MLFLOW_TRACKING_URI, else MLflow's default),
    with its HTTP retries set from the settings."""
    for name, value in retry_settings(settings).items():
        os.environ.setdefault(name, value)
    if configured_uri(settings).startswith("file:"):  # named by the user: MLflow 3 refuses its file store unless told
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(settings.tracking_uri)


def configured_uri(settings: MlflowLoggerConfig) -> str:
    """The tracking URI as configured ("" where MLflow's own default applies)."""
    return settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")


def experiment_id(client: Any, name: str) -> str:
    """The experiment's id, made if there is none (two runs making it at once: one wins, both use it)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except Exception:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def retry_settings(settings: MlflowLoggerConfig) -> dict[str, str]:
    """MLflow's HTTP retry settings from logger.mlflow's (the environment's win where set)."""
    return {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(settings.max_retries),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(settings.backoff_factor),
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(settings.timeout_s),
    }
