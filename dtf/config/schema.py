"""Structured-config schemas for the parts of a run that dtf owns.

Each option YAML in `conf/<group>/` starts from one of these (via its defaults list),
so a misspelled key or a wrong type fails when Hydra composes the config, before any
process starts. Each checks its own values in __post_init__, which runs when the composed
section becomes the dataclass its component receives (dtf.config.typed); rules that span
sections or look at the machine are the driver's pre-flight (dtf.preflight). What users own
(model, optimizer, loss, scheduler, dataset) stays free-form and is built by `_target_`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING

from dtf.errors import UserError, require
from dtf.signals import STOPPABLE_SIGNALS

# trainer.precision: 32 (fp32), *-mixed (autocast around forward and loss; fp16 adds a gradient
# scaler), bf16-true (the parameters themselves in bf16). dtf.train.precision gives them effect.
PRECISIONS = ("32", "bf16-mixed", "fp16-mixed", "bf16-true")
# trainer.compile: no, the whole model, or each block (the modules FSDP shards as units).
COMPILE_MODES = (False, True, "blocks")
BACKENDS = ("auto", "gloo", "nccl", "mpi")
DEVICES = ("auto", "cpu", "cuda")
# data.feature_dtype: the dtype features (and float labels) arrive in; auto = torch's default dtype,
# the one the model's parameters are created in unless it says otherwise.
FEATURE_DTYPES = ("auto", "float32", "float64", "float16", "bfloat16")


class LRScaling(str, Enum):
    """How the optimizer's learning rate grows with the number of ranks (Goyal et al.)."""

    none = "none"
    linear = "linear"
    sqrt = "sqrt"


class ObjectiveMode(str, Enum):
    min = "min"
    max = "max"


class MemoryCheck(str, Enum):
    """trainer.memory_check: what to do when the model's state cannot fit (dtf.memory)."""

    refuse = "refuse"  # stop before the run starts, in one line
    warn = "warn"  # say so, and run anyway
    off = "off"


class NonFinite(str, Enum):
    """trainer.on_nonfinite: a step whose loss or gradients are not finite (dtf.train.nonfinite)."""

    stop = "stop"  # end the run at that step, in one line naming it (exit status 1)
    skip = "skip"  # leave the step out (no update) and count it
    ignore = "ignore"  # train on (no check)


class Progress(str, Enum):
    auto = "auto"  # a bar on a TTY, plain lines otherwise
    bar = "bar"
    lines = "lines"
    off = "off"


@dataclass
class TrainerConfig:
    max_epochs: int = 10
    # Stop after this many optimizer steps (overrides max_epochs when set).
    max_steps: int | None = None
    grad_accum_steps: int = 1
    grad_clip_norm: float | None = None
    lr_scaling: LRScaling = LRScaling.linear
    warmup_steps: int = 0
    # null: start the warm-up at the single-rank LR (1/scale); see docs.
    warmup_start_factor: float | None = None
    seed: int = 0
    deterministic: bool = False
    # Evaluate on the validation split (the test split where there is none) every n epochs: a
    # whole number, or a fraction of an epoch below 1 (0.25: four times an epoch); and always at
    # the end of training. eval_every_n_steps adds evaluations every n optimizer steps.
    eval_every_n_epochs: float = 1
    eval_every_n_steps: int | None = None
    # What the run is judged by (summary.json's objective; sweeps, pruning, early stopping and the
    # best checkpoint compare by it): <split>/loss or <split>/<metric> of a configured metric, split
    # val, test or train (e.g. val/accuracy). auto: val/loss where the data has a validation
    # split, else test/loss (the start line warns: choosing on the test set biases its score), else
    # train/loss. With a validation split, the test split is evaluated once, at the end.
    # A list of names (str each) only in a hydra/sweeper=dtf sweep of several objectives
    # (hydra.sweeper.direction a list): its trials are judged by the first, and the sweep reads the others.
    objective: Any = "auto"
    objective_mode: ObjectiveMode = ObjectiveMode.min  # max for accuracy-like objectives
    # Also compute the metrics on the training batches (an update per micro-batch); by default
    # metrics are computed at evaluation only.
    train_metrics: bool = False
    log_every_n_steps: int = 50
    progress: Progress = Progress.auto
    tensorboard: bool = True
    # Write <run_dir>/model.pt (full state dict, rank 0) at the end.
    export_weights: bool = True
    device: str = "auto"
    dist_backend: str = "auto"
    dist_timeout_s: float = 1800.0
    # A user step function by _target_ (with _partial_: true): (model, batch, loss_fn) -> loss.
    step_fn: Any = None
    # trainer=function: your own training function by _target_ (with _partial_: true), called on
    # every rank as fn(module, hparams, train_set, test_set) -> float | dict (dtf.train.function).
    # The loop's settings above do not apply to it; seed, device and objective do.
    fn: Any = None
    # What the function gets as hparams (trainer=function).
    hparams: dict[str, Any] = field(default_factory=dict)
    # Steps left out of the median step time (start-up, allocator warm-up).
    num_warmup_timing_steps: int = 5
    # The same switches for every strategy (dtf.train.precision, dtf.train.blocks):
    # 32, bf16-mixed, fp16-mixed (autocast; fp16 with a gradient scaler) or bf16-true (bf16 parameters).
    precision: str = "32"
    # false, true (torch.compile the model) or blocks (compile each block, as FSDP shards them).
    compile: bool | str = False
    # The modules whose activations are recomputed in backward instead of stored: their class
    # names (e.g. [TransformerEncoderLayer]), or blocks (the model's blocks, as the strategy shards
    # them: model=hf's from transformers' _no_split_modules); null: none.
    # (Any: OmegaConf types no union of a list and a string; __post_init__ checks it.)
    activation_checkpointing: Any = None
    # Before the model is built: the bytes of model state (parameters, gradients, optimizer state)
    # each rank will hold, by the strategy's ZeRO formula, against this node's free memory (the
    # GPU's on CUDA). refuse: stop with one line when they cannot fit; warn: say so and run.
    memory_check: MemoryCheck = MemoryCheck.refuse
    # A step whose loss or gradients are NaN or inf: stop (end the run there, naming the step; no
    # checkpoint or model.pt is written from a non-finite state), skip (no update; counted in
    # summary.json's nonfinite_steps_skipped) or ignore (train on).
    on_nonfinite: NonFinite = NonFinite.stop
    # A run none of whose ranks makes progress for this long is stalled: the driver names the
    # rank(s) that got the least far and kills them (dtf.launch.stalls). null: the larger of 300 s
    # and 50 median step times. Start-up, the first step and checkpoint saves get dist_timeout_s.
    stall_timeout_s: float | None = None
    # End training when the objective has not improved for `patience` evaluations.
    early_stopping: EarlyStoppingConfig = field(default_factory=lambda: EarlyStoppingConfig())
    # Debugging (the debug config group sets them): train on the first batches of each epoch and
    # evaluate the first batches of each split (null: all; a fraction in (0, 1] or a number of
    # batches); train and evaluate on the same first n batches every epoch; torch.profiler traces.
    limit_train_batches: Any = None
    limit_eval_batches: Any = None
    overfit_batches: int = 0
    profiler: ProfilerConfig = field(default_factory=lambda: ProfilerConfig())

    def __post_init__(self) -> None:
        self._check_performance_switches()
        self._check_debug_settings()
        require(self.max_epochs >= 1, "trainer.max_epochs", self.max_epochs, "train at least one epoch")
        require(
            self.max_steps is None or self.max_steps >= 1,
            "trainer.max_steps",
            self.max_steps,
            "use a positive number, or null to train max_epochs",
        )
        require(
            self.grad_accum_steps >= 1,
            "trainer.grad_accum_steps",
            self.grad_accum_steps,
            "use 1 (no accumulation) or more",
        )
        require(
            self.grad_clip_norm is None or self.grad_clip_norm > 0,
            "trainer.grad_clip_norm",
            self.grad_clip_norm,
            "use a positive norm, or null for no clipping",
        )
        require(self.warmup_steps >= 0, "trainer.warmup_steps", self.warmup_steps, "use 0 (no warm-up) or more")
        require(
            self.warmup_start_factor is None or 0 < self.warmup_start_factor <= 1,
            "trainer.warmup_start_factor",
            self.warmup_start_factor,
            "use a factor in (0, 1], or null for the default",
        )
        require(
            isinstance(self.objective, str),
            "trainer.objective",
            self.objective,
            "a run is judged by one objective: name one (a list of several is for a hydra/sweeper=dtf sweep with a "
            "list hydra.sweeper.direction, which judges each trial by the first)",
        )
        split, _, name = self.objective.partition("/")
        require(
            self.objective == "auto" or (split in ("val", "test", "train") and bool(name)),
            "trainer.objective",
            self.objective,
            "name a split and a value: val/loss, test/loss, train/loss or <split>/<metric>, e.g. val/accuracy; or auto",
        )
        require(self.log_every_n_steps >= 1, "trainer.log_every_n_steps", self.log_every_n_steps, "use 1 or more")
        every = self.eval_every_n_epochs
        require(
            0 < every < 1 or (every >= 1 and float(every).is_integer()),
            "trainer.eval_every_n_epochs",
            every,
            "use a whole number of epochs (1 or more) or a fraction of one below 1 (e.g. 0.5), or set "
            "trainer.eval_every_n_steps",
        )
        require(
            self.eval_every_n_steps is None or self.eval_every_n_steps >= 1,
            "trainer.eval_every_n_steps",
            self.eval_every_n_steps,
            "use a positive number of optimizer steps, or null",
        )
        require(
            self.dist_timeout_s > 0, "trainer.dist_timeout_s", self.dist_timeout_s, "use a positive number of seconds"
        )
        require(
            self.stall_timeout_s is None or self.stall_timeout_s > 0,
            "trainer.stall_timeout_s",
            self.stall_timeout_s,
            "use a positive number of seconds, or null for the default (300 s or 50 step times)",
        )
        require(
            self.num_warmup_timing_steps >= 0,
            "trainer.num_warmup_timing_steps",
            self.num_warmup_timing_steps,
            "use 0 or more",
        )
        require(
            self.dist_backend in BACKENDS,
            "trainer.dist_backend",
            self.dist_backend,
            f"choose one of {', '.join(BACKENDS)}",
        )
        require(
            self.device in DEVICES, "trainer.device", self.device, f"choose {', '.join(DEVICES[:-1])} or {DEVICES[-1]}"
        )

    def _check_performance_switches(self) -> None:
        require(
            self.precision in PRECISIONS,
            "trainer.precision",
            self.precision,
            f"choose one of {', '.join(PRECISIONS)}",
        )
        require(
            self.compile in COMPILE_MODES,
            "trainer.compile",
            self.compile,
            "choose false, true (the whole model) or blocks (each block)",
        )
        checkpointing = self.activation_checkpointing
        require(
            checkpointing is None
            or checkpointing == "blocks"
            or (
                isinstance(checkpointing, list)
                and len(checkpointing) > 0
                and all(isinstance(c, str) for c in checkpointing)
            ),
            "trainer.activation_checkpointing",
            checkpointing,
            "name the block classes to recompute, e.g. [TransformerEncoderLayer], blocks (the model's own), "
            "or null for none",
        )

    def steps_per_epoch(self, num_batches: int) -> int:
        """Optimizer steps in an epoch of num_batches micro-batches (the last window may be short)."""
        return math.ceil(num_batches / self.grad_accum_steps)

    def _check_debug_settings(self) -> None:
        for key in ("limit_train_batches", "limit_eval_batches"):
            value = getattr(self, key)
            fraction = isinstance(value, float) and 0 < value <= 1
            whole = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            require(
                value is None or fraction or whole,
                f"trainer.{key}",
                value,
                "use a fraction of the batches in (0, 1] (e.g. 0.1), a number of batches (e.g. 5), or null for all",
            )
        require(self.overfit_batches >= 0, "trainer.overfit_batches", self.overfit_batches, "use 0 (off) or more")
        require(
            not (self.overfit_batches and self.limit_train_batches is not None),
            "trainer.overfit_batches",
            self.overfit_batches,
            "overfitting trains on its own batches: leave trainer.limit_train_batches at null",
        )

    def eval_every_epochs(self) -> int | None:
        """Evaluate at the end of every n-th epoch (None: eval_every_n_epochs is a fraction, so every epoch)."""
        return int(self.eval_every_n_epochs) if self.eval_every_n_epochs >= 1 else None

    def eval_points_in_epoch(self, steps_per_epoch: int) -> set[int]:
        """With eval_every_n_epochs a fraction f of an epoch: the steps into an epoch after which an
        evaluation is due, at f, 2f, ... of it, short of its end (which evaluates anyway): 0.5 on an
        epoch of 81 steps evaluates after step 40 and at the end, twice, as Lightning's
        val_check_interval=0.5 does. Empty otherwise."""
        every = self.eval_every_n_epochs
        if self.eval_every_n_steps is not None or every >= 1:
            return set()
        points, k = set(), 1
        while k * every < 1 - 1e-9:
            points.add(round(k * every * steps_per_epoch))
            k += 1
        return {p for p in points if 0 < p < steps_per_epoch}


@dataclass
class ProfilerConfig:
    """trainer.profiler: torch.profiler over optimizer steps: skip `wait`, warm up `warmup`, record
    `active`, once; traces in <run_dir>/profile (dtf.train.debug)."""

    enabled: bool = False
    wait: int = 1
    warmup: int = 1
    active: int = 3
    record_shapes: bool = False
    profile_memory: bool = False

    def __post_init__(self) -> None:
        for key in ("wait", "warmup"):
            require(getattr(self, key) >= 0, f"trainer.profiler.{key}", getattr(self, key), "use 0 or more steps")
        require(self.active >= 1, "trainer.profiler.active", self.active, "record at least 1 step")


@dataclass
class EarlyStoppingConfig:
    """trainer.early_stopping: end training once the objective stops improving (as Lightning's
    EarlyStopping): after `patience` evaluations in a row none of which beat the best so far by
    more than min_delta (in the objective's direction). null patience: never."""

    patience: int | None = None
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        require(
            self.patience is None or self.patience >= 1,
            "trainer.early_stopping.patience",
            self.patience,
            "use 1 or more evaluations, or null for no early stopping",
        )
        require(
            self.min_delta >= 0,
            "trainer.early_stopping.min_delta",
            self.min_delta,
            "use 0 or a positive improvement",
        )
        require(
            self.patience is not None or self.min_delta == 0,
            "trainer.early_stopping.min_delta",
            self.min_delta,
            "it counts only with trainer.early_stopping.patience: set a patience, or leave min_delta at 0",
        )


@dataclass
class CheckpointConfig:
    """Sharded checkpoints through torch.distributed.checkpoint, under <run_dir>/<dir>."""

    # Save every n optimizer steps (null: only at the end).
    every_n_steps: int | None = 500
    at_end: bool = True
    # Complete checkpoints kept; older ones are deleted once a newer one is committed.
    keep_last: int = 2
    # Also keep the k checkpoints with the best objective (trainer.objective) at an evaluation,
    # and <run_dir>/best_model.pt, the weights of the best evaluation (full state dict).
    keep_best: int = 0
    # auto: continue from the newest complete checkpoint in the run dir, if any;
    # never: start fresh; or the path of a step_* checkpoint folder (of any run).
    resume: str = "auto"
    # A folder of the run dir, a path, or a URL fsspec resolves (s3://bucket/run1: its checkpoints,
    # and copies of model.pt, summary.json and the exports, go there; the run dir stays local).
    dir: str = "checkpoints"
    # fsspec options for a URL in dir or resume (endpoint, credentials, ...), as data.storage_options.
    storage_options: dict[str, Any] = field(default_factory=dict)
    # Write in a background thread (dcp.async_save): training blocks only while the state is copied.
    async_save: bool = False
    # Signals that make all ranks agree to stop at the next step boundary, save one checkpoint and
    # exit with status 75 (EX_TEMPFAIL: requeue me). SLURM sends them before preemption or the time limit.
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    # How often the ranks compare notes (a stop signal, a finished background save): a tiny
    # collective about every stop_check_every_s seconds of training, so a stop takes effect within
    # about twice that. stop_check_every_n_steps fixes it to every n steps instead (a stop within 2n).
    stop_check_every_s: float = 0.25
    stop_check_every_n_steps: int | None = None
    # At the end of training, rank 0 exports the final checkpoint as a Hugging Face folder that
    # from_pretrained loads, as python -m dtf.export does: <run_dir>/hf_export/ (and with keep_best
    # the best checkpoint's, <run_dir>/hf_export_best/), each replacing the one before.
    export_hf: bool = False

    def __post_init__(self) -> None:
        require(
            not self.export_hf or self.at_end,
            "checkpoint.export_hf",
            self.export_hf,
            "it exports the final checkpoint: keep checkpoint.at_end=true, or export one with python -m dtf.export",
        )
        require(
            self.every_n_steps is None or self.every_n_steps >= 1,
            "checkpoint.every_n_steps",
            self.every_n_steps,
            "use a positive number of optimizer steps, or null to save only at the end",
        )
        require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "keep at least 1 checkpoint")
        require(self.keep_best >= 0, "checkpoint.keep_best", self.keep_best, "use 0 (none) or more checkpoints")
        require(
            self.stop_check_every_n_steps is None or self.stop_check_every_n_steps >= 1,
            "checkpoint.stop_check_every_n_steps",
            self.stop_check_every_n_steps,
            "use 1 or more, or null to check about every checkpoint.stop_check_every_s seconds",
        )
        require(
            self.stop_check_every_s > 0,
            "checkpoint.stop_check_every_s",
            self.stop_check_every_s,
            "use a positive number of seconds",
        )
        for name in self.stop_signals:
            require(
                name in STOPPABLE_SIGNALS,
                "checkpoint.stop_signals",
                name,
                f"use signal names among {', '.join(STOPPABLE_SIGNALS)}, or [] to die on them as usual",
            )


class Fetch(str, Enum):
    """data.fetch: how a batch is read from a map-style dataset (dtf.data.fetch)."""

    auto = "auto"  # batched where the dataset allows it, else per_sample
    batched = "batched"  # one indexing op per tensor per batch (a TensorDataset, __getitems__)
    per_sample = "per_sample"  # one __getitem__ per sample, then torch's default_collate


@dataclass
class BaseDataConfig:
    """What every kind of data has: which reader, and the batch sizes."""

    # What reads the data (dtf.data.loader.build_splits picks by it); set by the option, not by users.
    kind: str = MISSING
    # Per rank; the global batch is batch_size x world_size x grad_accum_steps.
    batch_size: int = 32
    # The global batch, kept on every world size (an elastic run's too): each rank's batch is then
    # global_batch_size / (world size x trainer.grad_accum_steps), and data.batch_size is the batch
    # optimizer.lr is given for (trainer.lr_scaling grows it by global_batch_size / data.batch_size).
    # null: data.batch_size per rank (on launcher.nnodes=MIN:MAX: the full-size run's global batch).
    global_batch_size: int | None = None
    # Defaults to batch_size (validation and test).
    eval_batch_size: int | None = None
    # A validation split carved out of the training data: this fraction of it, drawn with val_seed
    # (the same rows on any world size, and whatever trainer.seed is). 0: none, unless the data
    # gives one of its own.
    val_fraction: float = 0.0
    val_seed: int = 0

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, "data.batch_size", self.batch_size, "use a per-rank batch size of 1 or more")
        require(
            self.global_batch_size is None or self.global_batch_size >= 1,
            "data.global_batch_size",
            self.global_batch_size,
            "use a global batch of 1 or more, or null for data.batch_size per rank",
        )
        require(
            self.eval_batch_size is None or self.eval_batch_size >= 1,
            "data.eval_batch_size",
            self.eval_batch_size,
            "use 1 or more, or null for data.batch_size",
        )
        require(
            0.0 <= self.val_fraction < 1.0,
            "data.val_fraction",
            self.val_fraction,
            "use a fraction of the training data in [0, 1), e.g. data.val_fraction=0.1, or 0 for none",
        )


@dataclass
class LoaderDataConfig(BaseDataConfig):
    """A map-style dataset through torch's DataLoader and DistributedSampler."""

    kind: str = "loader"
    # _target_ of a callable returning a Dataset (train only), a (train, test) pair, a (train, val,
    # test) triple, or a mapping with the keys train, and val and/or test.
    dataset: Any = MISSING
    shuffle: bool = True
    drop_last: bool = False
    num_workers: int = 0
    pin_memory: bool = False
    # auto: a batch in one indexing op per tensor where the dataset allows it (a TensorDataset, a
    # dataset with __getitems__), else per sample; the same batches either way.
    fetch: Fetch = Fetch.auto

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.num_workers >= 0, "data.num_workers", self.num_workers, "use 0 (load in the rank) or more")


class Remainder(str, Enum):
    """Rows left after cutting every rank's share into equal full batches."""

    drop = "drop"  # not used this epoch (with shuffling, other rows every epoch)
    pad = "pad"  # each rank repeats some of its own rows to fill one more batch


class PetastormReader(str, Enum):
    """data.reader, by the names of Petastorm's readers: whether a Petastorm dataset's codecs are decoded."""

    auto = "auto"  # decoded where the data set has a Unischema (a Petastorm dataset)
    make_reader = "make_reader"  # decoded, as Petastorm's make_reader yields them
    make_batch_reader = "make_batch_reader"  # as stored, as Petastorm's make_batch_reader yields them


class ReaderPool(str, Enum):
    thread = "thread"
    process = "process"
    dummy = "dummy"  # in the training process itself (debugging)


@dataclass
class ParquetDataConfig(BaseDataConfig):
    """Parquet or a Petastorm dataset, read by dtf with the same number of batches on every rank
    (data=parquet; data=petastorm is the same option by its former name)."""

    kind: str = "parquet"
    # The training data: a Parquet file or directory, or a Petastorm dataset, as a local path or a
    # URL (file://, s3://, gs://, hdfs://, ... any scheme fsspec resolves).
    path: str = MISSING
    # Test data, evaluated with every row counted exactly once (null: no evaluation, unless
    # test_filters is set: then the test data are data.path's partitions that test_filters keep).
    test_path: str | None = None
    # Validation data, evaluated as the test data are (null: none, unless val_filters is set: then
    # data.path's partitions that val_filters keep; or data.val_fraction of data.path's rows).
    val_path: str | None = None
    # Hive partitions to read ([[split, '=', train]]; a list of such lists: any of them), pyarrow's
    # DNF on partition columns only (whole files, so the equal-batches plan stays exact).
    filters: Any = None
    test_filters: Any = None
    val_filters: Any = None
    # The model input: one column as stored (with its shape), or several flattened and concatenated.
    feature_columns: list[str] = field(default_factory=lambda: ["features"])
    label_column: str = "label"
    # The dtype features (and float labels) arrive in: auto (torch's default dtype, the model's),
    # float32, float64, float16, bfloat16. Integer labels arrive as int64.
    feature_dtype: str = "auto"
    # A callable by _target_, or a list of them applied in order, to every (features, labels) batch:
    # dtf.data.transforms.Scale, Normalize, Reshape, Permute, or your own.
    transform: Any = None
    # Seeded by trainer.seed and different every epoch.
    shuffle_row_groups: bool = True
    shuffle_rows: bool = True
    remainder: Remainder = Remainder.drop
    # C: every epoch's row sequence is cut into C partitions; every step takes G / C rows from
    # each (G = world size x batch_size) and rank r of N reads partitions [r C/N, (r+1) C/N).
    # The steps are the same on every world size that divides C. auto: the checkpoint's on a
    # resume, else gcd(G, lcm(N, 24)). A number: G must be a multiple of it, N a divisor.
    canonical_partitions: Any = "auto"
    reader: PetastormReader = PetastormReader.auto
    # thread: Arrow decodes without the GIL; process: where decoding is Python work (images).
    reader_pool_type: ReaderPool = ReaderPool.thread
    # Row groups read in parallel (per rank). auto: 2 where a Petastorm codec decodes the columns read
    # (images, arrays: decoding that releases the GIL), else 1 (Arrow alone: a second thread only
    # contends for the GIL with training; benchmarks/data.py measured both).
    workers_count: Any = "auto"
    # Row groups read ahead of training (per rank).
    results_queue_size: int = 8
    # fsspec options for remote URLs (endpoint, credentials, ...).
    storage_options: dict[str, Any] = field(default_factory=dict)
    # A local folder that keeps the files of remote data (s3://, ...) once read, shared by the ranks
    # of a host (and by later runs): a second epoch reads nothing remote. null: no cache.
    cache_dir: str | None = None
    # The most the cache folder holds, in GiB: the least recently used files go first. null: no limit.
    cache_limit_gb: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.feature_columns:
            raise UserError("data.feature_columns is empty: name the column(s) that form the model input")
        require(
            self.feature_dtype in FEATURE_DTYPES,
            "data.feature_dtype",
            self.feature_dtype,
            f"use {', '.join(FEATURE_DTYPES)}",
        )
        if self.val_fraction and (self.val_path or self.val_filters):
            raise UserError(
                f"data.val_fraction={self.val_fraction} and data.val_path/data.val_filters both name a validation "
                "split: keep one (data.val_fraction=0, or data.val_path=null data.val_filters=null)"
            )
        w = self.workers_count
        require(
            w == "auto" or (isinstance(w, int) and not isinstance(w, bool) and w >= 1),
            "data.workers_count",
            w,
            "use auto or 1 or more reader workers",
        )
        require(self.results_queue_size >= 1, "data.results_queue_size", self.results_queue_size, "use 1 or more")
        if self.cache_limit_gb is not None:
            require(
                self.cache_dir is not None,
                "data.cache_limit_gb",
                self.cache_limit_gb,
                "it bounds data.cache_dir, which is not set: name the folder too (data.cache_dir=/local/dtf-cache)",
            )
            require(
                self.cache_limit_gb > 0,
                "data.cache_limit_gb",
                self.cache_limit_gb,
                "use a size in GiB above 0, or null",
            )
        c = self.canonical_partitions
        require(
            c == "auto" or (isinstance(c, int) and not isinstance(c, bool) and c >= 1),
            "data.canonical_partitions",
            c,
            "use auto or a positive number of partitions, e.g. data.canonical_partitions=24",
        )


# data=petastorm's schema by its former name (configs and code written before data=parquet).
PetastormDataConfig = ParquetDataConfig


class SampleBy(str, Enum):
    """data.sample_by: what one document of a .txt file is (Hugging Face datasets' text loader's names)."""

    document = "document"  # the whole file
    line = "line"  # every non-empty line


@dataclass
class TextDataConfig(BaseDataConfig):
    """Text tokenized once into Parquet token ids, then read as data=parquet reads (data=text)."""

    kind: str = "text"
    # .txt or .jsonl files (a file or a folder of them), or Parquet with a string column.
    path: str = MISSING
    # Validation and test text, tokenized as path is (or data.val_fraction of path's sequences).
    val_path: str | None = None
    test_path: str | None = None
    # A folder or Hub id AutoTokenizer loads (conf/data/text.yaml: model.name_or_path).
    tokenizer: str | None = None
    # Tokens per sequence: documents joined by EOS, cut into sequences of this length.
    seq_len: int = 1024
    # The jsonl field, or the Parquet column, that holds the text (null: "text"); refused for .txt.
    text_field: str | None = None
    sample_by: SampleBy = SampleBy.document
    # Where the token ids are cached (null: a folder .dtf-tokens beside the text).
    cache_dir: str | None = None
    shuffle_row_groups: bool = True
    shuffle_rows: bool = True
    # pad: the last batches are filled with sequences whose labels are all -100 (they count no
    # token), so every token is trained on exactly once per epoch; drop: whole sequences are left out.
    remainder: Remainder = Remainder.pad
    canonical_partitions: Any = "auto"
    workers_count: Any = "auto"
    results_queue_size: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.seq_len >= 2, "data.seq_len", self.seq_len, "use 2 or more tokens per sequence, e.g. 512")
        if self.val_fraction and self.val_path:
            raise UserError(
                f"data.val_fraction={self.val_fraction} and data.val_path both name a validation split: keep one "
                "(data.val_fraction=0, or data.val_path=null)"
            )


@dataclass
class DDPStrategyConfig:
    name: str = "ddp"
    find_unused_parameters: bool = False
    # Re-broadcast rank 0's buffers (e.g. BatchNorm statistics) before every forward.
    forward_sync_buffers: bool = True
    # MB of gradients per all-reduce (DDP's buckets); null: 4 on CPU (gloo), so that the all-reduces
    # start during the backward; on CUDA PyTorch's 25 (its first bucket 1). A size set here, or the 4
    # on CPU, holds for the first bucket too.
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    # Build the model on the meta device and materialise it on the rank's device (initialised by
    # each module's reset_parameters, the same on every rank): no copy built on the CPU first.
    meta_init: bool = False

    def __post_init__(self) -> None:
        require(
            self.bucket_cap_mb is None or self.bucket_cap_mb > 0,
            "strategy.bucket_cap_mb",
            self.bucket_cap_mb,
            "give the MB of gradients per all-reduce, e.g. 4, or null for dtf's default",
        )


@dataclass
class FSDPStrategyConfig:
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over all ranks."""

    name: str = "fsdp"
    # Class names of the modules sharded as one unit each (e.g. [TransformerEncoderLayer]);
    # null: the children of every nn.Sequential / nn.ModuleList that hold parameters, else
    # the model's direct children with parameters. The root is always sharded last.
    block_classes: list[str] | None = None
    # Free the gathered parameters after forward (ZeRO-3) or keep them until backward (ZeRO-2).
    reshard_after_forward: bool = True
    # Keep the sharded parameters, gradients and optimizer state in host memory.
    cpu_offload: bool = False
    # Build the model on the meta device and materialise only this rank's shards (initialised by
    # each module's reset_parameters, seeded with seed + the shard's index: replicas of a shard agree).
    meta_init: bool = False
    # Retired: trainer.precision and trainer.activation_checkpointing say these for every strategy
    # (trainer.precision=bf16-mixed sets FSDP's MixedPrecisionPolicy). Set, they are refused in one line.
    param_dtype: Any = None
    reduce_dtype: Any = None
    activation_checkpointing: Any = None

    def __post_init__(self) -> None:
        refuse_retired_keys(self.param_dtype, self.reduce_dtype, self.activation_checkpointing)


# What strategy.param_dtype meant, as a trainer.precision.
_RETIRED_DTYPES = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "fp32": "32"}


def refuse_retired_keys(param_dtype: Any, reduce_dtype: Any, activation_checkpointing: Any) -> None:
    """The FSDP keys that trainer settings replaced: one line naming the new key."""
    if param_dtype is not None:
        new = _RETIRED_DTYPES.get(str(param_dtype))
        use = f"trainer.precision={new}" if new else f"trainer.precision, one of {', '.join(PRECISIONS)}"
        raise UserError(f"strategy.param_dtype={param_dtype} is now trainer.precision: use {use}")
    if reduce_dtype is not None:
        raise UserError(
            f"strategy.reduce_dtype={reduce_dtype} is now set by trainer.precision (gradients are reduced in fp32 "
            "under bf16-mixed and fp16-mixed): remove strategy.reduce_dtype"
        )
    if activation_checkpointing:
        raise UserError(
            f"strategy.activation_checkpointing={str(activation_checkpointing).lower()} is now "
            "trainer.activation_checkpointing: "
            "use trainer.activation_checkpointing=[<block class>, ...] (e.g. the classes of strategy.block_classes)"
        )


CROSS_GROUP_DTYPES = ("float32", "bfloat16")


@dataclass
class MicsStrategyConfig(FSDPStrategyConfig):
    """MiCS / ZeRO-2D: shard inside groups of partition_group_size ranks, replicate across them."""

    name: str = "mics"
    # G, or auto: measured at start (dtf.dist.probe), the G whose collectives the links carry fastest
    # among those that fit in memory (dtf.strategy.choose).
    partition_group_size: Any = "auto"
    # The dtype the gradients cross between the groups in: bfloat16 sends half the bytes over the
    # slow links (ZeRO++'s qgZ idea, in bf16 rather than int4); inside a group they stay float32.
    cross_group_dtype: str = "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.cross_group_dtype in CROSS_GROUP_DTYPES,
            "strategy.cross_group_dtype",
            self.cross_group_dtype,
            "use float32 (exact, as DDP) or bfloat16 (half the bytes across the groups)",
        )
        g = self.partition_group_size
        require(
            g == "auto" or (isinstance(g, int) and not isinstance(g, bool) and g >= 1),
            "strategy.partition_group_size",
            g,
            "use auto, or a number of ranks from 1 (DDP) up to the world size (ZeRO-3) that divides it",
        )


@dataclass
class AutoStrategyConfig:
    """strategy=auto: ddp, zero stage 1 or 2, mics at a G, or fsdp, chosen at start from the measured
    links and the memory check (dtf.strategy.auto)."""

    name: str = "auto"
    # For the sharded choices: see FSDPStrategyConfig.
    block_classes: list[str] | None = None
    meta_init: bool = False


@dataclass
class ZeroStrategyConfig:
    """ZeRO by stage: 1 = optimizer state sharded, 2 = + gradients, 3 = + parameters."""

    name: str = "zero"
    stage: int = 1
    # The units (see FSDPStrategyConfig): stages 2 and 3 (FSDP2 underneath) shard each; stage 1
    # all-gathers each one's parameters after the step, while the next forward runs the units before it.
    block_classes: list[str] | None = None
    meta_init: bool = False

    def __post_init__(self) -> None:
        require(
            self.stage in (1, 2, 3),
            "strategy.stage",
            self.stage,
            "choose 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters)",
        )


# launcher.max_restarts=null on launcher.nnodes=MIN:MAX: the failures (lost nodes) an elastic run rides out.
ELASTIC_RESTARTS = 3


@dataclass
class LocalLauncherConfig:
    name: str = "local"
    # Ranks on this machine.
    nproc: int = 2
    # How often the elastic agent restarts all ranks after one fails (a node that joins an elastic
    # run restarts them too, without counting). null: 0, or 3 with launcher.nnodes=MIN:MAX.
    max_restarts: int | None = None
    # Seconds between the agent's health checks of the ranks.
    monitor_interval: float = 0.1
    # How the ranks start: forkserver (forked from one process that imported what they need, once per
    # run), spawn (each from nothing, as torchrun), or fork (from the driver itself: avoid).
    start_method: str = "forkserver"
    # Echo the other ranks' output to the console too (it always goes to <run_dir>/logs).
    tee_all_ranks: bool = False
    # Extra environment variables for every rank (e.g. OMP_NUM_THREADS).
    env: dict[str, str] = field(default_factory=dict)
    # Several machines (torchrun's --nnodes): one `python -m dtf` per node, each with nproc ranks and
    # the same rdzv_endpoint. "N", or "MIN:MAX" for an elastic run that starts with MIN nodes.
    nnodes: str = "1"
    # host:port of the rendezvous, on the first node (node_rank 0 hosts it); needed when nnodes > 1.
    rdzv_endpoint: str | None = None
    # This node's place (0 hosts the rendezvous); null: the node whose address rdzv_endpoint names.
    node_rank: int | None = None
    # The network interface gloo/NCCL use between nodes; null: the one that reaches rdzv_endpoint.
    network_interface: str | None = None
    # torch's c10d rendezvous settings (torchrun's --rdzv-conf), in seconds: join_timeout (600: how
    # long nodes wait for MIN of them), last_call_timeout (30: how long a rendezvous that has MIN
    # waits for more), close_timeout, heartbeat, keep_alive_interval (5), keep_alive_max_attempt (3).
    rdzv_configs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_nproc(self.nproc)
        require(
            self.start_method in ("forkserver", "spawn", "fork"),
            "launcher.start_method",
            self.start_method,
            "use forkserver (the default), spawn or fork",
        )
        require(
            self.max_restarts is None or self.max_restarts >= 0,
            "launcher.max_restarts",
            self.max_restarts,
            "use 0 (no restart) or more, or null",
        )
        low, high = self.node_range()
        require(
            1 <= low <= high,
            "launcher.nnodes",
            self.nnodes,
            "give a number of nodes (2) or an elastic range MIN:MAX (1:4)",
        )
        require(
            high == 1 or bool(self.rdzv_endpoint),
            "launcher.rdzv_endpoint",
            self.rdzv_endpoint,
            "several nodes meet at a rendezvous: give host:port of the first node, "
            "e.g. launcher.rdzv_endpoint=node1:29500",
        )
        require(
            self.node_rank is None or 0 <= self.node_rank < high,
            "launcher.node_rank",
            self.node_rank,
            f"use 0 to {high - 1} (0 hosts the rendezvous), or leave it unset",
        )

    def restarts(self) -> int:
        """launcher.max_restarts, null resolved."""
        if self.max_restarts is not None:
            return self.max_restarts
        low, high = self.node_range()
        return ELASTIC_RESTARTS if low < high else 0

    def node_range(self) -> tuple[int, int]:
        return node_range(self.nnodes)


def node_range(nodes: Any) -> tuple[int, int]:
    """(min, max) nodes of N or MIN:MAX; (0, 0) when it is neither."""
    low, _, high = str(nodes).partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        return 0, 0


def check_nproc(nproc: int) -> None:
    require(nproc >= 1, "launcher.nproc", nproc, "start at least one rank, e.g. launcher.nproc=2")


@dataclass
class SparkLauncherConfig:
    """Ranks as the tasks of one Spark barrier stage."""

    name: str = "spark"
    # Any Spark master URL: local[N], local-cluster[N,cores,MB], spark://host:port, yarn, k8s://...
    # null: the SparkSession already active in this process (a notebook's, as HorovodRunner and
    # TorchDistributor use it), or local[2] where there is none.
    master: str | None = None
    # Ranks = barrier tasks; the cluster needs this many free task slots at once.
    nproc: int = 2
    app_name: str = "dtf"
    # Extra Spark settings for the session dtf creates ({spark.executor.memory: 4g, ...}).
    spark_conf: dict[str, str] = field(default_factory=dict)
    # Extra environment variables for every rank.
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_nproc(self.nproc)


@dataclass
class SlurmLauncherConfig:
    """One SLURM job, one task per rank, submitted with submitit (or run in place inside an allocation)."""

    name: str = "slurm"
    # A number, or MIN:MAX for an elastic job: sbatch --nodes=MAX --no-kill, one torch elastic agent
    # per node, and a job that loses a node goes on with the others, down to MIN (docs/launchers.md, "Elastic").
    nodes: Any = 1
    # Ranks per node (SLURM tasks).
    tasks_per_node: int = 2
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    mem_gb: int | None = None
    partition: str | None = None
    # The job's time limit in minutes.
    time_min: int | None = 60
    account: str | None = None
    qos: str | None = None
    # Any other sbatch option, without the dashes: {constraint: v100, exclusive: true, ...}
    sbatch_extra: dict[str, Any] = field(default_factory=dict)
    # Shell lines run in the job before the ranks start (module load ..., source ...).
    setup: list[str] = field(default_factory=list)
    # Stream rank 0's output and end with the job's status; false: print the job id and return.
    wait: bool = True
    # What SLURM sends signal_delay_s before the time limit (and what `scancel --signal` should send):
    # the ranks checkpoint and stop, and with requeue the job goes back in the queue and resumes.
    signal: str = "SIGUSR1"
    signal_delay_s: int = 120
    requeue: bool = True
    # Extra environment variables for every rank.
    env: dict[str, str] = field(default_factory=dict)
    # launcher.nodes=MIN:MAX only: torch's c10d rendezvous settings, as launcher=local's rdzv_configs.
    rdzv_configs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        low, high = self.node_range()
        require(
            1 <= low <= high and not isinstance(self.nodes, bool),
            "launcher.nodes",
            self.nodes,
            "give the job's number of nodes (2) or an elastic range MIN:MAX (1:4)",
        )
        for key in ("tasks_per_node", "cpus_per_task"):
            require(getattr(self, key) >= 1, f"launcher.{key}", getattr(self, key), "use 1 or more")
        require(self.time_min is not None, "launcher.time_min", self.time_min, "give the job's time limit in minutes")

    def node_range(self) -> tuple[int, int]:
        return node_range(self.nodes)

    @property
    def elastic(self) -> bool:
        low, high = self.node_range()
        return low < high

    @property
    def nproc(self) -> int:
        """The ranks of the job at its largest."""
        return self.node_range()[1] * self.tasks_per_node


@dataclass
class TrialConfig:
    """`trial.*`: set by hydra/sweeper=dtf on each trial it starts (never by hand). Rank 0 reports
    the objective to the study after each evaluation and asks whether to prune."""

    study: str = MISSING
    storage: str = MISSING  # a journal file's path, or a database URL
    id: int = MISSING  # Optuna's trial id in that storage
    number: int = MISSING  # the trial's number in the study (its run dir's name)
    pruner: str = "none"
    pruner_options: dict[str, Any] = field(default_factory=dict)


# The logger group (conf/logger/): `logger=[tensorboard,mlflow,csv]` chooses several; each chosen
# one is a key of `logger` with its settings. Rank 0 logs (dtf.train.loggers).
class OnError(str, Enum):
    fail = "fail"  # the run refuses to start (one line, exit 2)
    warn = "warn"  # the run trains without it, saying so


@dataclass
class TensorBoardLoggerConfig:
    """`logger.tensorboard`: event files in <run_dir>/tensorboard."""


@dataclass
class CsvLoggerConfig:
    """`logger.csv`: <run_dir>/<file>, one row per logged step, a column per scalar."""

    file: str = "metrics.csv"

    def __post_init__(self) -> None:
        ok = bool(self.file) and "/" not in self.file
        require(ok, "logger.csv.file", self.file, "give a file name (in the run dir), e.g. metrics.csv")


@dataclass
class MlflowLoggerConfig:
    """`logger.mlflow`: one MLflow run per dtf run (a resumed run continues it)."""

    # null: MLFLOW_TRACKING_URI, else MLflow's own default. http(s)://host:port (a tracking server),
    # file:///path or sqlite:///path.db (no server).
    tracking_uri: str | None = None
    experiment_name: str = "dtf"
    # null: the run dir's name.
    run_name: str | None = None
    # A tracking server that cannot be reached before any rank starts: fail (refuse to start) or warn
    # (train without MLflow). Mid-run failures are always reported once and training goes on.
    on_error: OnError = OnError.fail
    # Each logging call's HTTP retries and timeout (MLflow's MLFLOW_HTTP_REQUEST_* settings, which
    # win when set in the environment): small, so a dead server costs seconds, not minutes.
    max_retries: int = 2
    backoff_factor: int = 1
    timeout_s: int = 10
    # Tags of your own, besides dtf's (dtf.strategy, dtf.world_size, dtf.launcher, dtf.run_dir).
    tags: dict[str, str] = field(default_factory=dict)
    # The MLflow run this one is a child of. null: none, and in a sweep the sweep's own parent run
    # (dtf.mlflow_sweep); a sweep given one makes its parent run that run's child.
    parent_run_id: str | None = None

    def __post_init__(self) -> None:
        require(self.max_retries >= 0, "logger.mlflow.max_retries", self.max_retries, "use 0 or more")
        require(self.timeout_s > 0, "logger.mlflow.timeout_s", self.timeout_s, "use a positive number of seconds")


@dataclass
class WandbLoggerConfig:
    """`logger.wandb`: a Weights & Biases run in <run_dir>/wandb (offline: no network)."""

    project: str = "dtf"
    mode: str = "offline"  # offline, online or disabled (wandb.init's mode)
    entity: str | None = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        ok = self.mode in ("offline", "online", "disabled")
        require(ok, "logger.wandb.mode", self.mode, "use offline, online or disabled")


LOGGERS: dict[str, type] = {
    "tensorboard": TensorBoardLoggerConfig,
    "csv": CsvLoggerConfig,
    "mlflow": MlflowLoggerConfig,
    "wandb": WandbLoggerConfig,
}
