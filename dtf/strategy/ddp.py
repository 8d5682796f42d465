"""DistributedDataParallel: every rank holds the whole model; gradients are averaged."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer

from dtf.dist.compat import DDP_SYNC_BUFFERS
from dtf.dist.env import DistEnv
from dtf.strategy.base import OptimizerFactory, Strategy, materialise_whole

# strategy.bucket_cap_mb=null on CPU. DDP starts a bucket's all-reduce during the backward once the
# bucket fills; in PyTorch's 25 MB ones, most of a ViT's 19 MB of gradients crossed after the
# backward (1.36x the step's floor over a 1 Gbit/s link; 1.14x and 1.22x in two runs with 4 MB:
# docs/strategies.md).
# A fixed size, not one sized from the measured link: the bucket boundaries decide the order in
# which gloo sums each element, and a run's bits must not depend on a measurement.
CPU_BUCKET_CAP_MB = 4.0


class DDPStrategy(Strategy):
    name = "ddp"

    def _wrap(self, module: nn.Module, env: DistEnv) -> nn.Module:
        module = materialise_whole(module, env.device).to(env.device)
        if not any(p.requires_grad for p in module.parameters()):
            return module  # DDP refuses modules without trainable parameters
        return DDP(
            module,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            find_unused_parameters=self.cfg.find_unused_parameters,
            **{DDP_SYNC_BUFFERS: self.cfg.forward_sync_buffers},
            gradient_as_bucket_view=self.cfg.gradient_as_bucket_view,
            static_graph=self.cfg.static_graph,
            bucket_cap_mb=self.bucket_cap_mb(env),
        )

    def bucket_cap_mb(self, env: DistEnv) -> float | None:
        """strategy.bucket_cap_mb, or where it is null: CPU_BUCKET_CAP_MB on CPU, PyTorch's default
        (None: 25 MB) on CUDA."""
        if self.cfg.bucket_cap_mb is not None:
            return float(self.cfg.bucket_cap_mb)
        return CPU_BUCKET_CAP_MB if env.device.type == "cpu" else None

    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory, env: DistEnv) -> tuple[nn.Module, Optimizer]:
        # Several modules (a ModuleDict, as in a GAN) are wrapped one by one, as Maggy did,
        # so a step function can call each through its own DDP wrapper.
        if isinstance(model, nn.ModuleDict):
            wrapped: nn.Module = nn.ModuleDict({k: self._wrap(m, env) for k, m in model.items()})
        else:
            wrapped = self._wrap(model, env)
        return wrapped, optimizer_factory(wrapped.parameters())

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        modules = model.values() if isinstance(model, nn.ModuleDict) else [model]
        for m in modules:
            if isinstance(m, DDP):
                stack.enter_context(m.no_sync())
        return stack
