"""Exact cross-rank figures: the loss as all-reduced sums (value x count, count), never a mean of
means; the configured metrics through torchmetrics, whose states sync across ranks."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from dtf.config.targets import check_target, located, targets
from dtf.errors import EveryRankUserError, UserError

if TYPE_CHECKING:
    # torchmetrics takes 2-3 s to import (it imports transformers and scipy when installed):
    from torchmetrics import Metric  # only runs with metrics do, when instantiate builds them


class MeanMetric:
    """A mean over samples as sums (value x count, count), in float64 so that summing many float32
    losses loses nothing that matters (in practice not even the order in which ranks, batches or a
    resume add them up: a resumed run's epoch losses equal the straight run's, bit for bit)."""

    # update() runs every step: it only keeps the batch's loss tensor (no arithmetic, no sync;
    # a float64 add_ per step cost more than 1% of a small model's step). The kept values are
    # folded into the float64 total in one operation per FOLD_EVERY steps, or when read.
    FOLD_EVERY = 1024

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0
        self._values: list[torch.Tensor] = []
        self._counts: list[int] = []

    def reset(self) -> None:
        self.total.zero_()
        self.count = 0
        self._values.clear()
        self._counts.clear()

    def update(self, mean_value: torch.Tensor, count: int) -> None:
        """Add a batch whose mean is mean_value over count samples."""
        self._values.append(mean_value.detach())
        self._counts.append(count)
        self.count += count
        if len(self._values) >= self.FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        if not self._values:
            return
        values = torch.stack(self._values).reshape(len(self._values)).to(torch.float64)
        counts = torch.tensor(self._counts, dtype=torch.float64, device=values.device)
        self.total.add_(torch.dot(values, counts))
        self._values.clear()
        self._counts.clear()

    def state_dict(self) -> dict[str, float | int]:
        """The sums over every rank (a collective: call on all ranks)."""
        total, count = self.global_sums()
        return {"sum": total, "count": count}

    def load_state_dict(self, state: dict[str, float | int], holder: bool) -> None:
        """Sums saved over all ranks go to one rank (holder), so that adding up the ranks counts them once."""
        self.reset()
        self.total.fill_(float(state["sum"]) if holder else 0.0)
        self.count = int(state["count"]) if holder else 0

    def local(self) -> float:
        self._fold()
        return self.total.item() / self.count if self.count else float("nan")

    def global_sums(self) -> tuple[float, int]:
        """(sum, count) over every rank (a collective: call on all ranks)."""
        self._fold()
        state = torch.stack(
            [self.total, torch.tensor(float(self.count), dtype=torch.float64, device=self.total.device)]
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(state, op=dist.ReduceOp.SUM)
        total, count = state.tolist()
        return total, int(count)

    def compute(self) -> float:
        """The mean over every sample seen by every rank (a collective: call on all ranks)."""
        total, count = self.global_sums()
        return total / count if count else float("nan")


class Metrics:
    """The run's metrics (torchmetrics classes, or a user's own Metric, by _target_), fed with the
    (output, target) pairs a step hands its loss: whatever the step function, a metric sees the
    very samples the loss counts, with targets shaped as the loss got them. compute() syncs each
    metric's states over the ranks (torchmetrics gathers them): sums or every sample, never a mean
    of per-rank means."""

    def __init__(self, metrics: Mapping[str, Metric], device: torch.device) -> None:
        self.metrics = {name: m.to(device) for name, m in metrics.items()}

    @classmethod
    def build(cls, cfg: DictConfig | None, device: torch.device, loss: Any = None) -> Metrics:
        """The metrics section (name -> config with _target_), each metric built fresh, once its
        class is checked against the loss's config (every rank finds the same); None: no metrics."""
        if not cfg:
            return cls({}, device)
        try:
            check_metric_classes(cfg, loss)
        except UserError as e:
            raise EveryRankUserError(str(e)) from None
        return cls({str(name): _built(str(name), node) for name, node in cfg.items()}, device)

    def __bool__(self) -> bool:
        return bool(self.metrics)

    def observing(self, loss_fn: Any) -> Any:
        """loss_fn, also feeding these metrics with every (output, target) pair it is called with."""
        return _Observed(loss_fn, self) if self.metrics else loss_fn

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        output = output.detach()
        if output.is_floating_point() and output.dtype != torch.float64:
            output = output.float()  # reduced-precision outputs: the metric's sums in float32
        for name, metric in self.metrics.items():
            if getattr(metric, "takes_loss", False):
                continue  # fed by observe_loss
            try:
                metric.update(output, target)
            except (ValueError, RuntimeError) as e:
                raise UserError(
                    f"metrics.{name} ({type(metric).__name__}) cannot take this model's output "
                    f"{tuple(output.shape)} with targets {tuple(target.shape)}: {str(e).splitlines()[0]}; "
                    "pick metrics that fit the task, or metrics=none"
                ) from None

    def observe_loss(self, loss: torch.Tensor, count: int) -> None:
        """A batch's mean loss over count items, for the metrics made from the loss (takes_loss:
        dtf.train.loss_metrics). A batch that counts nothing (all padding) adds nothing."""
        if count == 0:
            return
        for metric in self.metrics.values():
            if getattr(metric, "takes_loss", False):
                metric.update(loss.detach(), count)

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()

    def compute(self) -> dict[str, float]:
        """Each metric over every sample of every rank (a collective: call on all ranks)."""
        values = {}
        for name, metric in self.metrics.items():
            with warnings.catch_warnings():
                # A rank that saw no sample (more ranks than test samples) has nothing to add.
                warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
                value = metric.compute()
            values[name] = float(value.item() if isinstance(value, torch.Tensor) else value)
        return values

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Every metric's states summed or gathered over all ranks (a collective), on the CPU."""
        state: dict[str, dict[str, Any]] = {}
        for name, metric in self.metrics.items():
            with metric.sync_context(should_sync=dist.is_initialized() and dist.get_world_size() > 1):
                state[name] = {key: _to_cpu(value) for key, value in metric.metric_state.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]], holder: bool) -> None:
        """States saved over all ranks go to one rank (holder), so that syncing counts them once."""
        self.reset()
        if not holder:
            return
        for name, metric in self.metrics.items():
            saved = state.get(name)
            if not saved:
                continue
            device = next(iter(metric.buffers()), torch.empty(0)).device
            for key, value in saved.items():
                moved = [v.to(device) for v in value] if isinstance(value, list) else value.to(device)
                setattr(metric, key, moved)
            metric._update_count = 1  # it holds samples: compute() must not warn that it saw none


def _to_cpu(value: Any) -> Any:
    if isinstance(value, list):
        return [v.detach().cpu() for v in value]
    return value.detach().cpu()


class _Observed:
    """A loss function that also hands each (output, target) pair, target shaped as the loss needs
    it (TargetsLikeOutput.shape_target), to the metrics."""

    def __init__(self, loss_fn: Any, metrics: Metrics) -> None:
        self.loss_fn = loss_fn
        self.metrics = metrics

    def __getattr__(self, name: str) -> Any:  # a step function may read the loss's settings
        return getattr(self.loss_fn, name)

    def __call__(self, output: Any, target: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor):
            shape = getattr(self.loss_fn, "shape_target", None)
            self.metrics.update(output, shape(output, target) if shape else target)
        return self.loss_fn(output, target, *args, **kwargs)


def _built(name: str, node: DictConfig) -> Metric:
    """The metric, or one line where torchmetrics refused its settings (its classes take **kwargs,
    so no signature names the keys they take; a class of the user's own shows its traceback)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node)
    except InstantiationException as e:
        cause = e.__cause__
        if not (isinstance(cause, TypeError | ValueError) and str(node._target_).startswith("torchmetrics.")):
            raise
        raise EveryRankUserError(
            f"metrics.{name}: {node._target_} refused its settings ({type(cause).__name__}: "
            f"{' '.join(str(cause).split())}): fix the key it names, or remove it with ~metrics.{name}.<key>"
        ) from None


def check_metric_classes(metrics: DictConfig, loss_node: Any) -> None:
    """Each metric's _target_ importable, taking the keys given, a torchmetrics Metric, and one
    that judges what the loss trains. It imports torchmetrics, which takes 2-3 s when transformers
    and scipy are installed (it imports them): on a local run the ranks, which import it anyway,
    make this check as they build the metrics (Metrics.build) instead of the driver (dtf.preflight)."""
    loss = located(loss_node) if isinstance(loss_node, DictConfig) and "_target_" in loss_node else None
    for path, target_node in targets(metrics, "metrics"):
        check_target(path, target_node)
    for name, node in metrics.items():
        key = "metrics." + str(name)
        cls = located(node)
        from torchmetrics import Metric

        if not (isinstance(cls, type) and issubclass(cls, Metric)):
            raise UserError(f"{key}._target_={node._target_} is not a torchmetrics Metric: use a Metric subclass")
        _check_metric_fits_loss(key, cls, loss)


def _check_metric_fits_loss(key: str, metric: type, loss: Any) -> None:
    """A regression metric cannot judge a classifier's class scores, nor a class metric a regression."""
    from dtf.train.loss import CLASS_INDEX

    regression_losses = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.SmoothL1Loss, torch.nn.HuberLoss)
    if not isinstance(loss, type):
        return
    kind = metric.__module__.split(".")[1] if metric.__module__.startswith("torchmetrics.") else ""
    if kind == "regression" and issubclass(loss, CLASS_INDEX):
        raise UserError(
            f"{key} ({metric.__name__}) judges a regression, but the loss ({loss.__name__}) trains a classifier: "
            "pick classification metrics (metrics=accuracy) or metrics=none"
        )
    if kind == "classification" and issubclass(loss, regression_losses):
        raise UserError(
            f"{key} ({metric.__name__}) judges classes, but the loss ({loss.__name__}) trains a regression: "
            "pick regression metrics (metrics=rmse) or metrics=none"
        )
