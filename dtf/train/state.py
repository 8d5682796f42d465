"""Where a run stands, as the trainer keeps and checkpoints it.

Positions are kept in samples over all ranks, not in batches of one rank: a run resumed on
another world size (or batch size) finds its place in the epoch again, and its budget and
throughput stay right.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dtf.errors import UserError


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch in progress (0-based): epochs finished, while samples_in_epoch == 0
    # Samples of the current epoch trained on, over all ranks: a prefix of the epoch's sample order.
    # > 0 also means the epoch's end (its loss, evaluation) is still to come, even once all are used.
    samples_in_epoch: int = 0
    samples_seen: int = 0  # over all ranks, the whole run
    train_seconds: float = 0.0  # time in training steps (not evaluation, not checkpoint saves)
    train_loss_curve: list[float] = field(default_factory=list)  # per epoch, all ranks
    test_loss_curve: list[float] = field(default_factory=list)
    last_train_loss: float = math.nan
    last_test_loss: float | None = None
    # Per finished epoch: {"epoch": n, "train/loss": ..., "test/loss": ..., "test/<metric>": ...}
    # (test values in the epochs that were evaluated).
    metrics_per_epoch: list[dict[str, float]] = field(default_factory=list)
    # What samples_in_epoch counts in: the global batch (samples per batch over all ranks) and, for
    # Parquet, the number of canonical partitions whose sequence it is a position in (None: none).
    global_batch: int | None = None
    canonical_partitions: int | None = None
    # Every evaluation during training: {"step": s, "epoch": epochs done (fractional), "val/loss": ...}
    # (the test split's figures where the data has no validation split).
    evaluations: list[dict[str, float]] = field(default_factory=list)
    # dtf.train.selection's: the best objective so far and its step, the evaluations since the last
    # improvement by more than min_delta, the step judged last, and why training stopped early.
    best_objective: float | None = None
    best_step: int | None = None
    evaluations_without_improvement: int = 0
    judged_step: int | None = None
    stopped_early: str | None = None
    # checkpoint.keep_best: [step, objective] of the best evaluations so far, best first.
    best_scores: list[list[float]] = field(default_factory=list)
    # The tracking runs this run logs to (logger=mlflow, logger=wandb): a resumed run continues them.
    mlflow_run_id: str | None = None
    wandb_run_id: str | None = None
    # Elastic runs: each change of the world size, {"step", "old_world_size", "new_world_size",
    # "time_lost_s", "steps_recomputed"} (dtf.elastic).
    membership_changes: list[dict[str, Any]] = field(default_factory=list)

    def latest_metrics(self) -> dict[str, float]:
        """Every value's latest figure (a test value from the latest evaluation)."""
        latest: dict[str, float] = {}
        for epoch in self.metrics_per_epoch:
            latest.update({k: v for k, v in epoch.items() if k != "epoch"})
        return latest

    @property
    def mid_epoch(self) -> bool:
        return self.samples_in_epoch > 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        added_since = {
            "metrics_per_epoch",
            "global_batch",
            "canonical_partitions",
            "evaluations",
            "best_objective",
            "best_step",
            "evaluations_without_improvement",
            "judged_step",
            "stopped_early",
            "best_scores",
            "mlflow_run_id",
            "wandb_run_id",
            "membership_changes",
        }  # a checkpoint from before they existed loads without them
        missing = [name for name in asdict(self) if name not in state and name not in added_since]
        if missing:
            raise UserError(
                "checkpoint.resume: this checkpoint was written by an older dtf (no "
                f"{', '.join(missing)}); start over with checkpoint.resume=never"
            )
        for name in asdict(self):
            if name not in state:
                continue
            value = state[name]
            setattr(self, name, list(value) if isinstance(value, list) else value)
