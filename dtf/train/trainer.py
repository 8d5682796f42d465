"""The generic training loop: the same on every rank, whatever launched it or distributes it."""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dtf import elastic
from dtf.config.schema import TrainerConfig
from dtf.data.batch import batch_size_of, take_first, to_device
from dtf.data.interface import EvalData, TrainData
from dtf.dist.env import DistEnv
from dtf.errors import TrainingFailed
from dtf.strategy.base import Strategy
from dtf.train.blocks import compiled_graphs
from dtf.train.checkpoint import Checkpointer, committed
from dtf.train.control import StepControl
from dtf.train.heartbeat import Heartbeat
from dtf.train.loggers import Loggers
from dtf.train.metrics import MeanMetric, Metrics
from dtf.train.nonfinite import NonFiniteGuard
from dtf.train.precision import Precision
from dtf.train.progress import Progress
from dtf.train.rng import rng_state, set_rng_state
from dtf.train.schedule import LRSchedule, Plan
from dtf.train.selection import Selection
from dtf.train.state import TrainState

StepFn = Callable[[nn.Module, Any, Callable[..., torch.Tensor]], Any]


class Pruning(Protocol):
    """A search that may end a trial early (hydra/sweeper=dtf): asked after every epoch."""

    def should_prune(self, epoch: int, figures: Mapping[str, float | None]) -> bool:
        """Collective: every rank calls it at the same epoch end and gets the same answer."""
        ...


def supervised_step(model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
    """The default step: batch = (inputs, targets); the loss of model(inputs) against targets."""
    inputs, targets = batch
    return loss_fn(model(inputs), targets)


class Trainer:
    """One rank's loop. Its own state (TrainState, the epoch's loss sums, the LR schedule) is what
    state_dict() returns; app_state() is the strategy's (model and optimizer, sharded as trained)."""

    def __init__(
        self,
        settings: TrainerConfig,
        env: DistEnv,
        strategy: Strategy,
        model: nn.Module,
        optimizer: Optimizer,
        schedule: LRSchedule,
        loss_fn: Callable[..., torch.Tensor],
        step_fn: StepFn,
        train_data: TrainData,
        val_data: EvalData | None,
        test_data: EvalData | None,
        loggers: Loggers,
        checkpointer: Checkpointer,
        control: StepControl,
        metrics: Metrics,
        train_metrics: Metrics,
        precision: Precision | None = None,
        pruning: Pruning | None = None,
        nonfinite: NonFiniteGuard | None = None,
        heartbeat: Heartbeat | None = None,
        objective: str = "train/loss",
        best_model_path: Path | None = None,
        profiler: torch.profiler.profile | None = None,
    ) -> None:
        self.s = settings
        self.env = env
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.step_fn = step_fn
        self.train_data = train_data
        # What training evaluates on (the validation split; the test split where there is none),
        # and the test split kept for the end when there is a validation split.
        self.eval_data, self.eval_split = (val_data, "val") if val_data is not None else (test_data, "test")
        self.final_test_data = test_data if val_data is not None else None
        self.loggers = loggers  # rank 0's (none elsewhere)
        self.checkpointer = checkpointer
        self.control = control
        self.precision = precision or Precision("32", env.device)
        self.nonfinite = nonfinite or NonFiniteGuard(settings.on_nonfinite, strategy, self.precision, env)
        self.pruning = pruning
        self.pruned_at_epoch: int | None = None  # the search pruned this trial after that epoch
        self._keep_step_saved = False  # the latest evaluation's step is one of checkpoint.keep_best
        self.state = TrainState()
        self.selection = Selection(objective, settings.objective_mode, settings.early_stopping, self.state)
        self.best_model_path = best_model_path  # <run_dir>/best_model.pt with checkpoint.keep_best
        self.profiler = profiler  # trainer.profiler: told of every optimizer step
        self._record_data_position()
        self.train_loss = MeanMetric(env.device)  # the current epoch's, this rank's samples
        self.metrics = metrics  # on the test set, at each evaluation
        self.train_metrics = train_metrics  # on the current epoch's training batches (none unless asked)
        self.start_batch = 0  # where the next epoch begins (> 0 only for a run resumed mid-epoch)
        self.resumed_from_step: int | None = None
        self.model_state_estimate_bytes: int | None = None  # trainer.memory_check's (dtf.memory)
        self.step_times: list[float] = []
        self.beat = heartbeat or Heartbeat(None, env.rank, 0)  # what this rank does, for the driver
        self.beat.step_times = self.step_times
        self.first_step_s: float | None = None  # this process's first step (with trainer.compile: compilation)
        self.resumed_from_world: int | None = None  # the world size of the checkpoint it resumed from
        # A change of the world size since that checkpoint, completed and recorded at the first step.
        self.membership_change: dict[str, Any] | None = None
        self.compiled_graphs: int | None = None
        self.model_state_bytes: int | None = None
        self._step_samples = 0  # samples of the latest optimizer step, over all ranks
        self._t_last = 0.0
        self.total_steps = self._planned_steps()
        self.schedule.start(Plan(self.total_steps, settings.steps_per_epoch(len(train_data))))
        self.eval_interval = settings.eval_step_interval(settings.steps_per_epoch(len(train_data)))

    def _record_data_position(self) -> None:
        """What the data's positions count in, kept in the checkpoint for a resume to check against."""
        self.state.global_batch = self.train_data.samples_after(1) - self.train_data.samples_after(0)
        self.state.canonical_partitions = self.train_data.num_partitions

    def _planned_steps(self) -> int:
        """Optimizer steps of the whole run: max_steps, or what finishes max_epochs from where the run stands."""
        s, st = self.s, self.state
        if s.max_steps is not None:
            return s.max_steps
        if st.epoch >= s.max_epochs:
            return st.step
        this_epoch = math.ceil((len(self.train_data) - self.start_batch) / s.grad_accum_steps)
        later = (s.max_epochs - st.epoch - 1) * s.steps_per_epoch(len(self.train_data))
        return st.step + this_epoch + later

    # -- the loop --------------------------------------------------------------------------
    def fit(self) -> None:
        """Train until the budget is spent, or until the ranks agree to stop (stopped_at_step)."""
        progress = Progress(self.s.progress, self.total_steps, enabled=self.env.is_main)
        self.optimizer.zero_grad(set_to_none=True)
        with self.profiler or contextlib.nullcontext():
            self._fit(progress)

    def _fit(self, progress: Progress) -> None:
        try:
            while not self.finished:
                if self._train_epoch(progress):
                    break  # stopped: the epoch's end is the resumed run's to do
                if not self._end_epoch(progress):
                    self._stop_in_evaluation()
                    break
                if self._keep_step_saved and self.checkpointer.last_saved_step != self.state.step:
                    self._check_state_finite(self.state.step)  # one of the best: its checkpoint is kept
                    self.checkpointer.save(self.state.step, self, force=True)
                if self.pruned_at_epoch is not None or self.state.stopped_early:
                    # Where a trial was pruned or training stopped early, the run ends with a checkpoint
                    # (a run again finds it finished), then its summary.
                    self._check_state_finite(self.state.step)
                    wanted = self.pruned_at_epoch is not None or self.checkpointer.at_end
                    if wanted and self.checkpointer.last_saved_step != self.state.step:
                        self.checkpointer.save(self.state.step, self, force=True)
                    break
            self.control.close()  # the last background save is committed, no exchange left in flight
            if self.stopped_at_step is None:  # what model.pt will hold (an overflow in the last update)
                self._check_state_finite(self.state.step)
                if self.pruned_at_epoch is None:
                    self._test_at_end(progress)
        finally:
            self.train_data.close()  # a stopped run leaves a next epoch it had started to read
            progress.close()

    @property
    def finished(self) -> bool:
        """The budget is spent and no epoch end is owed. A run resumed in the middle of an epoch,
        or right after its last batch, still owes that epoch its end (its loss, evaluation)."""
        return (self.state.step >= self.total_steps or bool(self.state.stopped_early)) and not self.state.mid_epoch

    @property
    def stopped_at_step(self) -> int | None:
        return self.control.stopped_at_step

    def _train_epoch(self, progress: Progress) -> bool:
        """The rest of the current epoch, one accumulation window per optimizer step, until the
        epoch or the budget ends. True when the ranks agreed to stop."""
        start, self.start_batch = self.start_batch, 0
        num_batches, accum = len(self.train_data), self.s.grad_accum_steps
        # Another epoch follows this one unless the budget ends in it (a stop may still end the run).
        next_epoch_follows = self.state.step + math.ceil((num_batches - start) / accum) < self.total_steps
        self.train_data.set_epoch(self.state.epoch, start_batch=start, read_ahead=next_epoch_follows)
        if start == 0:  # resumed mid-epoch: the epoch's sums so far came from the checkpoint
            self.train_loss.reset()
            self.train_metrics.reset()
        self.model.train()
        batches = iter(self.train_data)
        self._t_last = self._sync_time()
        for first in range(start, num_batches, accum):
            if self.state.step >= self.total_steps or self.state.stopped_early:
                break  # the budget ends inside this epoch (or a finished run was run again)
            size = min(accum, num_batches - first)  # the last window of an epoch may be short
            self._train_window(itertools.islice(batches, size), size)
            self._count_samples(first, size)
            if self._after_step(progress, epoch_ends=first + size >= num_batches):
                return True
        return False

    def _train_window(self, micro_batches: Iterator[Any], size: int) -> None:
        """One optimizer step over `size` micro-batches; gradients are synchronised once, on the last."""
        losses = []
        beat = self.beat
        beat.mark("waiting for data")
        for j, batch in enumerate(micro_batches):
            beat.mark("forward")
            batch = to_device(batch, self.env.device)
            sync = contextlib.nullcontext() if j == size - 1 else self.strategy.no_sync(self.model)
            with sync:
                loss, count = self._forward_loss(batch, self.train_metrics)
                beat.mark("backward")
                self.precision.backward(self.nonfinite.watch(loss / size if size > 1 else loss))
            losses.append((loss, count))
            beat.mark("waiting for data")
        beat.mark("the optimizer step")
        grad_norm = None
        if self.s.grad_clip_norm is not None:
            self.precision.unscale(self.optimizer)  # clip the true gradients, not the fp16-scaled ones
            grad_norm = self.strategy.clip_grad_norm(self.model, self.s.grad_clip_norm)
        stepped = False
        if self.nonfinite.step_is_finite(self.model, grad_norm):
            for loss, count in losses:
                self.train_loss.update(loss, count)
            self.checkpointer.wait_staged()  # an asynchronous save's copy of what the step changes
            stepped = self.precision.step(self.optimizer)
        elif self.nonfinite.stops:
            self._stop_nonfinite(self.state.step + 1, "the loss or its gradients are not finite (NaN or inf)")
        else:
            self.precision.skip()
            self._skip_nonfinite(self.state.step + 1)
        if self.model_state_bytes is None and stepped:
            # Measured once, when parameters, gradients and optimizer state all exist.
            self.model_state_bytes = self.strategy.model_state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        # A step skipped for overflowed fp16 gradients (on every rank alike) still counts: the LR
        # schedule, the position and the budget advance with it, as in torch's AMP recipe.
        if stepped:
            self.schedule.step()
        else:  # without torch's warning that the scheduler stepped before the optimizer
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()`")
                self.schedule.step()
        self.state.step += 1

    def _count_samples(self, first: int, size: int) -> None:
        """The epoch's position after batches [first, first + size), in samples over all ranks."""
        used = self.train_data.samples_after(first + size)
        self._step_samples = used - self.train_data.samples_after(first)
        self.state.samples_in_epoch = used
        self.state.samples_seen += self._step_samples

    def _after_step(self, progress: Progress, epoch_ends: bool = False) -> bool:
        """Timing, logging, an evaluation within the epoch when one is due, the stop agreement and
        checkpoints. True when the run must stop here. epoch_ends: the epoch's last step (its
        end evaluates)."""
        now = self._sync_time()
        if self.profiler is not None:
            self.profiler.step()
        self.step_times.append(now - self._t_last)
        self.beat.stepped(self.state.step)
        if self.first_step_s is None:
            self._first_step(now - self._t_last)
        self.state.train_seconds += now - self._t_last
        self._t_last = now
        step = self.state.step
        last = step >= self.total_steps
        if step % self.s.log_every_n_steps == 0 or last:
            self._log_step(progress)
        keep = False
        # Not where the epoch's end evaluates anyway (always after the last step).
        epoch_end_evaluates = last or (epoch_ends and self._epoch_end_evaluates())
        if self.eval_interval and step % self.eval_interval == 0 and not epoch_end_evaluates:
            # Before the step's checkpoint, which then holds this evaluation (and what it decided).
            keep = self._evaluate_within_epoch(progress)
            last = last or bool(self.state.stopped_early)
        stop = self.control.should_stop(step, last)
        if not (stop or keep or self.checkpointer.is_due(step, last)):
            return stop
        self.beat.mark("saving a checkpoint")
        self._check_state_finite(step)
        # Saved at the step boundary, before any end-of-epoch work: a resumed run continues from
        # this exact sample, as if it had never stopped.
        self.checkpointer.save(step, self, last=last, force=True, later=self._changed_by_optimizer_steps())
        self.beat.mark("after a checkpoint")
        self._t_last = self._sync_time()  # a checkpoint save is not a training step
        return stop

    def _changed_by_optimizer_steps(self) -> frozenset[int]:
        """Where this rank's parameters and optimizer state are (data_ptr): only an optimizer step
        changes them, so an asynchronous save copies them while the next step's forward and
        backward run (_train_window waits for the copy before it steps). A forward may change the
        buffers: those are copied before the save returns."""
        tensors = self.strategy.local_state_tensors(self.model, self.optimizer)
        return frozenset(t.data_ptr() for t in tensors if not isinstance(t, DTensor))

    def _check_state_finite(self, step: int) -> None:
        """Before a checkpoint (or model.pt) is written from it: the state must be finite (an
        update from finite gradients can still overflow). Collective."""
        if not self.nonfinite.state_is_finite(self.strategy.local_state_tensors(self.model, self.optimizer)):
            self._stop_nonfinite(step, "the parameters or the optimizer state are not finite (NaN or inf)")

    def _stop_nonfinite(self, step: int, what: str) -> NoReturn:
        """trainer.on_nonfinite=stop (or a state no skip can mend): every rank is here, at the same step."""
        self.optimizer.zero_grad(set_to_none=True)
        self.control.close()  # a background save of an earlier, finite step is committed
        newest = committed(self.checkpointer.root)[:1]
        kept = "it has no checkpoint"
        if newest:
            kept = f"its newest checkpoint, {newest[0].name}, holds the last finite state"
        raise TrainingFailed(
            f"training diverged: {what} at step {step} (trainer.on_nonfinite={self.nonfinite.mode.value}); the run "
            f"stopped there and {kept}: lower optimizer.lr, set trainer.grad_clip_norm, or leave such steps out "
            "with trainer.on_nonfinite=skip"
        )

    def _skip_nonfinite(self, step: int) -> None:
        """trainer.on_nonfinite=skip: the step is left out (no update); said on the first and every
        tenfold one, counted in summary.json."""
        self.nonfinite.skipped += 1
        n = self.nonfinite.skipped
        if self.env.is_main and (n == 1 or math.log10(n).is_integer()):
            print(
                f"dtf: warning: step {step}: the loss or its gradients are not finite (NaN or inf); the step is "
                f"skipped (trainer.on_nonfinite=skip), {n} so far",
                flush=True,
            )

    def _first_step(self, seconds: float) -> None:
        """Compilation happens in the first step: its time and what it compiled, in one line."""
        self.first_step_s = seconds
        if self.membership_change is not None:  # the first step on the new world size: what the change cost
            self.state.membership_changes.append(elastic.complete(self.membership_change, time.time()))
        if not self.s.compile:
            return
        self.compiled_graphs = compiled_graphs()
        if self.env.is_main:
            print(
                f"dtf: first step {seconds:.3g} s (includes compilation: {self.compiled_graphs} graph(s), "
                f"trainer.compile={str(self.s.compile).lower()})",
                flush=True,
            )

    def _end_epoch(self, progress: Progress) -> bool:
        """The epoch's figures over all ranks: its training loss (and metrics), and an evaluation
        when one is due (always after the last epoch). False when a stop signal abandoned the
        evaluation: the state is left as it was, and the resumed run ends the epoch."""
        st = self.state
        self.beat.mark("the epoch's end")
        train_loss = self.train_loss.compute()
        figures: dict[str, float] = {"train/loss": train_loss}
        figures.update({f"train/{k}": v for k, v in self.train_metrics.compute().items()})
        done = st.step >= self.total_steps or bool(st.stopped_early)
        evaluated: dict[str, float] | None = None
        if st.evaluations and st.evaluations[-1]["step"] == st.step:
            evaluated = {k: v for k, v in st.evaluations[-1].items() if "/" in k}  # evaluated at this step already
        elif self.eval_data is not None and (done or self._epoch_end_evaluates()):
            evaluated = self._evaluated(self.eval_data, self.eval_split, stoppable=True)
            if evaluated is None:
                return False
        st.epoch += 1
        st.samples_in_epoch = 0
        st.last_train_loss = train_loss
        st.train_loss_curve.append(train_loss)
        if evaluated is not None:
            self._record_evaluation(evaluated, logged=False)
            figures.update(evaluated)
        st.metrics_per_epoch.append({"epoch": st.epoch, **figures})
        progress.write(f"epoch {st.epoch}: {describe(figures)} (all ranks)")
        # train/epoch_loss: the name TensorBoard logs have always had for it
        self.loggers.scalars(st.step, {"train/epoch_loss" if k == "train/loss" else k: v for k, v in figures.items()})
        self._judge(figures, progress)
        if self.pruning is not None and not done and self.pruning.should_prune(st.epoch, figures):
            self.pruned_at_epoch = st.epoch
            progress.write(f"epoch {st.epoch}: pruned by the search (hydra.sweeper.pruner)")
        return True

    def _epoch_end_evaluates(self) -> bool:
        """The current epoch's end is one trainer.eval_every_n_epochs asks for (every epoch's, for
        a fraction of one)."""
        every = self.s.eval_every_epochs()
        return every is None or (self.state.epoch + 1) % every == 0

    def _evaluate_within_epoch(self, progress: Progress) -> bool:
        """An evaluation between two steps of an epoch (trainer.eval_every_n_steps, or a fraction of
        an epoch), judged. It is not stoppable: a stop agreed meanwhile takes effect right after
        it. True when its step's checkpoint must be kept (one of the best, with checkpoint.keep_best)."""
        assert self.eval_data is not None
        figures = self._evaluated(self.eval_data, self.eval_split, stoppable=False)
        assert figures is not None
        self._record_evaluation(figures, logged=True)
        progress.write(f"step {self.state.step}: {describe(figures)} (all ranks)")
        return self._judge(figures, progress)

    def _evaluated(self, data: EvalData, split: str, stoppable: bool) -> dict[str, float] | None:
        """Figures of one split ("val/loss", "val/<metric>", ...), or None when a stop abandoned them."""
        result = self.evaluate(data, stoppable=stoppable)
        if result is None:
            return None
        loss, metrics = result
        return {f"{split}/loss": loss, **{f"{split}/{k}": v for k, v in metrics.items()}}

    def _record_evaluation(self, figures: dict[str, float], logged: bool) -> None:
        """Kept in the state (summary.json's evaluations), with the epochs done so far (fractional)."""
        st = self.state
        done = st.epoch + (st.samples_in_epoch / max(1, self.train_data.samples_after(len(self.train_data))))
        if st.evaluations and st.evaluations[-1]["step"] == st.step:
            return
        st.evaluations.append({"step": st.step, "epoch": round(done, 6), **figures})
        if self.eval_split == "test":
            st.last_test_loss = figures["test/loss"]
            st.test_loss_curve.append(figures["test/loss"])
        if logged:
            self.loggers.scalars(st.step, figures)

    def _judge(self, figures: dict[str, float], progress: Progress) -> bool:
        """The objective in figures, judged (best so far, early stopping); the best weights and
        checkpoints kept with checkpoint.keep_best. True when this step's checkpoint is one to keep."""
        verdict = self.selection.judge(self.state.step, figures)
        if verdict is None:
            return False
        kept = self._rank_checkpoint(verdict.value)
        if verdict.improved and self.best_model_path is not None:
            self._save_best_model()
        if verdict.stop_reason:
            progress.write(f"step {self.state.step}: {verdict.stop_reason}")
        return kept

    def _rank_checkpoint(self, value: float) -> bool:
        """checkpoint.keep_best: this step's score among the others'; the checkpointer keeps the
        best k. True when this step is one of them (its checkpoint must exist)."""
        k = self.checkpointer.keep_best
        self._keep_step_saved = False
        if not k:
            return False
        scores = self.state.best_scores
        scores.append([self.state.step, value])
        scores.sort(key=lambda sv: -sv[1] if self.selection.maximize else sv[1])  # stable: earlier steps first
        del scores[k:]
        self.checkpointer.keep_steps(self.selection.objective, scores)
        self._keep_step_saved = any(step == self.state.step for step, _ in scores)
        return self._keep_step_saved

    def _save_best_model(self) -> None:
        """<run_dir>/best_model.pt: the whole weights now (collective; rank 0 writes)."""
        assert self.best_model_path is not None
        self.beat.mark("saving the best model")
        state = {name: t.detach().cpu() for name, t in self.strategy.whole_tensors(self.model)}
        if self.env.is_main:
            ordered = {name: state[name] for name in self.strategy.state_names(self.model)}
            tmp = self.best_model_path.with_suffix(".pt.tmp")
            torch.save(ordered, tmp)
            tmp.replace(self.best_model_path)

    def _test_at_end(self, progress: Progress) -> None:
        """With a validation split: the test split, once, at the end (it never chooses anything)."""
        if self.final_test_data is None:
            return
        figures = self._evaluated(self.final_test_data, "test", stoppable=False)
        assert figures is not None
        st = self.state
        st.last_test_loss = figures["test/loss"]
        st.test_loss_curve = [figures["test/loss"]]
        if st.metrics_per_epoch:
            st.metrics_per_epoch[-1].update(figures)
        progress.write(f"test at the end: {describe(figures)} (all ranks)")
        self.loggers.scalars(st.step, figures)

    def _stop_in_evaluation(self) -> None:
        """A stop agreed during the epoch's evaluation: the run stops at the epoch's last step, with
        its checkpoint (unless that step's save was made already, before the evaluation)."""
        step = self.state.step
        self.control.stop_at(step)
        if self.checkpointer.last_saved_step != step:
            self.beat.mark("saving a checkpoint")
            self._check_state_finite(step)
            self.checkpointer.save(step, self, force=True)

    def _forward_loss(self, batch: Any, metrics: Metrics | None) -> tuple[torch.Tensor, int]:
        """The step's loss and how many samples it counts; metrics see what the loss sees."""
        batch = self.precision.convert_batch(batch)
        with self.precision.autocast():
            out = self.step_fn(self.model, batch, metrics.observing(self.loss_fn) if metrics else self.loss_fn)
        if isinstance(out, tuple):
            loss, count = out
            return loss, int(count)
        return out, batch_size_of(batch)

    def _sync_time(self) -> float:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)  # step times must include the queued GPU work
        return time.perf_counter()

    def _log_step(self, progress: Progress) -> None:
        if not self.env.is_main:
            return
        lr = self.optimizer.param_groups[0]["lr"]
        recent = self.step_times[-self.s.log_every_n_steps :]
        rate = self._step_samples / statistics.median(recent) if recent else float("nan")
        local_loss = self.train_loss.local()
        values = {"loss": local_loss, "lr": lr, "samples/s": round(rate)}
        progress.update(self.state.step, self.state.epoch + 1, values)
        self.loggers.scalars(
            self.state.step, {"train/loss_rank0": local_loss, "train/lr": lr, "train/samples_per_sec": rate}
        )

    @torch.no_grad()
    def evaluate(self, data: EvalData, stoppable: bool = False) -> tuple[float, dict[str, float]] | None:
        """Mean loss and the metrics over a split, every sample counted exactly once across ranks.
        stoppable: the ranks check for a stop between batches, and a stop abandons the evaluation
        (None), leaving the random streams as they were before it."""
        rng = rng_state() if stoppable else None  # iterating a DataLoader draws a seed from them
        if stoppable:
            self.control.enter_phase()
        self.model.eval()
        loss_sums = MeanMetric(self.env.device)
        self.metrics.reset()
        self.beat.mark("waiting for evaluation data")
        for j, batch in enumerate(data):
            self.beat.mark("evaluation")
            if rng is not None and j > 0 and self.control.should_stop_evaluating(j):
                self.model.train()
                self.control.enter_phase()
                set_rng_state(rng)
                return None
            batch = to_device(batch, self.env.device)
            real = data.num_real_in_batch(j)
            # Padded samples (only ever at the end of a rank's share) are cut off; a batch that is
            # all padding still runs forward so every rank makes the same collectives, weighed
            # zero and kept out of the metrics.
            if real > 0:
                loss, count = self._forward_loss(take_first(batch, real), self.metrics)
                loss_sums.update(loss, count)
            else:
                self._forward_loss(batch, None)
            self.beat.mark("waiting for evaluation data")
        self.model.train()
        if stoppable:
            self.control.enter_phase()
        return loss_sums.compute(), self.metrics.compute()

    # -- checkpoints -----------------------------------------------------------------------
    def app_state(self) -> dict[str, Any]:
        """Model and optimizer, as the strategy shards them (DCP saves and reshards it)."""
        return self.strategy.state_dict(self.model, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own state: position and curves, the epoch's loss sums over all ranks, the schedule."""
        return {
            "trainer": self.state.state_dict(),
            "epoch_loss": self.train_loss.state_dict(),
            "schedule": self.schedule.state_dict(),
            "train_metrics": self.train_metrics.state_dict(),  # summed or gathered over the ranks
            "precision": self.precision.state_dict(),  # fp16's gradient scaler; {} otherwise
            "nonfinite_steps_skipped": self.nonfinite.skipped,
        }

    def resume_from(self, path: Path) -> None:
        """Continue exactly where the checkpoint at path stopped (collective)."""
        app_state = self.app_state()
        saved, rng, saved_world = self.checkpointer.load(path, app_state)
        self.strategy.load_state_dict(self.model, self.optimizer, app_state)
        if "trainer" not in saved:
            self.state.load_state_dict(saved)  # an older checkpoint: says so in one line
        self.state.load_state_dict(saved["trainer"])
        self.train_loss.load_state_dict(saved["epoch_loss"], holder=self.env.is_main)
        self.train_metrics.load_state_dict(saved.get("train_metrics", {}), holder=self.env.is_main)
        self.precision.load_state_dict(saved.get("precision"))  # older checkpoints have none
        self.nonfinite.skipped = int(saved.get("nonfinite_steps_skipped", 0))
        self.resumed_from_step = self.state.step
        self.resumed_from_world = saved_world
        self.checkpointer.keep_steps(self.selection.objective, self.state.best_scores)
        saved_batch, saved_partitions = self.state.global_batch, self.state.canonical_partitions
        self._record_data_position()
        notes = self._seek(saved_world, saved_batch, saved_partitions)
        self.total_steps = self._planned_steps()
        max_epochs = None if self.s.max_steps is not None else self.s.max_epochs
        self.schedule.resume(saved["schedule"], max_epochs, self.state.step, self.total_steps)
        if rng is not None:
            set_rng_state(rng)
        elif saved_world != self.env.world_size:
            notes.append(
                f"the world size changed ({saved_world} -> {self.env.world_size}): random streams "
                "(dropout, augmentation) restart, so the run will not match an uninterrupted one bit for bit"
            )
        if self.env.is_main:
            for note in notes:
                print(f"dtf: warning: resuming {path}: {note}", flush=True)

    def _seek(self, saved_world: int, saved_batch: int | None = None, saved_partitions: int | None = None) -> list[str]:
        """The batch of the current epoch to start from (TrainData.seek). Returns what the user
        should know about the position."""
        data, used = self.train_data, self.state.samples_in_epoch
        epoch = self.state.epoch + 1
        self.start_batch = start = data.seek(self.state.epoch, used)
        if not used:
            return []
        batch, partitions = self.state.global_batch, self.state.canonical_partitions
        if partitions is not None:  # every canonical partition continues from the row it reached
            if saved_partitions is not None and saved_partitions != partitions:
                return [
                    f"data.canonical_partitions changed ({saved_partitions} -> {partitions}) in the middle of epoch "
                    f"{epoch}: the rest of that epoch is cut differently, so some samples are seen twice and others "
                    "not at all; later epochs are whole"
                ]
            if saved_batch is not None and saved_batch != batch:
                return [
                    f"the global batch changed ({saved_batch} -> {batch}) in the middle of epoch {epoch}: every "
                    f"partition continues from the row it had reached ({used // partitions}), but the batch "
                    "composition differs from there on"
                ]
            return []
        num_batches = len(data)
        seen_twice = used - data.samples_after(start) if start < num_batches else 0
        moved = saved_world != self.env.world_size and not data.position_survives_world_size_change
        if moved and 0 < start < num_batches:
            return [
                f"the world size changed ({saved_world} -> {self.env.world_size}) in the middle of epoch "
                f"{epoch}: this data is read in per-rank shares, so for the rest of that epoch some "
                "samples are seen twice and others not at all; later epochs are whole"
            ]
        if seen_twice:
            return [f"the global batch changed: {seen_twice} samples of epoch {epoch} are seen twice"]
        return []


def show(value: float | None) -> str:
    return "null" if value is None else format(value, ".6g")


def describe(figures: Mapping[str, float | None]) -> str:
    """train/loss 0.1, test/accuracy 0.9 -> "train loss 0.1, test accuracy 0.9"."""
    return ", ".join(f"{name.replace('/', ' ')} {show(value)}" for name, value in figures.items())
