"""The memory pre-flight check (trainer.memory_check): before a rank builds the model, will its
state fit?

The model is built on the meta device (no memory, no random numbers drawn); the configured
optimizer steps once on two small probe parameters, which measures its state per parameter
element (Adam: two moments) and per tensor (its step counter); the strategy's ZeRO formula
(Strategy.state_shares) gives the share one rank holds. A node's ranks together need
bytes-per-rank x ranks-on-the-node of its free memory (/proc/meminfo's MemAvailable, or less under
a cgroup's limit: SLURM's, a container's); on CUDA, each rank needs its bytes on its GPU.

Activations, buffers and the framework itself come on top: the estimate is a lower bound, so a
run it refuses cannot fit, and one it lets through may still not.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dtf.config.schema import MemoryCheck
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.strategy.base import OptimizerFactory, StateShares, Strategy

_PROBE_SIZES = (1, 64)


@dataclass(frozen=True)
class Estimate:
    parameters: int  # the model's parameter count
    param_bytes: int  # the whole model's parameters ...
    grad_bytes: int  # ... gradients (trainable parameters only) ...
    optim_bytes: int  # ... and optimizer state
    shares: StateShares

    @property
    def bytes_per_rank(self) -> int:
        s = self.shares
        return round(s.params * self.param_bytes + s.grads * self.grad_bytes + s.optim * self.optim_bytes)

    def describe(self) -> str:
        return (
            f"{self.parameters / 1e6:.1f}M parameters: {gib(self.param_bytes)} + gradients {gib(self.grad_bytes)} "
            f"+ optimizer state {gib(self.optim_bytes)}; {self.shares.formula}: {gib(self.bytes_per_rank)} per rank"
        )


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def optimizer_state_bytes(optimizer_factory: OptimizerFactory, dtype: torch.dtype) -> tuple[float, int]:
    """Bytes of optimizer state per parameter element and per parameter tensor, measured: one step
    of the configured optimizer (zero gradients) on two probe parameters of different sizes."""
    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in _PROBE_SIZES]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = optimizer_factory(params)
    optimizer.step()
    held = [
        sum(t.numel() * t.element_size() for t in optimizer.state[p].values() if isinstance(t, torch.Tensor))
        for p in params
    ]
    per_element = (held[1] - held[0]) / (_PROBE_SIZES[1] - _PROBE_SIZES[0])
    return per_element, round(held[0] - per_element * _PROBE_SIZES[0])


def estimate(model: nn.Module, optimizer_factory: OptimizerFactory, shares: StateShares) -> Estimate:
    """The model's state (built anywhere, meta included: only shapes and dtypes count), and one rank's share."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    per_dtype = {dtype: optimizer_state_bytes(optimizer_factory, dtype) for dtype in {p.dtype for p in trainable}}
    optim = 0.0
    for p in trainable:
        per_element, per_tensor = per_dtype[p.dtype]
        optim += per_element * p.numel() + per_tensor
    return Estimate(
        parameters=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        grad_bytes=sum(p.numel() * p.element_size() for p in trainable),
        optim_bytes=round(optim),
        shares=shares,
    )


def host_memory_available() -> int | None:
    """Bytes this node can still give its processes: MemAvailable, or less where a cgroup (this
    process's or an ancestor's) limits memory."""
    available: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit, usage in _cgroup_limits():
        room = max(0, limit - usage)
        available = room if available is None else min(available, room)
    return available


def _cgroup_limits() -> list[tuple[int, int]]:
    """(limit, usage) of every cgroup from this process's up to the root that sets a memory limit."""
    found: list[tuple[int, int]] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            root, limit_file, usage_file = Path("/sys/fs/cgroup"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # cgroup v1
            root, limit_file, usage_file = (
                Path("/sys/fs/cgroup/memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        directory = root / path.lstrip("/")
        while True:
            try:
                limit = (directory / limit_file).read_text().strip()
                usage = int((directory / usage_file).read_text())
                if limit != "max" and int(limit) < 2**60:  # v1 writes "no limit" as a huge number
                    found.append((int(limit), usage))
            except (OSError, ValueError):
                pass
            if directory == root or directory.parent == directory:
                break
            directory = directory.parent
    return found


def check(
    build: Callable[[], nn.Module],
    strategy: Strategy,
    optimizer_factory: OptimizerFactory,
    env: DistEnv,
    mode: MemoryCheck,
) -> Estimate | None:
    """Refuse (UserError) or warn about a run whose model state cannot fit; the estimate, or None
    when the check is off or the model cannot be built on meta. build: the model as the run builds
    it (precision's dtype conversion included)."""
    if mode == MemoryCheck.off:
        return None
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    speaks = int(os.environ.get("LOCAL_RANK", "0")) == 0  # one line per node
    rng = random.getstate(), np.random.get_state()  # a constructor that draws does not shift the run's streams
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = build()
        found = estimate(model, optimizer_factory, strategy.state_shares(env.world_size))
    except Exception as e:  # a model that cannot be built on meta, an optimizer that needs a closure: run
        if speaks:
            print(
                "dtf: trainer.memory_check skipped: the model's state could not be estimated on the meta device "
                f"({type(e).__name__}: {e})",
                flush=True,
            )
        return None
    finally:
        random.setstate(rng[0])
        np.random.set_state(rng[1])
    free: int | None
    if env.device.type == "cuda" and not found.shares.on_host:
        need, free = found.bytes_per_rank, torch.cuda.mem_get_info(env.device)[0]
        where = f"GPU {env.device.index}"
    else:
        need, free = found.bytes_per_rank * local_ranks, host_memory_available()
        where = f"this node ({local_ranks} rank(s))"
    if free is None or need <= free:
        return found
    message = (
        f"trainer.memory_check: the model's state needs {gib(need)} on {where}, which has {gib(free)} free "
        f"({found.describe()}); shard it (strategy=fsdp, mics, or zero with strategy.stage=3, and "
        "strategy.meta_init=true), use fewer ranks per node, or set trainer.memory_check=warn to run anyway"
    )
    if mode == MemoryCheck.refuse:
        raise UserError(message)
    if speaks:
        print(f"dtf: warning: {message}", flush=True)
    return found
