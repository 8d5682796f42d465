"""The memory pre-flight check (trainer.memory_check): before the ranks build the model, will its
state fit? Checked on the driver where it runs on the ranks' machine (launcher=local: before any
rank starts, see check_before_start), else by each node's local rank 0 (SLURM, Spark).

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

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dtf.config.schema import MemoryCheck
from dtf.errors import UserError, user_error_in

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

_PROBE_SIZES = (1, 64)


@dataclass(frozen=True)
class StateShares:
    """The fractions of the model's parameters, gradients and optimizer state one rank holds at its
    peak: the formulas of the ZeRO paper (Rajbhandari et al., 2020) and of MiCS."""

    params: float
    grads: float
    optim: float
    formula: str  # in words, for messages: "ZeRO-3: all sharded over 4 ranks"
    on_host: bool = False  # offloaded: in host memory, whatever the device


WHOLE_REPLICA = StateShares(1, 1, 1, "DDP: a full replica on every rank")  # the most any strategy holds


@dataclass(frozen=True)
class Node:
    """Where the ranks of a node run: how many, on what device, and whether this process speaks for
    them (one line per node)."""

    local_ranks: int
    device: torch.device
    speaks: bool = True


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


# Optimizer state per trainable parameter byte beyond what torch's optimizers keep (Adam 2, 3 with
# amsgrad): a model that fits with this much fits with any of them. (LBFGS's history can hold more,
# but it needs a closure, so optimizer_state_bytes cannot measure it either.)
OPTIMIZER_STATE_BOUND = 16


def estimate(model: nn.Module, optimizer_factory: OptimizerFactory | None, shares: StateShares) -> Estimate:
    """The model's state (built anywhere, meta included: only shapes and dtypes count), and one rank's
    share. optimizer_factory None: optimizer state bounded by OPTIMIZER_STATE_BOUND, not measured."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    optim = 0.0
    if optimizer_factory is None:
        optim = OPTIMIZER_STATE_BOUND * sum(p.numel() * p.element_size() for p in trainable)
    else:
        per_dtype = {dtype: optimizer_state_bytes(optimizer_factory, dtype) for dtype in {p.dtype for p in trainable}}
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


def estimate_built(
    build: Callable[[], nn.Module], optimizer_factory: OptimizerFactory | None, shares: StateShares, speaks: bool = True
) -> Estimate | None:
    """The estimate of the model build() makes (on the meta device, drawing nothing from the run's
    random streams); None, said in a line, when it cannot be built there."""
    rng = random.getstate(), np.random.get_state()  # a constructor that draws does not shift the run's streams
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = build()
        return estimate(model, optimizer_factory, shares)
    except Exception as e:  # a model that cannot be built on meta, an optimizer that needs a closure: run
        refusal = user_error_in(e)
        if refusal is not None:  # bad settings (instantiate wraps what the model raised): refused, not skipped
            raise refusal from None
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


def shortfall(found: Estimate, node: Node, room: float = 1.0) -> str | None:
    """Where the node cannot hold what its ranks need, as the refusal says it; None when it can.
    room: the share of the free memory the model's state may take (strategy=auto keeps some for
    what the estimate leaves out)."""
    within = "" if room == 1 else f" of which it may take {room:.0%}"
    if node.device.type == "cuda" and not found.shares.on_host:
        gpus = [node.device]  # a rank's own; on the driver, each of the node's ranks'
        if node.device.index is None:
            gpus = [torch.device("cuda", i) for i in range(node.local_ranks)]
        for gpu in gpus:  # each rank needs its share on its own GPU
            free = torch.cuda.mem_get_info(gpu)[0]
            if found.bytes_per_rank > free * room:
                return f"needs {gib(found.bytes_per_rank)} on GPU {gpu.index}, which has {gib(free)} free{within}"
        return None
    need, available = found.bytes_per_rank * node.local_ranks, host_memory_available()
    if available is None or need <= available * room:
        return None
    return f"needs {gib(need)} on this node ({node.local_ranks} rank(s)), which has {gib(available)} free{within}"


# What a refusal advises: sharding, unless the run shards as much as it can already (strategy=auto).
SHARD_IT = (
    "shard it (strategy=fsdp, mics, or zero with strategy.stage=3, and strategy.meta_init=true), use fewer ranks "
    "per node, or set trainer.memory_check=warn to run anyway"
)
NOTHING_FITS = (
    "strategy=auto finds no strategy it fits under (this is the most sharded one): use more ranks or nodes, "
    "strategy=fsdp strategy.cpu_offload=true, or set trainer.memory_check=warn to run anyway"
)


def judge(found: Estimate, node: Node, mode: MemoryCheck, advice: str = SHARD_IT) -> None:
    """Refuse (UserError) or warn about a run whose model state cannot fit on the node."""
    short = shortfall(found, node)
    if short is None or mode == MemoryCheck.off:
        return
    message = f"trainer.memory_check: the model's state {short} ({found.describe()}); {advice}"
    if mode == MemoryCheck.refuse:
        raise UserError(message)
    if node.speaks:
        print(f"dtf: warning: {message}", flush=True)


def check(
    build: Callable[[], nn.Module],
    shares: StateShares,
    optimizer_factory: OptimizerFactory,
    node: Node,
    mode: MemoryCheck,
    advice: str = SHARD_IT,
) -> Estimate | None:
    """Refuse (UserError) or warn about a run whose model state cannot fit; the estimate, or None
    when the check is off or the model cannot be built on meta. build: the model as the run builds
    it (precision's dtype conversion included)."""
    if mode == MemoryCheck.off:
        return None
    found = estimate_built(build, optimizer_factory, shares, node.speaks)
    if found is not None:
        judge(found, node, mode, advice)
    return found


def check_before_start(
    build: Callable[[], nn.Module],
    shares: Callable[[], StateShares],
    optimizer_factory: OptimizerFactory,
    node: Node,
    mode: MemoryCheck,
    advice: str = SHARD_IT,
) -> None:
    """check() on the driver, before any rank starts. A whole replica on every rank (the most a
    strategy holds) is tried first: when that fits, as for most models, the strategies (and
    torch.distributed's DTensor, which they import) are not loaded here at all. Before it, the same
    with the optimizer's state bounded: when that fits, the optimizer is not built here either (a
    torch Optimizer imports torch._dynamo: about 3 s of every run's start on this driver)."""
    if mode == MemoryCheck.off:
        return
    bounded = estimate_built(build, None, WHOLE_REPLICA)
    if bounded is None or shortfall(bounded, node) is None:
        return  # (None: the model cannot be built on meta, said already)
    whole = estimate_built(build, optimizer_factory, WHOLE_REPLICA)
    if whole is not None and shortfall(whole, node) is not None:
        check(build, shares(), optimizer_factory, node, mode, advice)


def checked_on_driver(launcher: Any) -> bool:
    """Whether the driver checks before the ranks start: where it runs on the ranks' machine and
    knows how many there are (launcher=local with a fixed number of nodes, or under torchrun, where
    every rank is its own driver); on SLURM and Spark each node's local rank 0 does."""
    from dtf.config.schema import LocalLauncherConfig

    if not isinstance(launcher, LocalLauncherConfig):
        return False
    low, high = launcher.node_range()
    return low == high
