"""Debugging runs (the `debug` config group, as lightning-hydra-template's): fewer batches of each
split (trainer.limit_train_batches, trainer.limit_eval_batches), the same few batches over and over
(trainer.overfit_batches), and torch.profiler traces (trainer.profiler). Each wraps what the loop
already has, so the loop's logic (positions, budgets, exact evaluation over what is evaluated)
stays the same; every rank keeps the same number of batches."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtf.config.schema import ProfilerConfig, TrainerConfig
from dtf.data.batch import batch_size_of
from dtf.data.interface import DataSplits, EvalData, TrainData
from dtf.dist.env import DistEnv

PROFILE_DIR = "profile"  # in the run dir: one trace per rank, for TensorBoard's profiler plugin or Perfetto


def batches_kept(limit: float | None, num_batches: int) -> int:
    """limit: None (all), a fraction of the batches in (0, 1], or a whole number of batches."""
    if limit is None:
        return num_batches
    if isinstance(limit, float) and limit <= 1.0:
        return max(1, int(limit * num_batches))
    return min(num_batches, int(limit))


class LimitedTrain:
    """The first batches of every epoch of a TrainData (the rest of each epoch is left out)."""

    def __init__(self, inner: TrainData, num_batches: int, key: str) -> None:
        self.inner, self.num_batches, self.key = inner, num_batches, key
        self._start = 0  # the batch the current epoch starts at
        self.batch_size = inner.batch_size
        self.position_survives_world_size_change = inner.position_survives_world_size_change

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.inner), self.num_batches - self._start)

    def set_epoch(self, epoch: int, start_batch: int = 0, read_ahead: bool = False) -> None:
        self._start = start_batch
        self.inner.set_epoch(epoch, start_batch, read_ahead=False)  # its epochs are left before their end

    def close(self) -> None:
        self.inner.close()

    @property
    def num_partitions(self) -> int | None:
        return self.inner.num_partitions

    def seek(self, epoch: int, samples_in_epoch: int) -> int:
        return min(self.num_batches, self.inner.seek(epoch, samples_in_epoch))

    def samples_after(self, num_batches: int) -> int:
        return self.inner.samples_after(min(num_batches, self.num_batches))

    @property
    def num_samples(self) -> int:
        return self.inner.num_samples

    @property
    def num_dropped_per_epoch(self) -> int:
        left_out = self.inner.samples_after(len(self.inner)) - self.inner.samples_after(self.num_batches)
        return self.inner.num_dropped_per_epoch + left_out

    @property
    def num_repeated_per_epoch(self) -> int:
        return self.inner.num_repeated_per_epoch if self.num_batches == len(self.inner) else 0

    def describe(self) -> str:
        return f"{self.inner.describe()}; {self.num_batches} of its {len(self.inner)} batches per epoch ({self.key})"


class Overfit(LimitedTrain):
    """The first num_batches batches of epoch 0, every epoch (trainer.overfit_batches): a model
    that cannot drive their loss towards zero has a bug. The same batches are its evaluation."""

    def __init__(self, inner: TrainData, num_batches: int) -> None:
        super().__init__(inner, num_batches, "trainer.overfit_batches")
        inner.set_epoch(0)
        self.batches = list(itertools.islice(iter(inner), num_batches))
        self._start = 0

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches[self._start :])

    def set_epoch(self, epoch: int, start_batch: int = 0, read_ahead: bool = False) -> None:
        self._start = start_batch


@dataclass
class BatchesEval:
    """Fixed batches as evaluation data (every sample real)."""

    batches: list[Any]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def num_real_in_batch(self, batch_index: int) -> int:
        return batch_size_of(self.batches[batch_index])


@dataclass
class LimitedEval:
    """The first batches of an evaluation split (trainer.limit_eval_batches)."""

    inner: EvalData
    num_batches: int

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.inner), self.num_batches)

    def num_real_in_batch(self, batch_index: int) -> int:
        return self.inner.num_real_in_batch(batch_index)


def limited(splits: DataSplits, t: TrainerConfig) -> DataSplits:
    """The splits as the debug settings keep them (unchanged without any)."""
    train, val, test = splits.train, splits.val, splits.test
    if t.overfit_batches:
        overfit = Overfit(train, min(t.overfit_batches, len(train)))
        return DataSplits(overfit, BatchesEval(overfit.batches), test and _limited_eval(test, t))
    if t.limit_train_batches is not None:
        train = LimitedTrain(train, batches_kept(t.limit_train_batches, len(train)), "trainer.limit_train_batches")
    return DataSplits(train, val and _limited_eval(val, t), test and _limited_eval(test, t))


def _limited_eval(data: EvalData, t: TrainerConfig) -> EvalData:
    if t.limit_eval_batches is None:
        return data
    return LimitedEval(data, batches_kept(t.limit_eval_batches, len(data)))


def profiler(cfg: ProfilerConfig, run_dir: Path, env: DistEnv) -> torch.profiler.profile | None:
    """trainer.profiler: optimizer steps wait, warmup, active (once), traced into <run_dir>/profile
    as Chrome trace JSON, one file per rank (TensorBoard's profiler plugin and Perfetto read it)."""
    if not cfg.enabled:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if env.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            str(run_dir / PROFILE_DIR), worker_name=f"rank{env.rank}"
        ),
        record_shapes=cfg.record_shapes,
        profile_memory=cfg.profile_memory,
    )
