"""A sweep with logger=mlflow is one MLflow parent run with a child run per trial, whichever sweeper
runs it (Hydra's basic sweeper, hydra/sweeper=dtf, Hydra's Optuna sweeper).

`MlflowSweep` is the Hydra callback: when the multirun starts it makes the parent run (or finds the one
an interrupted sweep made: the sweep dir keeps its id in mlflow_parent.json) and when it ends it marks
the best child on it. Between the two, each trial's driver links its run to the parent
(`link_trial`: logger.mlflow.parent_run_id, which rank 0 writes as MLflow's mlflow.parentRunId tag).
MLflow itself is imported only where a run or sweep logs to it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict

from dtf.config.schema import MlflowLoggerConfig
from dtf.errors import UserError
from dtf.files import write_json
from dtf.results import EXIT_USER_ERROR

PARENT_FILE = "mlflow_parent.json"  # in the sweep dir: {run_id, experiment_id, tracking_uri}
BEST_TAGS = ("dtf.best_run_id", "dtf.best_run_name", "dtf.best_run_dir")


class MlflowSweep(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        settings = mlflow_settings(config)
        if settings is None:
            return
        try:
            start_parent(settings, config)
        except UserError as e:
            print(f"dtf: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USER_ERROR) from None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        settings = mlflow_settings(config)
        if settings is None:
            return
        try:
            end_parent(settings, config)
        except Exception as e:  # the sweep's outcome stands whatever the tracking server does
            reason = " ".join(str(e).split())[:300]
            print(
                f"dtf: warning: MLflow could not mark the sweep's best run ({type(e).__name__}: {reason})", flush=True
            )


def mlflow_settings(config: DictConfig) -> MlflowLoggerConfig | None:
    """logger.mlflow's settings where the config chooses MLflow (None: it does not)."""
    node = config.get("logger")
    if not isinstance(node, DictConfig) or "mlflow" not in node:
        return None
    from dtf.config.typed import section

    settings: MlflowLoggerConfig = section(node, "mlflow", MlflowLoggerConfig, prefix="logger.")
    return settings


def start_parent(settings: MlflowLoggerConfig, config: DictConfig) -> None:
    """The sweep's parent run: made, or the interrupted sweep's continued. A tracking server that cannot
    be reached: UserError, or with on_error=warn a warning and no parent (each trial a run of its own)."""
    from dtf.preflight import tracking_server_answers
    from dtf.train.loggers.mlflow import client as mlflow_client
    from dtf.train.loggers.mlflow import configured_uri, experiment_id

    if not tracking_server_answers(settings, "sweep", "the sweep has no MLflow parent run"):
        return
    sweep_dir = Path(str(config.hydra.sweep.dir))
    uri = configured_uri(settings)
    client = mlflow_client(settings)
    known = read_parent(sweep_dir, uri)
    if known is not None and _exists(client, known["run_id"]):
        client.update_run(known["run_id"], status="RUNNING")
        print(f"dtf: MLflow parent run {known['run_id']} continues ({client.tracking_uri})", flush=True)
        return
    tags = {
        "dtf.sweep_dir": str(sweep_dir.resolve()),
        "dtf.sweeper": str(config.hydra.sweeper.get("_target_", "?")),
        "dtf.sweep_overrides": " ".join(map(str, config.hydra.overrides.task))[:5000],  # MLflow's tag limit is 8000
        "dtf.objective": f"{config.trainer.objective} ({config.trainer.objective_mode})",
        **({"mlflow.parentRunId": settings.parent_run_id} if settings.parent_run_id else {}),
        **{str(k): str(v) for k, v in settings.tags.items()},
    }
    experiment = experiment_id(client, settings.experiment_name)
    name = settings.run_name or "sweep " + "/".join(sweep_dir.resolve().parts[-2:])
    run = client.create_run(experiment, run_name=name, tags=tags)
    write_json(sweep_dir / PARENT_FILE, {"run_id": run.info.run_id, "experiment_id": experiment, "tracking_uri": uri})
    print(f"dtf: MLflow parent run {run.info.run_id} for the sweep ({client.tracking_uri})", flush=True)


def read_parent(sweep_dir: Path, uri: str) -> dict[str, str] | None:
    """The sweep's parent run as its start wrote it, where it is on this tracking URI."""
    try:
        known = json.loads((sweep_dir / PARENT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return known if isinstance(known, dict) and known.get("tracking_uri") == uri else None


def link_trial(cfg: DictConfig, run_dir: str) -> None:
    """A trial's run is the sweep's parent's child (logger.mlflow.parent_run_id), where its sweep has one:
    a parent_run_id given to the sweep is the sweep parent's own parent (start_parent), not the trials'.
    Called on each trial's driver before the config is frozen."""
    settings = mlflow_settings(cfg)
    if settings is None:
        return
    sweep_dir = sweep_dir_of(cfg, Path(run_dir))
    if sweep_dir is None:
        return
    from dtf.train.loggers.mlflow import configured_uri

    parent = read_parent(sweep_dir, configured_uri(settings))
    if parent is not None:
        with open_dict(cfg):
            cfg.logger.mlflow.parent_run_id = parent["run_id"]


def sweep_dir_of(cfg: DictConfig, run_dir: Path) -> Path | None:
    """The sweep this run is a point of: Hydra's sweep dir in a multirun (basic and Optuna sweepers), the
    trial's parent dir for hydra/sweeper=dtf (whose trials are runs of their own in <sweep dir>/<number>)."""
    from dtf import hydra_sweep

    multirun = hydra_sweep.sweep_dir()
    if multirun is not None:
        return Path(multirun)
    if cfg.get("trial") is not None:
        return run_dir.parent
    return None


def end_parent(settings: MlflowLoggerConfig, config: DictConfig) -> None:
    """Marks the best finished, unpruned child on the parent (by trainer.objective and its mode; a pruned,
    failed or stopped trial is never the best), with the trials' counts, and ends the parent run."""
    from dtf.train.loggers.mlflow import PRUNED_TAG, configured_uri
    from dtf.train.loggers.mlflow import client as mlflow_client

    parent = read_parent(Path(str(config.hydra.sweep.dir)), configured_uri(settings))
    if parent is None:
        return
    client = mlflow_client(settings)
    children = client.search_runs(
        [parent["experiment_id"]], filter_string=f"tags.`mlflow.parentRunId` = '{parent['run_id']}'", max_results=10000
    )
    pruned = [r for r in children if r.data.tags.get(PRUNED_TAG) == "true"]
    chosen = [
        r
        for r in children
        if r.info.status == "FINISHED"
        and r.data.tags.get(PRUNED_TAG) != "true"
        and not math.isnan(r.data.metrics.get("hparam/objective", math.nan))
    ]
    counts = {
        "dtf.trials": len(children),
        "dtf.trials_pruned": len(pruned),
        "dtf.trials_failed": sum(r.info.status == "FAILED" for r in children),
    }
    for key, count in counts.items():
        client.set_tag(parent["run_id"], key, str(count))
    if chosen:
        pick = max if str(config.trainer.objective_mode) == "max" else min
        best = pick(chosen, key=lambda r: r.data.metrics["hparam/objective"])
        value = best.data.metrics["hparam/objective"]
        for key, tag in zip(
            BEST_TAGS, (best.info.run_id, best.info.run_name, best.data.tags.get("dtf.run_dir", "")), strict=True
        ):
            client.set_tag(parent["run_id"], key, tag)
        client.set_tag(best.info.run_id, "dtf.best", "true")
        client.log_metric(parent["run_id"], "best/objective", value)
        said = f"best {best.info.run_name} ({config.trainer.objective} {value:.6g})"
    else:
        said = "no trial finished unpruned"
    client.set_terminated(parent["run_id"], "FINISHED")
    print(f"dtf: MLflow parent run {parent['run_id']}: {len(children)} trial run(s), {said}", flush=True)


def _exists(client: Any, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_run(run_id).info.lifecycle_stage) != "deleted"
    except MlflowException:
        return False
