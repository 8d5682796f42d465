"""The generic training loop: the same on every rank, whatever launched it or distributes it."""

from __future__ import annotations

import contextlib
import hashlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from dtf.data.even import batch_size_of, take_first
from dtf.data.loader import EvalData, TrainData
from dtf.dist.env import DistEnv
from dtf.strategy.base import Strategy
from dtf.train.checkpoint import Checkpointer, set_rng_state
from dtf.train.control import StepControl
from dtf.train.logging import Progress, TensorBoard
from dtf.train.metrics import MeanMetric

StepFn = Callable[[nn.Module, Any, Callable[..., torch.Tensor]], Any]


def supervised_step(model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
    """The default step: batch = (inputs, targets); the loss of model(inputs) against targets."""
    inputs, targets = batch
    return loss_fn(model(inputs), targets)


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@dataclass
class TrainerSettings:
    """The subset of the `trainer` config the loop reads (plain values, no OmegaConf)."""

    max_epochs: int
    max_steps: int | None
    grad_accum_steps: int
    grad_clip_norm: float | None
    eval_every_n_epochs: int
    log_every_n_steps: int
    progress: str
    num_warmup_timing_steps: int

    def steps_per_epoch(self, num_batches: int) -> int:
        return math.ceil(num_batches / self.grad_accum_steps)

    def total_steps(self, num_batches: int) -> int:
        """Optimizer steps of the run: max_steps when set, else max_epochs whole epochs."""
        return self.max_steps if self.max_steps is not None else self.max_epochs * self.steps_per_epoch(num_batches)


class Trainer:
    def __init__(
        self,
        settings: TrainerSettings,
        env: DistEnv,
        strategy: Strategy,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LRScheduler | None,
        loss_fn: Callable[..., torch.Tensor],
        step_fn: StepFn,
        train_data: TrainData,
        eval_data: EvalData | None,
        tensorboard: TensorBoard,
        checkpointer: Checkpointer | None = None,
        checkpoint_every_n_steps: int | None = None,
        checkpoint_at_end: bool = False,
        lr_scale: float = 1.0,
        control: StepControl | None = None,
    ) -> None:
        self.s = settings
        self.env = env
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.step_fn = step_fn
        self.train_data = train_data
        self.eval_data = eval_data
        self.tb = tensorboard
        self.checkpointer = checkpointer
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        self.checkpoint_at_end = checkpoint_at_end
        self.lr_scale = lr_scale  # what trainer.lr_scaling multiplied the LR by at this world size
        self.control = control
        self.stopped_at_step: int | None = None  # set when a stop signal ended the run early
        self.save_blocked_s: list[float] = []  # how long each checkpoint held up the training loop
        self.global_step = 0
        self.epoch = 0
        self.start_batch = 0  # > 0 only for a run resumed in the middle of an epoch
        self.resumed_from_step: int | None = None
        self.train_loss = MeanMetric(env.device)
        self.step_times: list[float] = []
        self.train_seconds = 0.0
        self.samples_seen = 0
        self.model_state_bytes: int | None = None
        self.last_train_loss = float("nan")
        self.last_test_loss: float | None = None
        self.train_loss_curve: list[float] = []  # per epoch, all ranks
        self.test_loss_curve: list[float] = []

    # -- sizes -----------------------------------------------------------------------------
    @property
    def total_steps(self) -> int:
        return self.s.total_steps(len(self.train_data))

    # -- the loop --------------------------------------------------------------------------
    def _forward_loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        out = self.step_fn(self.model, batch, self.loss_fn)
        if isinstance(out, tuple):
            loss, count = out
            return loss, int(count)
        return out, batch_size_of(batch)

    def _sync_time(self) -> float:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)  # step times must include the queued GPU work
        return time.perf_counter()

    def fit(self) -> None:
        progress = Progress(self.s.progress, self.total_steps, enabled=self.env.is_main)
        train_loss = self.train_loss
        accum = self.s.grad_accum_steps
        num_batches = len(self.train_data)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            # A run resumed from the last step of an epoch still owes that epoch's end (eval, metrics).
            while self.global_step < self.total_steps or self.start_batch:
                start, self.start_batch = self.start_batch, 0
                self.train_data.set_epoch(self.epoch, start_batch=start)
                self.model.train()
                if start == 0:
                    train_loss.reset()  # resumed mid-epoch: the epoch's sums so far came from the checkpoint
                t_epoch = t_last = self._sync_time()
                for i, batch in enumerate(self.train_data, start=start):
                    batch = to_device(batch, self.env.device)
                    window_start = (i // accum) * accum
                    window = min(accum, num_batches - window_start)  # the last window of an epoch may be short
                    last_in_window = i == window_start + window - 1
                    # Gradients are synchronised once per window: on its last micro-batch.
                    sync = contextlib.nullcontext() if last_in_window else self.strategy.no_sync(self.model)
                    with sync:
                        loss, count = self._forward_loss(batch)
                        (loss / window if window > 1 else loss).backward()
                    train_loss.update(loss, count)
                    self.samples_seen += count
                    if not last_in_window:
                        continue
                    self._optimizer_step()
                    now = self._sync_time()
                    self.step_times.append(now - t_last)
                    t_last = now
                    if self.global_step % self.s.log_every_n_steps == 0 or self.global_step == self.total_steps:
                        self._log_step(progress, train_loss)
                    saves = len(self.save_blocked_s)
                    stop = self._at_step_boundary(batch_in_epoch=i + 1)
                    if len(self.save_blocked_s) > saves:
                        t_last = self._sync_time()  # a checkpoint save is not a training step
                    if stop or self.global_step >= self.total_steps:
                        break
                if self.stopped_at_step is not None:
                    break  # the epoch's end (eval, metrics) is done by the resumed run
                self.train_seconds += t_last - t_epoch
                self.epoch += 1
                self.last_train_loss = train_loss.compute()
                self.train_loss_curve.append(self.last_train_loss)
                line = f"epoch {self.epoch}: train loss {self.last_train_loss:.6g}"
                epoch_metrics = {"train/epoch_loss": self.last_train_loss}
                done = self.global_step >= self.total_steps
                if self.eval_data is not None and (done or self.epoch % self.s.eval_every_n_epochs == 0):
                    self.last_test_loss = self.evaluate()
                    self.test_loss_curve.append(self.last_test_loss)
                    line += f", test loss {self.last_test_loss:.6g}"
                    epoch_metrics["test/loss"] = self.last_test_loss
                progress.write(line + " (all ranks)")
                self.tb.scalars(self.global_step, epoch_metrics)
            if self.checkpointer is not None:
                self.checkpointer.finish()  # the last background save, if any, is committed
            if self.control is not None:
                self.control.close()
        finally:
            progress.close()

    def _at_step_boundary(self, batch_in_epoch: int) -> bool:
        """Checkpoints due at this step, and the stop protocol. True when the run must stop here."""
        ck = self.checkpointer
        agreed = (
            self.control.exchange(self.global_step, ck.upload_step, ck.upload_done()) if self.control and ck else None
        )
        if agreed and ck and agreed.committed_step is not None and agreed.committed_step == ck.upload_step:
            ck.finish()  # every rank has written its part: commit without waiting for anything
        every = self.checkpoint_every_n_steps
        last = self.global_step >= self.total_steps
        due = bool(every and self.global_step % every == 0) or (last and self.checkpoint_at_end)
        stop = agreed is not None and agreed.stop and not last
        if due or stop:
            # Saved at the step boundary, before any end-of-epoch work: a resumed run
            # continues from this exact batch, as if it had never stopped.
            t0 = time.perf_counter()
            self.save_checkpoint(batch_in_epoch)
            self.save_blocked_s.append(time.perf_counter() - t0)
        if stop:
            self.stopped_at_step = self.global_step
        return stop

    def _optimizer_step(self) -> None:
        if self.s.grad_clip_norm is not None:
            self.strategy.clip_grad_norm(self.model, self.s.grad_clip_norm)
        self.optimizer.step()
        if self.model_state_bytes is None:
            # Measured once, when parameters, gradients and optimizer state all exist.
            self.model_state_bytes = self.strategy.model_state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.global_step += 1

    def _log_step(self, progress: Progress, train_loss: MeanMetric) -> None:
        if not self.env.is_main:
            return
        lr = self.optimizer.param_groups[0]["lr"]
        recent = self.step_times[-self.s.log_every_n_steps :]
        global_batch = self.samples_seen / max(1, self.global_step) * self.env.world_size
        rate = global_batch / statistics.median(recent) if recent else float("nan")
        local_loss = train_loss.local()
        progress.update(self.global_step, self.epoch + 1, {"loss": local_loss, "lr": lr, "samples/s": round(rate)})
        self.tb.scalars(
            self.global_step, {"train/loss_rank0": local_loss, "train/lr": lr, "train/samples_per_sec": rate}
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the test set, every sample counted exactly once across ranks."""
        assert self.eval_data is not None
        self.model.eval()
        metric = MeanMetric(self.env.device)
        for j, batch in enumerate(self.eval_data):
            batch = to_device(batch, self.env.device)
            real = self.eval_data.num_real_in_batch(j)
            # Padded samples (only ever at the end of a rank's share) are cut off; a batch that is
            # all padding still runs forward so every rank makes the same collectives.
            loss, _ = self._forward_loss(take_first(batch, real) if real > 0 else batch)
            metric.update(loss, real)
        self.model.train()
        return metric.compute()

    # -- checkpoints -----------------------------------------------------------------------
    def _global_sums(self) -> tuple[float, int, int]:
        """(loss sum, sample count) of the epoch so far and samples seen, over all ranks (a collective)."""
        counts = torch.tensor([self.train_loss.count, self.samples_seen], dtype=torch.float64, device=self.env.device)
        state = torch.cat([self.train_loss.total.reshape(1), counts])
        if dist.is_initialized() and self.env.world_size > 1:
            dist.all_reduce(state)
        loss_sum, count, samples = state.tolist()
        return loss_sum, int(count), int(samples)

    def save_checkpoint(self, batch_in_epoch: int) -> None:
        """Collective. batch_in_epoch: micro-batches of the current epoch already trained on."""
        assert self.checkpointer is not None
        loss_sum, loss_count, samples = self._global_sums()
        trainer_state = {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "batch_in_epoch": batch_in_epoch,
            "samples_per_batch": self.train_data.batch_size * self.env.world_size,
            "epoch_loss_sum": loss_sum,
            "epoch_loss_count": loss_count,
            "samples_seen": samples,
            "train_seconds": self.train_seconds,
            "train_loss_curve": self.train_loss_curve,
            "test_loss_curve": self.test_loss_curve,
            "last_train_loss": self.last_train_loss,
            "last_test_loss": self.last_test_loss,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "lr_scale": self.lr_scale,
        }
        app_state = self.strategy.state_dict(self.model, self.optimizer)
        self.checkpointer.save(self.global_step, app_state, trainer_state)

    def resume_from(self, path: Path) -> None:
        """Continue exactly where the checkpoint at path stopped (collective)."""
        assert self.checkpointer is not None
        app_state = self.strategy.state_dict(self.model, self.optimizer)
        state, rng, saved_world = self.checkpointer.load(path, app_state)
        self.strategy.load_state_dict(self.model, self.optimizer, app_state)
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state["lr_scale"] != self.lr_scale:  # another world size: the saved LRs were scaled for the old one
            self._rescale_lr(self.lr_scale / state["lr_scale"])
        self.global_step = self.resumed_from_step = state["global_step"]
        self.epoch = state["epoch"]
        # The data position is a prefix of the epoch's shuffled order: samples already used, globally.
        consumed = state["batch_in_epoch"] * state["samples_per_batch"]
        per_batch = self.train_data.batch_size * self.env.world_size
        self.start_batch = consumed // per_batch
        notes = []
        mid_epoch = state["batch_in_epoch"] % len(self.train_data) != 0
        if saved_world != self.env.world_size and mid_epoch and not self.train_data.position_survives_world_size_change:
            notes.append(
                f"the world size changed ({saved_world} -> {self.env.world_size}) in the middle of epoch "
                f"{self.epoch + 1}: this data is read in per-rank shares, so for the rest of that epoch some "
                "samples are seen twice and others not at all; later epochs are whole"
            )
        elif consumed % per_batch:
            notes.append(
                f"the global batch changed ({state['samples_per_batch']} -> {per_batch} samples): "
                f"{consumed % per_batch} samples of epoch {self.epoch + 1} are seen twice"
            )
        if rng is not None:
            set_rng_state(rng)
        elif saved_world != self.env.world_size:
            notes.append(
                f"the world size changed ({saved_world} -> {self.env.world_size}): random streams "
                "(dropout, augmentation) restart, so the run will not match an uninterrupted one bit for bit"
            )
        if self.env.is_main:
            self.train_loss.set(state["epoch_loss_sum"], int(state["epoch_loss_count"]))
            self.samples_seen = state["samples_seen"]
            for note in notes:
                print(f"dtf: warning: resuming {path}: {note}", flush=True)
        self.train_seconds = state["train_seconds"]
        self.train_loss_curve = list(state["train_loss_curve"])
        self.test_loss_curve = list(state["test_loss_curve"])
        self.last_train_loss = state["last_train_loss"]
        self.last_test_loss = state["last_test_loss"]

    def _rescale_lr(self, ratio: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
        pending = [self.scheduler] if self.scheduler is not None else []
        while pending:  # the scheduler and, for SequentialLR, the ones it chains
            sched = pending.pop()
            for attr in ("base_lrs", "_last_lr"):
                if hasattr(sched, attr):
                    setattr(sched, attr, [lr * ratio for lr in getattr(sched, attr)])
            pending.extend(getattr(sched, "_schedulers", []))

    # -- results ---------------------------------------------------------------------------
    @staticmethod
    def params_sha256(state: dict[str, torch.Tensor]) -> str:
        """Digest of the full model state (names, dtypes, shapes, values), independent of sharding."""
        h = hashlib.sha256()
        for name in sorted(state):
            t = state[name].detach().cpu().contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    def median_step_time(self) -> float | None:
        skip = min(self.s.num_warmup_timing_steps, len(self.step_times) // 2)
        times = self.step_times[skip:]
        return statistics.median(times) if times else None

    def summary(self, run_dir: Path, full_state: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        """Gathers per-rank figures (a collective) and returns the run summary on rank 0."""
        digest = self.params_sha256(full_state)
        local = {
            "steps": self.global_step,
            "bytes": self.model_state_bytes,
            "digest": digest,
            "samples": self.samples_seen,
        }
        gathered: list[Any] = [local]
        if dist.is_initialized() and self.env.world_size > 1:
            gathered = [None] * self.env.world_size
            dist.all_gather_object(gathered, local)
        if not self.env.is_main:
            return None
        total_samples = sum(g["samples"] for g in gathered)
        digests = {g["digest"] for g in gathered}
        summary: dict[str, Any] = {
            "world_size": self.env.world_size,
            "global_step": self.global_step,
            "epochs": self.epoch,
            "steps_per_rank": [g["steps"] for g in gathered],
            "final_train_loss": self.last_train_loss,
            "final_test_loss": self.last_test_loss,
            "train_loss_per_epoch": self.train_loss_curve,
            "test_loss_per_epoch": self.test_loss_curve,
            "samples_per_sec": total_samples / self.train_seconds if self.train_seconds > 0 else None,
            "step_time_s": self.median_step_time(),
            # Rank 0's view: how long each save held up the loop (all of it, or only the copy when async).
            "checkpoint_blocked_s": statistics.median(self.save_blocked_s) if self.save_blocked_s else None,
            "checkpoints_saved": len(self.save_blocked_s),
            "model_state_bytes": [g["bytes"] for g in gathered],
            "params_sha256": digest,
            # Replicas that disagree would be a bug in a strategy; the summary says so rather than hide it.
            "params_sha256_consistent": len(digests) == 1,
            "samples_seen": total_samples,
            "train_seconds": self.train_seconds,
            "lr_final": self.optimizer.param_groups[0]["lr"],
            "resumed_from_step": self.resumed_from_step,
            "run_dir": str(run_dir),
        }
        return summary
