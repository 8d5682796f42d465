"""The generic training loop: the same on every rank, whatever launched it or distributes it."""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dtf import elastic
from dtf.config.schema import TrainerConfig
from dtf.data.batch import to_device
from dtf.data.interface import TrainData
from dtf.dist.env import DistEnv
from dtf.errors import TrainingFailed
from dtf.heartbeat import Heartbeat
from dtf.strategy.base import Strategy
from dtf.train import position
from dtf.train.blocks import compiled_graphs
from dtf.train.checkpoint import LocalCopies, committed
from dtf.train.checkpoint_store import Where
from dtf.train.control import StepControl
from dtf.train.forward import Forward
from dtf.train.loggers import Loggers
from dtf.train.metrics import MeanMetric, Metrics
from dtf.train.nonfinite import NonFiniteGuard
from dtf.train.progress import Progress
from dtf.train.rng import set_rng_state
from dtf.train.schedule import LRSchedule, Plan
from dtf.train.state import TrainState
from dtf.train.validator import Validator, describe

NOT_FINITE = "the loss or its gradients are not finite (NaN or inf)"


class Trainer:
    """One rank's loop. Its own state (TrainState, the epoch's loss sums, the LR schedule) is what
    state_dict() returns; app_state() is the strategy's (model and optimizer, sharded as trained).
    Evaluating, judging and keeping the best are the validator's; it shares the TrainState."""

    def __init__(
        self,
        settings: TrainerConfig,
        env: DistEnv,
        strategy: Strategy,
        model: nn.Module,
        optimizer: Optimizer,
        schedule: LRSchedule,
        forward: Forward,
        train_data: TrainData,
        train_metrics: Metrics,
        validator: Validator,
        loggers: Loggers,
        control: StepControl,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self.s = settings
        self.env = env
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.schedule = schedule
        self.forward = forward
        self.precision = forward.precision
        self.train_data = train_data
        self.train_metrics = train_metrics  # on the current epoch's training batches (none unless asked)
        self.validator = validator
        self.state: TrainState = validator.state
        self.loggers = loggers  # rank 0's (none elsewhere)
        self.control = control
        self.checkpointer = control.checkpointer  # the stop agreement also commits its background saves
        self.nonfinite = NonFiniteGuard(settings.on_nonfinite, strategy, self.precision, env, optimizer)
        # Told of every optimizer step (trainer.profiler's schedule, for one).
        self.step_hooks: list[Callable[[], Any]] = []
        self._record_data_position()
        self.train_loss = MeanMetric(env.device)  # the current epoch's, this rank's samples
        self.start_batch = 0  # where the next epoch begins (> 0 only for a run resumed mid-epoch)
        self.resumed_from_step: int | None = None
        self.model_state_estimate_bytes: int | None = None  # trainer.memory_check's (dtf.memory)
        self.step_times: list[float] = []
        self.beat = heartbeat or Heartbeat(None, env.rank, 0)  # what this rank does, for the driver
        self.beat.step_times = self.step_times
        self.first_step_s: float | None = None  # this process's first step (with trainer.compile: compilation)
        self.resume_s: float | None = None  # summary.json's resume_s (dtf.train.loop.build)
        self.resumed_from_world: int | None = None  # the world size of the checkpoint it resumed from
        # A change of the world size since that checkpoint, completed and recorded at the first step.
        self.membership_change: dict[str, Any] | None = None
        self.strategy_choice: dict[str, Any] | None = None  # strategy=auto's (summary.json's strategy_choice)
        self.compiled_graphs: int | None = None
        self.model_state_bytes: int | None = None
        self._step_samples = 0  # samples of the latest optimizer step, over all ranks
        self._t_last = 0.0
        self._queued_end: torch.cuda.Event | None = None  # _sync_time's, on a GPU
        self.total_steps = self._planned_steps()
        self.schedule.start(Plan(self.total_steps, settings.steps_per_epoch(len(train_data))))

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
        v, step = self.validator, lambda: self.state.step
        try:
            while not self.finished:
                if self._train_epoch(progress):
                    break  # stopped: the epoch's end is the resumed run's to do
                if not self._end_epoch(progress):  # a stop agreed during the epoch's evaluation
                    self.control.stop_at(step())
                    self._save(step())  # unless that step's save was made already, before the evaluation
                    break
                if v.keep_step_saved:
                    self._save(step())  # one of the best: its checkpoint is kept
                if v.pruned_at_epoch is not None or self.state.stopped_early:
                    # Where a trial was pruned or training stopped early, the run ends with a checkpoint
                    # (a run again finds it finished), then its summary.
                    if v.pruned_at_epoch is not None or self.checkpointer.at_end:
                        self._save(step())
                    break  # the state is checked finite below, as at every end
            self.control.close()  # the last background save is committed, no exchange left in flight
            if self.stopped_at_step is None:  # what model.pt will hold (an overflow in the last update)
                self._check_state_finite(step())
                if v.pruned_at_epoch is None:
                    v.test_at_end(self.model, progress)
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
                loss, count = self.forward(self.model, batch, self.train_metrics)
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
        if self.nonfinite.defers:  # a GPU: the optimizer leaves out a step that is not finite, on the device
            self.nonfinite.hand_to_optimizer(self.model, grad_norm, self.optimizer, self.state.step + 1, losses)
            self._settle_nonfinite(keep_latest=True)  # the step before's verdict, before this update applies
            self.checkpointer.wait_staged()
            stepped = self.precision.step(self.optimizer)
        elif self.nonfinite.step_is_finite(self.model, grad_norm):
            for loss, count in losses:
                self.train_loss.update(loss, count)
            self.checkpointer.wait_staged()  # an asynchronous save's copy of what the step changes
            stepped = self.precision.step(self.optimizer)
        elif self.nonfinite.stops:
            self._stop_nonfinite(self.state.step + 1, NOT_FINITE)
        else:
            self.precision.skip()
            self.nonfinite.count_skip(self.state.step + 1)
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
        for hook in self.step_hooks:
            hook()
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
        if self.validator.should_validate(step, last, epoch_ends, lambda: self._epochs_done() - self.state.epoch):
            self._settle_nonfinite()
            # Before the step's checkpoint, which then holds this evaluation (and what it decided).
            keep = self.validator.validate(self.model, progress, self._epochs_done())
            last = last or bool(self.state.stopped_early)
        stop = self.control.should_stop(step, last)
        if not (stop or keep or self.checkpointer.is_due(step, last)):
            return stop
        # Saved at the step boundary, before any end-of-epoch work: a resumed run continues from
        # this exact sample, as if it had never stopped.
        self._save(step, last=last, later=self._changed_by_optimizer_steps())
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

    def _save(self, step: int, last: bool = False, later: frozenset[int] = frozenset()) -> None:
        """The checkpoint of this step, unless it has one already, from a state checked finite
        first (collective). last, later: as Checkpointer.save's."""
        if self.checkpointer.last_saved_step == step:
            return
        self.beat.mark("saving a checkpoint")
        self._settle_nonfinite()
        self._check_state_finite(step)
        self.checkpointer.save(step, self, last=last, force=True, later=later)

    def _settle_nonfinite(self, keep_latest: bool = False) -> None:
        """The deferred verdicts (a GPU, nonfinite.defers): a finite step's losses count; one that
        was not finite (the optimizer left it out) stops the run there, or is counted as skipped."""
        for step, finite, losses in self.nonfinite.verdicts(keep_latest):
            if finite:
                for loss, count in losses:
                    self.train_loss.update(loss, count)
            elif self.nonfinite.stops:
                self._stop_nonfinite(step, NOT_FINITE)
            else:
                self.nonfinite.count_skip(step)

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
        self._settle_nonfinite()
        train_loss = self.train_loss.compute()
        figures: dict[str, float] = {"train/loss": train_loss}
        figures.update({f"train/{k}": v for k, v in self.train_metrics.compute().items()})
        done = st.step >= self.total_steps or bool(st.stopped_early)
        completed, evaluated = self.validator.at_epoch_end(self.model, done)
        if not completed:
            return False
        st.epoch += 1
        st.samples_in_epoch = 0
        st.last_train_loss = train_loss
        st.train_loss_curve.append(train_loss)
        if evaluated:
            self.validator.record(evaluated, self._epochs_done(), logged=False)
            figures.update(evaluated)
        st.metrics_per_epoch.append({"epoch": st.epoch, **figures})
        progress.write(f"epoch {st.epoch}: {describe(figures)} (all ranks)")
        # train/epoch_loss: the name TensorBoard logs have always had for it
        self.loggers.scalars(st.step, {"train/epoch_loss" if k == "train/loss" else k: v for k, v in figures.items()})
        self.validator.judge(self.model, figures, progress)
        if not done:
            self.validator.prune(figures, progress)
        return True

    def _epochs_done(self) -> float:
        """The epochs done so far, a fraction of the current one included."""
        st = self.state
        return st.epoch + st.samples_in_epoch / max(1, self.train_data.samples_after(len(self.train_data)))

    def _sync_time(self) -> float:
        """Now, for step times, which must include the GPU's work: once the device has finished
        the work queued before the previous call (its event), not the work queued since, so that
        the host never waits for an empty queue (one step may stand queued ahead)."""
        if self.env.device.type == "cuda":
            done, self._queued_end = self._queued_end, torch.cuda.Event()
            self._queued_end.record()
            if done is not None:
                done.synchronize()
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

    def resume_from(self, path: Where, copies: LocalCopies | None = None) -> None:
        """Continue exactly where the checkpoint at path stopped (collective); copies: this rank's
        checked copies of files of a remote checkpoint, read instead."""
        app_state = self.app_state()
        saved, rng, saved_world = self.checkpointer.load(path, app_state, copies)
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
        self.checkpointer.keep_steps(self.validator.selection.objective, self.state.best_scores)
        saved_batch, saved_partitions = self.state.global_batch, self.state.canonical_partitions
        self._record_data_position()
        self.start_batch, notes = position.resume_at(
            self.train_data, self.state, self.env.world_size, saved_world, saved_batch, saved_partitions
        )
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
