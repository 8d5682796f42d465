"""What a run is judged by, and what follows from it: the objective (trainer.objective, resolved
against the splits the data has), the best evaluation so far, and early stopping. The state is
the trainer's (TrainState), so that it survives a resume exactly."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dtf.config.schema import EarlyStoppingConfig, ObjectiveMode
from dtf.errors import UserError
from dtf.train.state import TrainState

TEST_BIAS_WARNING = (
    "selecting on the test set biases its score upward (sweeps, pruning, early stopping and the best "
    "checkpoint all read it): give the data a validation split (data.val_fraction, or data.val_path for "
    "Parquet) and judge by val/loss"
)


def resolve_objective(objective: str, has_val: bool, has_test: bool) -> str:
    """trainer.objective as this run computes it: auto is val/loss with a validation split, else
    test/loss with a test split, else train/loss. UserError for a split the run cannot judge by."""
    if objective == "auto":
        return "val/loss" if has_val else "test/loss" if has_test else "train/loss"
    split, _, value = objective.partition("/")
    if split == "val" and not has_val:
        raise UserError(
            f"trainer.objective={objective}: this data has no validation split: hold one out with data.val_fraction "
            "(data.val_path or data.val_filters for Parquet), or judge by trainer.objective=auto"
        )
    if split == "test" and has_val:
        raise UserError(
            f"trainer.objective={objective}: with a validation split the test split is evaluated once, at the end, "
            f"and never chooses: judge by val/{value}"
        )
    if split == "test" and not has_test:
        if value == "loss":  # the default of earlier versions: a run without a test set judges its training loss
            return "train/loss"
        raise UserError(
            f"trainer.objective={objective}: this data has no test set; judge the run by train/loss "
            "(or a train/<metric> with trainer.train_metrics=true), or give the data a test split"
        )
    return objective


@dataclass(frozen=True)
class Verdict:
    """What one judged evaluation means: a new best, a place among the best k, a reason to stop."""

    value: float
    improved: bool
    stop_reason: str | None


class Selection:
    """Tracks the objective over the evaluations (in TrainState) and decides early stopping."""

    def __init__(self, objective: str, mode: ObjectiveMode, early: EarlyStoppingConfig, state: TrainState) -> None:
        self.objective = objective
        self.maximize = mode == ObjectiveMode.max
        self.early = early
        self.state = state

    def judge(self, step: int, figures: Mapping[str, float | None]) -> Verdict | None:
        """Judge figures measured at step, once per step; None when they hold no finite objective."""
        st = self.state
        value = figures.get(self.objective)
        if value is None or value != value or st.judged_step == step:  # NaN is never a best
            return None
        st.judged_step = step
        best = st.best_objective
        improved = best is None or (value > best if self.maximize else value < best)
        # Early stopping counts evaluations that did not beat the best by more than min_delta.
        gain = None if best is None else (value - best if self.maximize else best - value)
        significant = gain is None or gain > self.early.min_delta
        st.evaluations_without_improvement = 0 if significant else st.evaluations_without_improvement + 1
        if improved:
            st.best_objective, st.best_step = value, step
        stop = None
        patience = self.early.patience
        if patience is not None and st.evaluations_without_improvement >= patience:
            stop = (
                f"early stopping: {self.objective} did not improve by more than {self.early.min_delta:g} in "
                f"{patience} evaluation(s) (best {st.best_objective:.6g} at step {st.best_step}; "
                "trainer.early_stopping.patience)"
            )
            st.stopped_early = stop
        return Verdict(value, improved, stop)
