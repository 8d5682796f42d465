"""summary.json is the machine-readable result that sweeps, reports, benchmarks and users read: its
keys are added, never renamed (docs/DESIGN). They are written from typed records
(dtf.train.summary); these are the keys each kind of run wrote before the records existed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dtf.train.summary import FunctionSummary, LoopSummary, Summary
from tests.helpers.inprocess import function_in_process, train_in_process
from tests.helpers.parquet_files import write_skewed

EVERY_RUN = {
    "world_size",
    "global_step",
    "steps_per_rank",
    "objective",
    "objective_name",
    "objective_mode",
    "params_sha256",
    "params_sha256_consistent",
    "peak_rss_bytes",
    "train_seconds",
    "strategy",
    "strategy_settings",
    "launcher",
    "data_samples",
    "data_dropped_per_epoch",
    "weights_file",
    "run_dir",
}
LOOP = EVERY_RUN | {
    "epochs",
    "final_train_loss",
    "final_test_loss",
    "train_loss_per_epoch",
    "test_loss_per_epoch",
    "final_metrics",
    "metrics_per_epoch",
    "samples_per_sec",
    "step_time_s",
    "checkpoint_blocked_s",
    "checkpoints_saved",
    "model_state_bytes",
    "model_state_estimate_bytes",
    "first_step_s",
    "compiled_graphs",
    "skipped_steps",
    "nonfinite_steps_skipped",
    "config_sha256_by_rank",
    "config_consistent",
    "samples_seen",
    "lr_final",
    "resumed_from_step",
    "data_batches_per_epoch",
    "data_repeated_per_epoch",
    "data_canonical_partitions",
    "slurm_job_id",
    "slurm_restarts",
    "pruned",
    # added with the validation split (issue 32)
    "final_val_loss",
    "evaluations",
    "best_step",
    "best_objective",
    "stopped_early",
    "best_weights_file",
    # added with elastic membership (issue 35)
    "membership_changes",
    # added with strategy=auto (issue 50)
    "strategy_choice",
    # added with checkpoints on S3 (issue 51)
    "resume_s",
}
FUNCTION = EVERY_RUN | {"mode", "result", "optimizer_state_bytes", "model_state_bytes"}
SMALL = ["data.dataset.num_points=2000", "data.dataset.num_test=200"]


def fields(cls: type[Summary]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_records_have_the_keys_summary_json_always_had() -> None:
    assert fields(Summary) == EVERY_RUN
    assert fields(LoopSummary) == LOOP
    assert fields(FunctionSummary) == FUNCTION


def test_a_default_a_parquet_and_a_function_run_write_those_keys(tmp_path: Path) -> None:
    default = train_in_process(["trainer.max_steps=5", *SMALL], tmp_path / "default")
    parquet = train_in_process(
        ["data=petastorm", f"data.path={write_skewed(tmp_path / 'data')}", "trainer.max_steps=5"], tmp_path / "parquet"
    )
    function = function_in_process(["trainer.fn._target_=maggy_function.train", *SMALL], tmp_path / "function")
    assert set(default) == LOOP and set(parquet) == LOOP and set(function) == FUNCTION
    assert default["data_canonical_partitions"] is None and parquet["data_canonical_partitions"] == 8
    assert function["mode"] == "function" and function["objective"] == function["result"]
