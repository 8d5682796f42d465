"""Evaluation beside the loop, in the shape of torchtitan's validator: when an evaluation is due,
the evaluation itself (every sample counted once across ranks, (sum, count) reduced), what it means
(the objective's best so far, early stopping, a search's pruning) and what is kept for it
(checkpoint.keep_best's ranking, best_model.pt). The Trainer asks it at its step boundaries and
epoch ends; dtf.eval uses evaluate() alone."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from dtf.config.schema import TrainerConfig
from dtf.data.batch import take_first, to_device
from dtf.data.interface import EvalData
from dtf.dist.env import DistEnv
from dtf.heartbeat import Heartbeat
from dtf.train.forward import Forward
from dtf.train.metrics import MeanMetric, Metrics
from dtf.train.progress import Progress
from dtf.train.rng import rng_state, set_rng_state
from dtf.train.selection import Selection
from dtf.train.state import TrainState

if TYPE_CHECKING:
    from dtf.strategy.base import Strategy
    from dtf.train.checkpoint import Checkpointer
    from dtf.train.control import StepControl
    from dtf.train.loggers import Loggers


class Pruning(Protocol):
    """A search that may end a trial early (hydra/sweeper=dtf): asked after every epoch."""

    def should_prune(self, epoch: int, figures: Mapping[str, float | None]) -> bool:
        """Collective: every rank calls it at the same epoch end and gets the same answer."""
        ...


class Validator:
    """What training evaluates on is the validation split, or the test split where there is none;
    with a validation split the test split is evaluated once, at the end, and never chooses."""

    def __init__(
        self,
        env: DistEnv,
        forward: Forward,
        metrics: Metrics,
        val_data: EvalData | None,
        test_data: EvalData | None,
        *,
        settings: TrainerConfig | None = None,
        steps_per_epoch: int = 1,
        state: TrainState | None = None,
        objective: str = "train/loss",
        pruning: Pruning | None = None,
        control: StepControl | None = None,
        heartbeat: Heartbeat | None = None,
        loggers: Loggers | None = None,
        keep_best: tuple[Checkpointer, Strategy, Path | None] | None = None,
    ) -> None:
        self.env = env
        self.forward = forward
        self.metrics = metrics  # on the evaluated split, at each evaluation
        self.eval_data, self.split = (val_data, "val") if val_data is not None else (test_data, "test")
        self.final_test_data = test_data if val_data is not None else None
        self.s = settings or TrainerConfig()
        self.state = state or TrainState()  # the trainer's: evaluations and the best survive a resume with it
        self.selection = Selection(objective, self.s.objective_mode, self.s.early_stopping, self.state)
        self.pruning = pruning
        self.pruned_at_epoch: int | None = None  # the search pruned this trial after that epoch
        self.control = control  # stop agreements between evaluation batches (stoppable evaluations)
        self.beat = heartbeat or Heartbeat(None, env.rank, 0)
        self.loggers = loggers
        # checkpoint.keep_best: the checkpointer keeps the best k; best_model.pt holds the best weights.
        self.checkpointer: Checkpointer | None = keep_best[0] if keep_best else None
        self.strategy: Strategy | None = keep_best[1] if keep_best else None
        self.best_model_path: Path | None = keep_best[2] if keep_best else None
        self.keep_step_saved = False  # the latest judged step is one of checkpoint.keep_best
        self.steps_per_epoch = steps_per_epoch
        self.points_in_epoch = self.s.eval_points_in_epoch(steps_per_epoch)  # a fraction of an epoch's

    # -- when -------------------------------------------------------------------------------
    def should_validate(self, step: int, last: bool, epoch_ends: bool, epoch_fraction: Callable[[], float]) -> bool:
        """An evaluation within the epoch is due after this step (not where the epoch's end
        evaluates anyway: always after the run's last step). epoch_fraction(): how much of the
        current epoch is done, which places a fraction's evaluations in every epoch alike, also
        after a resume on another world size."""
        if self.s.eval_every_n_steps is not None:
            due = step % self.s.eval_every_n_steps == 0
        else:
            due = bool(self.points_in_epoch) and not epoch_ends
            due = due and round(epoch_fraction() * self.steps_per_epoch) in self.points_in_epoch
        return due and not (last or (epoch_ends and self.epoch_end_evaluates()))

    def epoch_end_evaluates(self) -> bool:
        """The current epoch's end is one trainer.eval_every_n_epochs asks for (every epoch's, for
        a fraction of one)."""
        every = self.s.eval_every_epochs()
        return every is None or (self.state.epoch + 1) % every == 0

    # -- evaluating -------------------------------------------------------------------------
    def validate(self, model: nn.Module, progress: Progress, epochs_done: float) -> bool:
        """An evaluation between two steps of an epoch, recorded, logged and judged. It is not
        stoppable: a stop agreed meanwhile takes effect right after it. True when its step's
        checkpoint must be kept (one of the best, with checkpoint.keep_best)."""
        assert self.eval_data is not None
        figures = self.evaluated(model, self.eval_data, self.split, stoppable=False)
        assert figures is not None
        self.record(figures, epochs_done, logged=True)
        progress.write(f"step {self.state.step}: {describe(figures)} (all ranks)")
        return self.judge(model, figures, progress)

    def at_epoch_end(self, model: nn.Module, done: bool) -> tuple[bool, dict[str, float]]:
        """The epoch's evaluation, when one is due (always after the last epoch): (False, {}) when
        a stop signal abandoned it, else (True, its figures, or {} where none was due)."""
        st = self.state
        if st.evaluations and st.evaluations[-1]["step"] == st.step:  # evaluated at this step already
            return True, {k: v for k, v in st.evaluations[-1].items() if "/" in k}
        if self.eval_data is None or not (done or self.epoch_end_evaluates()):
            return True, {}
        figures = self.evaluated(model, self.eval_data, self.split, stoppable=True)
        return (False, {}) if figures is None else (True, figures)

    def evaluated(self, model: nn.Module, data: EvalData, split: str, stoppable: bool) -> dict[str, float] | None:
        """Figures of one split ("val/loss", "val/<metric>", ...), or None when a stop abandoned them."""
        result = self.evaluate(model, data, stoppable=stoppable)
        if result is None:
            return None
        loss, metrics = result
        return {f"{split}/loss": loss, **{f"{split}/{k}": v for k, v in metrics.items()}}

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, data: EvalData, stoppable: bool = False
    ) -> tuple[float, dict[str, float]] | None:
        """Mean loss and the metrics over a split, every sample counted exactly once across ranks.
        stoppable: the ranks check for a stop between batches, and a stop abandons the evaluation
        (None), leaving the random streams as they were before it."""
        control = self.control if stoppable else None
        rng = rng_state() if control is not None else None  # iterating a DataLoader draws a seed from them
        if control is not None:
            control.enter_phase()
        model.eval()
        loss_sums = MeanMetric(self.env.device)
        self.metrics.reset()
        self.beat.mark("waiting for evaluation data")
        for j, batch in enumerate(data):
            self.beat.mark("evaluation")
            if control is not None and rng is not None and j > 0 and control.should_stop_evaluating(j):
                model.train()
                control.enter_phase()
                set_rng_state(rng)
                return None
            batch = to_device(batch, self.env.device)
            real = data.num_real_in_batch(j)
            # Padded samples (only ever at the end of a rank's share) are cut off; a batch that is
            # all padding still runs forward so every rank makes the same collectives, weighed
            # zero and kept out of the metrics.
            if real > 0:
                loss, count = self.forward(model, take_first(batch, real), self.metrics)
                loss_sums.update(loss, count)
            else:
                self.forward(model, batch, None)
            self.beat.mark("waiting for evaluation data")
        model.train()
        if control is not None:
            control.enter_phase()
        return loss_sums.compute(), self.metrics.compute()

    def record(self, figures: dict[str, float], epochs_done: float, logged: bool) -> None:
        """Kept in the state (summary.json's evaluations), with the epochs done so far (fractional)."""
        st = self.state
        if st.evaluations and st.evaluations[-1]["step"] == st.step:
            return
        st.evaluations.append({"step": st.step, "epoch": round(epochs_done, 6), **figures})
        if self.split == "test":
            st.last_test_loss = figures["test/loss"]
            st.test_loss_curve.append(figures["test/loss"])
        if logged and self.loggers is not None:
            self.loggers.scalars(st.step, figures)

    def test_at_end(self, model: nn.Module, progress: Progress) -> None:
        """With a validation split: the test split, once, at the end (it never chooses anything)."""
        if self.final_test_data is None:
            return
        figures = self.evaluated(model, self.final_test_data, "test", stoppable=False)
        assert figures is not None
        st = self.state
        st.last_test_loss = figures["test/loss"]
        st.test_loss_curve = [figures["test/loss"]]
        if st.metrics_per_epoch:
            st.metrics_per_epoch[-1].update(figures)
        progress.write(f"test at the end: {describe(figures)} (all ranks)")
        if self.loggers is not None:
            self.loggers.scalars(st.step, figures)

    # -- judging and keeping the best -------------------------------------------------------
    def judge(self, model: nn.Module, figures: dict[str, float], progress: Progress) -> bool:
        """The objective in figures, judged (best so far, early stopping); the best weights and
        checkpoints kept with checkpoint.keep_best. True when this step's checkpoint is one to keep."""
        verdict = self.selection.judge(self.state.step, figures)
        if verdict is None:
            return False
        kept = self._rank_checkpoint(verdict.value)
        if verdict.improved and self.best_model_path is not None:
            self._save_best_model(model)
        if verdict.stop_reason:
            progress.write(f"step {self.state.step}: {verdict.stop_reason}")
        return kept

    def prune(self, figures: Mapping[str, float | None], progress: Progress) -> None:
        """A search's trial reports the epoch's figures; its pruner may end it here (collective)."""
        epoch = self.state.epoch
        if self.pruning is not None and self.pruning.should_prune(epoch, figures):
            self.pruned_at_epoch = epoch
            progress.write(f"epoch {epoch}: pruned by the search (hydra.sweeper.pruner)")

    def _rank_checkpoint(self, value: float) -> bool:
        """checkpoint.keep_best: this step's score among the others'; the checkpointer keeps the
        best k. True when this step is one of them (its checkpoint must exist)."""
        self.keep_step_saved = False
        k = self.checkpointer.keep_best if self.checkpointer is not None else 0
        if not k:
            return False
        assert self.checkpointer is not None
        scores = self.state.best_scores
        scores.append([self.state.step, value])
        scores.sort(key=lambda sv: -sv[1] if self.selection.maximize else sv[1])  # stable: earlier steps first
        del scores[k:]
        self.checkpointer.keep_steps(self.selection.objective, scores)
        self.keep_step_saved = any(step == self.state.step for step, _ in scores)
        return self.keep_step_saved

    def _save_best_model(self, model: nn.Module) -> None:
        """<run_dir>/best_model.pt: the whole weights now (collective; rank 0 writes)."""
        assert self.best_model_path is not None and self.strategy is not None
        self.beat.mark("saving the best model")
        state = {name: t.detach().cpu() for name, t in self.strategy.whole_tensors(model)}
        if self.env.is_main:
            ordered = {name: state[name] for name in self.strategy.state_names(model)}
            tmp = self.best_model_path.with_suffix(".pt.tmp")
            torch.save(ordered, tmp)
            tmp.replace(self.best_model_path)


def show(value: float | None) -> str:
    return "null" if value is None else format(value, ".6g")


def describe(figures: Mapping[str, float | None]) -> str:
    """train/loss 0.1, test/accuracy 0.9 -> "train loss 0.1, test accuracy 0.9"."""
    return ", ".join(f"{name.replace('/', ' ')} {show(value)}" for name, value in figures.items())
