"""Horovod's own tests (horovod/horovod test/parallel/test_torch.py), ported to dtf.horovod and run
on 2 and 3 gloo ranks. One process group per world size runs every check in a row; each test
below reads one check's outcome on every rank. The checks keep Horovod's inputs and assertions;
where one was changed, its docstring says how and why.

Not ported, and why:
- GPU only (no GPU here): test_gpu_required, allreduce_multi_gpu, allreduce_cpu_gpu_error,
  grouped_allreduce_cpu_gpu_error, alltoall_splits_on_gpu, model_parallelism, broadcast_state_gpu.
- Process sets (dtf.horovod has the global one; torch.distributed.new_group makes groups): every
  *_process_sets test, optimizer_process_sets, process_set_barrier_op.
- Adasum (not offered; hvd.Average or hvd.Sum instead): delta_optimizer, reducescatter_adasum.
- APIs dtf.horovod does not offer: reducescatter and grouped_reducescatter (all their tests),
  grouped_allgather, sparse_allreduce_async (async_sparse_allreduce), SyncBatchNorm (its test
  needs CUDA; torch.nn.SyncBatchNorm is the PyTorch way), the timeline (timeline_api).
- Ranks issuing different operations at once: the duplicate-name tests have rank 0 start two
  operations while the others wait in a barrier; Horovod's coordinator matches operations by
  name, torch.distributed by order. They run here with every rank issuing the same operations.
- Timing: global_barrier_op measured that rank 1 waited 5 s for rank 0; here rank 0 leaves a
  file just before the barrier and the others find it just after. The async_fused tests asserted
  that poll() was False at least once (a race); here poll() is called and the results checked.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.gloo import run_on_ranks

WORLD_SIZES = [2, 3]
INT_TYPES = [torch.int32, torch.int64]


@dataclass
class Ctx:
    hvd: Any
    rank: int
    size: int
    tmp: Path


CHECKS: dict[str, Callable[[Ctx], None]] = {}


def check(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def tensor17(dim: int, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(1234)
    return torch.FloatTensor(*([17] * dim)).random_(-100, 100).to(dtype)


def raises(exceptions: type[BaseException] | tuple[type[BaseException], ...], fn: Callable[[], Any]) -> None:
    try:
        fn()
    except exceptions:
        return
    raise AssertionError(f"{fn} did not raise {exceptions}")


def optimizer_classes() -> list[tuple[str, type]]:
    """Horovod's list: torch.optim's optimizers but L-BFGS and SparseAdam (and Muon, which takes
    2-D parameters only, and the models here have biases)."""
    skip = {"LBFGS", "SparseAdam", "Muon"}
    found = [
        (c.__name__, c)
        for c in torch.optim.Optimizer.__subclasses__()
        if c.__module__.startswith("torch.optim") and c.__name__ not in skip
    ]
    return sorted(found, key=lambda t: t[0])


def new_optimizer(cls: type, opt_params: dict[str, Any], params: Iterable[Any]) -> Any:
    return cls(params, **{k: v for k, v in opt_params.items() if k in inspect.signature(cls.__init__).parameters})


# ---- init and queries ------------------------------------------------------------------------


@check
def check_horovod_reinit(c: Ctx) -> None:
    c.hvd.init()
    rank, size = c.hvd.rank(), c.hvd.size()
    c.hvd.shutdown()
    c.hvd.init()
    assert (c.hvd.rank(), c.hvd.size()) == (rank, size) == (c.rank, c.size)


@check
def check_horovod_is_initialized(c: Ctx) -> None:
    assert c.hvd.is_initialized()
    c.hvd.shutdown()
    assert not c.hvd.is_initialized()
    c.hvd.init()


@check
def check_horovod_rank_and_size(c: Ctx) -> None:
    assert c.hvd.rank() == c.rank and c.hvd.size() == c.size
    assert c.hvd.local_rank() == c.rank and c.hvd.local_size() == c.size  # one host
    assert c.hvd.cross_rank() == 0 and c.hvd.cross_size() == 1
    assert c.hvd.gloo_built() and not c.hvd.mpi_built() and c.hvd.nccl_built() == 0


# ---- allreduce -------------------------------------------------------------------------------


@check
def check_horovod_allreduce(c: Ctx) -> None:
    for dtype, dim in itertools.product([*INT_TYPES, torch.float32, torch.float64, torch.float16], [1, 2, 3]):
        tensor = tensor17(dim, dtype)
        summed = c.hvd.allreduce(tensor, average=False)
        assert torch.equal(summed.float(), tensor.float() * c.size), dtype


@check
def check_horovod_allreduce_average(c: Ctx) -> None:
    for dtype, dim in itertools.product([*INT_TYPES, torch.float32, torch.float64], [1, 2, 3]):
        tensor = tensor17(dim, dtype)
        assert torch.allclose(c.hvd.allreduce(tensor, average=True), tensor, 0), dtype


@check
def check_horovod_allreduce_min_max_product(c: Ctx) -> None:
    for dtype, dim in itertools.product([*INT_TYPES, torch.float32, torch.float64], [1, 2, 3]):
        torch.manual_seed(1234)
        tensors = torch.FloatTensor(c.size, *([17] * dim)).random_(-100, 100).to(dtype)
        tensor = tensors[c.rank, ...]
        assert torch.equal(c.hvd.allreduce(tensor, op=c.hvd.Min), tensors.min(0).values)
        assert torch.equal(c.hvd.allreduce(tensor, op=c.hvd.Max), tensors.max(0).values)
        assert torch.allclose(c.hvd.allreduce(tensor, op=c.hvd.Product), tensors.prod(0).to(dtype), 0)


@check
def check_horovod_allreduce_inplace(c: Ctx) -> None:
    for dtype, dim in itertools.product([*INT_TYPES, torch.float32, torch.float64, torch.float16], [1, 2, 3]):
        tensor = tensor17(dim, dtype)
        multiplied = (tensor.float() * c.size).to(dtype)
        returned = c.hvd.allreduce_(tensor, average=False)
        assert returned is tensor and torch.equal(tensor, multiplied)


@check
def check_horovod_allreduce_async_fused(c: Ctx) -> None:
    tests = []
    for dtype, dim in itertools.product([*INT_TYPES, torch.float32, torch.float64, torch.float16], [1, 2, 3]):
        tensor = tensor17(dim, dtype)
        handle = c.hvd.allreduce_async(tensor, average=False)
        c.hvd.poll(handle)
        tests.append((tensor.float() * c.size, handle))
    for multiplied, handle in tests:
        assert c.hvd.poll(handle) in (True, False)
        assert torch.equal(c.hvd.synchronize(handle).float(), multiplied)
        assert c.hvd.poll(handle)


def _scaling_dtype(dtype: torch.dtype) -> torch.dtype:
    """Horovod's test: integers are scaled in float64, float16 in float32 on CPU."""
    return torch.float32 if dtype == torch.float16 else torch.float64 if dtype in INT_TYPES else dtype


@check
def check_horovod_allreduce_prescale_postscale(c: Ctx) -> None:
    """Horovod compared a prescaled sum with the unrounded product size x value, which holds on
    2 ranks only (x + x is exact, x + x + x is rounded); here the product is rounded as the sum is."""
    for dtype, dim, where in itertools.product(
        [*INT_TYPES, torch.float32, torch.float64, torch.float16], [1, 2, 3], ["pre", "post"]
    ):
        np.random.seed(1234)
        factor = np.random.uniform()
        tensor = tensor17(dim, dtype)
        kwargs = {"prescale_factor": factor} if where == "pre" else {"postscale_factor": factor}
        summed = c.hvd.allreduce(tensor, average=False, **kwargs)
        compute = _scaling_dtype(dtype)
        f, t = torch.tensor(factor, dtype=torch.float64).to(compute), tensor.to(compute)
        # pre: each rank's scaled value, added up in its dtype (rounded once, at the third rank)
        pre = ((f * t).to(dtype).to(compute) * c.size).to(dtype)
        expected = pre if where == "pre" else (c.size * t * f).to(dtype)
        summed, expected = (x.float() if x.dtype == torch.float16 else x for x in (summed, expected))
        assert torch.allclose(summed, expected, 0), (dtype, where)


@check
def check_horovod_allreduce_error(c: Ctx) -> None:
    """Different shapes on different ranks: an error on every rank (not a hang, not garbage)."""
    tensor = torch.FloatTensor(*([17 + c.rank] * 3)).random_(-100, 100)
    raises(RuntimeError, lambda: c.hvd.allreduce(tensor))
    dims = [17, 23 * 57] if c.rank == 0 else [17, 23, 57]
    raises(RuntimeError, lambda: c.hvd.allreduce(torch.FloatTensor(*dims).random_(-100, 100)))


@check
def check_horovod_allreduce_type_error(c: Ctx) -> None:
    tensor = torch.IntTensor(*([17] * 3)) if c.rank % 2 == 0 else torch.FloatTensor(*([17] * 3))
    raises(RuntimeError, lambda: c.hvd.allreduce(tensor))


@check
def check_horovod_allreduce_duplicate_name_error(c: Ctx) -> None:
    """Every rank starts the same named operation twice (see the module doc)."""
    tensor = torch.FloatTensor(*([17] * 3)).zero_()
    handle = c.hvd.allreduce_async(tensor, name="duplicate_name")
    raises(ValueError, lambda: c.hvd.allreduce_async(tensor, name="duplicate_name"))
    c.hvd.synchronize(handle)
    c.hvd.synchronize(c.hvd.allreduce_async(tensor, name="duplicate_name"))  # free again once synchronized


@check
def check_horovod_allreduce_grad(c: Ctx) -> None:
    for dtype, dim, average in itertools.product([torch.float32, torch.float64], [1, 2, 3], [False, True]):
        tensor = tensor17(dim, dtype).requires_grad_()
        c.hvd.allreduce(tensor, average=average).backward(torch.ones([17] * dim, dtype=dtype))
        expected = np.ones([17] * dim) * (1 if average else c.size)
        assert np.linalg.norm(expected - tensor.grad.numpy()) < 1e-8


@check
def check_horovod_grouped_allreduce(c: Ctx) -> None:
    for dtype, dim in itertools.product([*INT_TYPES, torch.float32, torch.float64, torch.float16], [1, 2, 3]):
        torch.manual_seed(1234)
        tensors = [torch.FloatTensor(*([17] * dim)).random_(-100, 100).to(dtype) for _ in range(5)]
        summed = c.hvd.grouped_allreduce(tensors, average=False)
        assert all(torch.equal(s.float(), t.float() * c.size) for s, t in zip(summed, tensors, strict=True))
        averaged = c.hvd.grouped_allreduce(tensors, average=True)
        assert all(torch.allclose(a.float(), t.float(), 0) for a, t in zip(averaged, tensors, strict=True))
        multiplied = [(t.float() * c.size).to(dtype) for t in tensors]
        c.hvd.grouped_allreduce_(tensors, average=False)
        assert all(torch.equal(t, m) for t, m in zip(tensors, multiplied, strict=True))


# ---- allgather -------------------------------------------------------------------------------

ALLGATHER_TYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float32,
    torch.float64,
    torch.float16,
]


@check
def check_horovod_allgather(c: Ctx) -> None:
    for dtype, dim in itertools.product(ALLGATHER_TYPES, [1, 2, 3]):
        tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(c.rank).to(dtype)
        gathered = c.hvd.allgather(tensor)
        assert list(gathered.shape) == [17 * c.size] + [17] * (dim - 1)
        for i in range(c.size):
            part = gathered[i * 17 : (i + 1) * 17]
            assert list(part.shape) == [17] * dim and part.min() == i and part.max() == i


@check
def check_horovod_allgather_variable_size(c: Ctx) -> None:
    sizes = [17, 32, 81, 12, 15, 23, 22][: c.size]
    for dtype, dim in itertools.product(ALLGATHER_TYPES, [1, 2, 3]):
        tensor = torch.FloatTensor(*([sizes[c.rank]] + [17] * (dim - 1))).fill_(1).mul_(c.rank).to(dtype)
        gathered = c.hvd.allgather(tensor)
        assert list(gathered.shape) == [sum(sizes)] + [17] * (dim - 1)
        for i in range(c.size):
            part = gathered[sum(sizes[:i]) : sum(sizes[: i + 1])]
            assert list(part.shape) == [sizes[i]] + [17] * (dim - 1) and part.min() == i and part.max() == i


@check
def check_horovod_allgather_async_fused(c: Ctx) -> None:
    tests = []
    for dtype, dim in itertools.product(ALLGATHER_TYPES, [1, 2, 3]):
        handle = c.hvd.allgather_async(torch.FloatTensor(*([17] * dim)).fill_(1).mul_(c.rank).to(dtype))
        c.hvd.poll(handle)
        tests.append((handle, [17] * dim))
    for handle, shape in tests:
        gathered = c.hvd.synchronize(handle)
        for i in range(c.size):
            part = gathered[i * 17 : (i + 1) * 17]
            assert list(part.shape) == shape and part.min() == i and part.max() == i


@check
def check_horovod_allgather_errors(c: Ctx) -> None:
    sizes = [17] * 3
    sizes[1] = 10 * (c.rank + 1)
    raises(RuntimeError, lambda: c.hvd.allgather(torch.FloatTensor(*sizes).fill_(1)))
    tensor = torch.IntTensor(*([17] * 3)) if c.rank % 2 == 0 else torch.FloatTensor(*([17] * 3))
    raises(RuntimeError, lambda: c.hvd.allgather(tensor))


@check
def check_horovod_allgather_grad(c: Ctx) -> None:
    sizes = [3, 2, 7, 4, 6, 8, 10][: c.size]
    for dtype, dim in itertools.product([torch.float32, torch.float64], [1, 2, 3]):
        tensor = torch.FloatTensor(*([sizes[c.rank]] + [17] * (dim - 1))).fill_(1).mul_(c.rank).to(dtype)
        tensor.requires_grad_()
        grad_ys = torch.cat([torch.ones([n] + [17] * (dim - 1), dtype=dtype) * r for r, n in enumerate(sizes)])
        c.hvd.allgather(tensor).backward(grad_ys)
        expected = np.ones([sizes[c.rank]] + [17] * (dim - 1)) * c.rank
        assert np.linalg.norm(expected - tensor.grad.numpy()) < 1e-8


# ---- broadcast -------------------------------------------------------------------------------


@check
def check_horovod_broadcast(c: Ctx) -> None:
    for dtype, dim, root in itertools.product(ALLGATHER_TYPES, [1, 2, 3], range(c.size)):
        tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(c.rank).to(dtype)
        root_tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(root).to(dtype)
        broadcasted = c.hvd.broadcast(tensor, root)
        if c.rank != root:
            assert (tensor == root_tensor).max() == 0, "hvd.broadcast modifies source tensor"
        assert (broadcasted == root_tensor).min() == 1


@check
def check_horovod_broadcast_inplace(c: Ctx) -> None:
    for dtype, dim, root in itertools.product(ALLGATHER_TYPES, [1, 2, 3], range(c.size)):
        tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(c.rank).to(dtype)
        root_tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(root).to(dtype)
        broadcasted = c.hvd.broadcast_(tensor, root)
        assert (tensor == broadcasted).min() == 1 and (broadcasted == root_tensor).min() == 1


@check
def check_horovod_broadcast_errors(c: Ctx) -> None:
    sizes = [17] * 3
    sizes[1] = 10 * (c.rank + 1)
    raises(RuntimeError, lambda: c.hvd.broadcast(torch.FloatTensor(*sizes).fill_(1), 0))
    tensor = torch.IntTensor(*([17] * 3)) if c.rank % 2 == 0 else torch.FloatTensor(*([17] * 3))
    raises(RuntimeError, lambda: c.hvd.broadcast(tensor, 0))
    raises(RuntimeError, lambda: c.hvd.broadcast(torch.FloatTensor(*([17] * 3)).fill_(1), c.rank))  # rank error


@check
def check_horovod_broadcast_grad(c: Ctx) -> None:
    for dtype, dim, root in itertools.product([torch.float32, torch.float64], [1, 2, 3], range(c.size)):
        tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(c.rank).to(dtype).requires_grad_()
        c.hvd.broadcast(tensor, root).backward(torch.ones([17] * dim, dtype=dtype))
        expected = np.ones([17] * dim) * (1 if c.rank == root else 0)
        assert np.linalg.norm(expected - tensor.grad.numpy()) < 1e-8


# ---- alltoall --------------------------------------------------------------------------------


def alltoall_input(c: Ctx, dim: int, dtype: torch.dtype) -> torch.Tensor:
    vals: list[int] = []
    for i in range(c.size):
        vals += [i] * (c.rank + 1)
    tensor = torch.Tensor(vals)
    for _ in range(dim - 1):
        tensor = torch.cat((tensor.unsqueeze(1), tensor.unsqueeze(1)), dim=1)
    return tensor.to(dtype)


@check
def check_horovod_alltoall(c: Ctx) -> None:
    for dtype, dim in itertools.product(ALLGATHER_TYPES, [1, 2, 3]):
        splits = torch.tensor([c.rank + 1] * c.size, dtype=torch.int32)
        collected, received = c.hvd.alltoall(alltoall_input(c, dim, dtype), splits)
        assert collected.min() == c.rank and collected.max() == c.rank
        assert collected.numel() == c.size * (c.size + 1) // 2 * 2 ** (dim - 1)
        assert received.tolist() == [r + 1 for r in range(c.size)]


@check
def check_horovod_alltoall_equal_split(c: Ctx) -> None:
    for dtype, dim in itertools.product(ALLGATHER_TYPES, [1, 2, 3]):
        collected = c.hvd.alltoall(alltoall_input(c, dim, dtype))
        assert collected.min() == c.rank and collected.max() == c.rank
        assert collected.numel() == c.size * (c.size + 1) // 2 * 2 ** (dim - 1)


@check
def check_horovod_alltoall_errors(c: Ctx) -> None:
    tensor = torch.empty(c.size, dtype=torch.int32 if c.rank % 2 else torch.float32)
    raises(RuntimeError, lambda: c.hvd.alltoall(tensor))  # type error
    raises(ValueError, lambda: c.hvd.alltoall(torch.empty(c.size + 1)))  # equal split length error
    raises(ValueError, lambda: c.hvd.alltoall(torch.empty(c.size - 1), torch.ones(c.size, dtype=torch.int32)))
    raises(ValueError, lambda: c.hvd.alltoall(torch.empty(c.size), torch.empty(c.size, dtype=torch.float32)))
    sizes = [2 * c.size] * 3
    sizes[1] = 10 * (c.rank + 1)
    raises(RuntimeError, lambda: c.hvd.alltoall(torch.ones(sizes)))  # rank error


@check
def check_horovod_alltoall_grad(c: Ctx) -> None:
    for dtype, dim, equal in itertools.product([torch.float32, torch.float64], [1, 2, 3], [False, True]):
        tensor = alltoall_input(c, dim, dtype).requires_grad_()
        if equal:
            collected = c.hvd.alltoall(tensor)
        else:
            collected, _ = c.hvd.alltoall(tensor, torch.tensor([c.rank + 1] * c.size, dtype=torch.int32))
        collected.backward(torch.ones(collected.shape, dtype=dtype))
        assert np.linalg.norm(np.ones(tensor.shape) - tensor.grad.numpy()) < 1e-8


# ---- optimizer state and objects --------------------------------------------------------------

N, D_IN, H, D_OUT = 64, 100, 10, 10


def state_values(optimizer: Any) -> list[tuple[Any, Any]]:
    results = []
    state_dict = optimizer.state_dict()
    for group in state_dict["param_groups"]:
        for pid in group["params"]:
            for k, v in sorted(state_dict["state"].get(pid, {}).items()):
                results.append((k, v.clone() if torch.is_tensor(v) else v))
    return results


@check
def check_broadcast_state(c: Ctx) -> None:
    hvd = c.hvd
    x, y = torch.randn(N, D_IN), torch.randn(N, D_OUT)

    def create_model(opt_class: type, opt_params: dict[str, Any]) -> tuple[nn.Module, Any]:
        model = nn.Sequential(nn.Linear(D_IN, H), nn.ReLU(), nn.Linear(H, D_OUT))
        optimizer = new_optimizer(opt_class, opt_params, model.parameters())
        return model, hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    opt_params_list = [dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2)]
    for (_, opt_class), opt_params in itertools.product(optimizer_classes(), opt_params_list):
        model, optimizer = create_model(opt_class, opt_params)
        loss = F.mse_loss(model(x), y, reduction="sum")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model_values = [(k, v.clone()) for k, v in sorted(model.state_dict().items())]
        for name, value in model_values:
            hvd.broadcast_(value, root_rank=0, name=name)
        opt_values = []
        for name, value in state_values(optimizer):
            if torch.is_tensor(value):
                hvd.broadcast_(value, root_rank=0, name=f"{name}_tensor")
            else:
                value = hvd.broadcast_object(value, name=name)
            opt_values.append((name, value))
        fname = c.tmp / "broadcast_state.pt"
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, fname)
        hvd.barrier()
        model, optimizer = create_model(opt_class, opt_params)
        if hvd.rank() == 0:
            checkpoint = torch.load(fname)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for (name, before), (name_after, after) in zip(model_values, sorted(model.state_dict().items()), strict=True):
            assert name == name_after and type(before) is type(after) and (before == after).all()
        expected = hvd.broadcast_object(len(optimizer.state_dict()["state"].values()))
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        assert len(optimizer.state_dict()["state"].values()) == expected
        for (name, before), (name_after, after) in zip(opt_values, state_values(optimizer), strict=True):
            assert name == name_after and type(before) is type(after), (opt_class, name)
            assert (before == after).all() if torch.is_tensor(before) else before == after, (opt_class, name)


@check
def check_broadcast_state_options(c: Ctx) -> None:
    hvd = c.hvd
    x, y = torch.randn(N, D_IN), torch.randn(N, D_OUT)
    params_0 = dict(
        lr=0.1,
        momentum=0.8,
        weight_decay=0.2,
        nesterov=True,
        betas=(0.9, 0.999),
        etas=(0.8, 2.4),
        step_sizes=(1e-5, 100),
    )
    params_1 = dict(
        lr=0.2,
        momentum=0.9,
        weight_decay=0.1,
        nesterov=False,
        betas=(0.8, 0.9),
        etas=(0.25, 1.75),
        step_sizes=(1e-7, 5),
    )
    for _, opt_class in optimizer_classes():
        model = nn.Sequential(nn.Linear(D_IN, H), nn.ReLU(), nn.Linear(H, D_OUT))
        opt = new_optimizer(opt_class, params_0 if hvd.rank() == 0 else params_1, model.parameters())
        optimizer = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        F.mse_loss(model(x), y, reduction="sum").backward()
        optimizer.step()
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        p0 = {k: v for k, v in params_0.items() if k in inspect.signature(opt_class.__init__).parameters}
        for k, p in p0.items():
            actual = optimizer.param_groups[0][k]
            pairs = zip(actual, p, strict=True) if isinstance(p, tuple) else [(actual, p)]
            for a, e in pairs:
                assert type(a) is type(e) and abs(a - e) <= 1e-5, (opt_class, k)
        optimizer.zero_grad()
        F.mse_loss(model(x), y, reduction="sum").backward()
        optimizer.step()  # the broadcast option types work in the optimizer's math


@check
def check_broadcast_state_no_grad(c: Ctx) -> None:
    class ModelNoGrad(nn.Module):
        def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
            super().__init__()
            self.a = nn.Parameter(a.int(), requires_grad=False)
            self.b = nn.Parameter(b)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.index_select(self.b, 0, self.a.long()) * x

    model = ModelNoGrad(torch.Tensor([1, 3]), torch.rand(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    optimizer = c.hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    c.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    c.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    grad = optimizer.param_groups[0]["params"][1].grad
    assert optimizer.param_groups[0]["params"][0].grad is None
    assert torch.equal(grad, c.hvd.broadcast(grad, root_rank=0))


@check
def check_broadcast_and_allgather_object(c: Ctx) -> None:
    expected = {"hello": 123, 0: [1, 2]}
    assert c.hvd.broadcast_object(expected if c.rank == 0 else {}, root_rank=0) == expected
    d: dict[str, int] = {"metric_val_1": c.rank}
    if c.rank == 1:
        d["metric_val_2"] = 42
    want = [{"metric_val_1": i} for i in range(c.size)]
    want[1] = {"metric_val_1": 1, "metric_val_2": 42}
    assert c.hvd.allgather_object(d) == want


@check
def check_compression_fp16(c: Ctx) -> None:
    compression = c.hvd.Compression.fp16
    for dtype in [torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]:
        tensor = torch.ones([5] * 3, dtype=dtype)
        compressed, ctx = compression.compress(tensor)
        assert compressed.dtype == (torch.float16 if dtype.is_floating_point else dtype)
        decompressed = compression.decompress(compressed, ctx)
        assert decompressed.dtype == dtype and torch.equal(decompressed, tensor)


# ---- DistributedOptimizer --------------------------------------------------------------------


@check
def check_force_allreduce(c: Ctx) -> None:
    """Rank 0 leaves fc3 out of its loss: its step still takes part in fc3's allreduce."""
    x, y = torch.randn(N, D_IN), torch.randn(N, D_OUT)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(D_IN, H), nn.Linear(H, D_OUT), nn.Linear(D_OUT, D_OUT)

        def forward(self, x_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x1 = self.fc2(F.relu(self.fc1(x_)))
            return x1, self.fc3(F.relu(x1))

    for (_, opt_class), opt_params in itertools.product(
        optimizer_classes(), [dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2)]
    ):
        model = Net()
        c.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = new_optimizer(opt_class, opt_params, model.parameters())
        opt = c.hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        y1, y2 = model(x)
        loss = F.mse_loss(y1 if c.rank == 0 else y2, y, reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()


@check
def check_duplicate_and_missing_names(c: Ctx) -> None:
    net1, net2 = nn.Conv2d(1, 1, 1), nn.Conv2d(1, 1, 1)
    opt = torch.optim.SGD(itertools.chain(net1.parameters(), net2.parameters()), lr=0.1)
    named = itertools.chain(net1.named_parameters(), net2.named_parameters())
    raises(ValueError, lambda: c.hvd.DistributedOptimizer(opt, named_parameters=named))
    model = nn.Sequential(nn.Conv2d(1, 100, 1), nn.Conv2d(100, 1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raises(ValueError, lambda: c.hvd.DistributedOptimizer(opt, named_parameters=list(model.named_parameters())[0:1]))


@check
def check_dynamic_requires_grad(c: Ctx) -> None:
    gen, disc = nn.Conv2d(1, 10, 1), nn.Conv2d(10, 1, 1)
    inp = torch.rand([1, 1, 100, 100])
    gen_opt = c.hvd.DistributedOptimizer(
        torch.optim.SGD(gen.parameters(), lr=0.1), named_parameters=gen.named_parameters()
    )
    disc_opt = c.hvd.DistributedOptimizer(
        torch.optim.SGD(disc.parameters(), lr=0.1), named_parameters=disc.named_parameters()
    )

    def train_step(train_generator: bool = False, train_discriminator: bool = False) -> None:
        for p in gen.parameters():
            p.requires_grad_(train_generator)
        for p in disc.parameters():
            p.requires_grad_(train_discriminator)
        gen_opt.zero_grad()
        disc_opt.zero_grad()
        disc(gen(inp)).sum().backward()
        for p in gen.parameters():
            assert train_generator == (p.grad is not None and p.grad.max().is_nonzero())
        for p in disc.parameters():
            assert train_discriminator == (p.grad is not None and p.grad.max().is_nonzero())
        if train_generator:
            gen_opt.step()
        if train_discriminator:
            disc_opt.step()

    for _ in range(10):
        train_step(train_generator=True)
        train_step(train_discriminator=True)


@check
def check_gradient_clipping_and_synchronize_warning(c: Ctx) -> None:
    x, y = torch.ones(1, 1), torch.ones(1, 1)
    model = nn.Linear(1, 1)
    model.weight = nn.Parameter(torch.zeros(1, 1) + 0.5)
    model.bias = nn.Parameter(torch.zeros(1))
    c.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = c.hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    F.mse_loss(model(x), y).backward()
    optimizer.synchronize()
    prior = model.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert abs(prior) > abs(model.weight.grad.item())
    with optimizer.skip_synchronize():
        optimizer.step()
    # test_synchronize_step_warning: a step after synchronize() outside skip_synchronize() warns
    optimizer.zero_grad()
    F.mse_loss(model(torch.zeros(1, 1)), y).backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        optimizer.step()
    assert len(ws) == 1 and "optimizer.step() called without optimizer.skip_synchronize()" in str(ws[0].message)


@check
def check_no_named_parameters(c: Ctx) -> None:
    model = nn.Sequential(nn.Conv2d(1, 100, 1), nn.Conv2d(100, 1, 1))
    opt = c.hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.zero_grad()
    model(torch.rand([1, 1, 100, 100])).sum().backward()
    opt.step()
    # test_optimizer_no_named_parameters: two groups, unique names, the same on every rank
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.001)
    names = c.hvd.DistributedOptimizer(opt)._parameter_names
    assert len(names) == len(set(names.values()))
    gathered = c.hvd.allgather_object(set(names.values()))
    assert len(gathered) == c.size and all(g == gathered[0] for g in gathered)


@check
def check_sparse_embeddings(c: Ctx) -> None:
    """Horovod's test only steps; here the step is also checked against the dense average."""
    for sparse_as_dense in [False, True]:
        model = nn.Embedding(10, 3, sparse=True)
        c.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        inp = (
            torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if c.rank == 0 else torch.LongTensor([[1, 3, 4], [4, 7, 9]])
        )
        opt = c.hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(model.parameters()), lr=0.1), sparse_as_dense=sparse_as_dense
        )
        opt.zero_grad()
        model(inp).sum().backward()
        local = model.weight.grad.to_dense().clone()
        opt.synchronize()
        assert model.weight.grad.is_sparse
        assert torch.allclose(model.weight.grad.to_dense(), c.hvd.allreduce(local))
        with opt.skip_synchronize():
            opt.step()


@check
def check_backward_passes_per_step(c: Ctx) -> None:
    """Not one of Horovod's tests: its semantics, checked. With backward_passes_per_step=2 the
    gradients of two backward passes are summed locally and averaged over the ranks at step();
    zero_grad() in between, or a third pass, raises."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    c.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = c.hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=2,
    )
    batches = [torch.full((3, 4), float(c.rank + 1 + i)) for i in range(2)]
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for r, i in itertools.product(range(c.size), range(2)):  # every rank's two passes, summed, averaged
        probe = nn.Linear(4, 2)
        probe.load_state_dict(model.state_dict())
        probe(torch.full((3, 4), float(r + 1 + i))).sum().backward()
        for n, p in probe.named_parameters():
            expected[n] += p.grad / c.size
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(batches[0]).sum().backward()
    raises(AssertionError, opt.zero_grad)
    model(batches[1]).sum().backward()
    opt.step()
    for n, p in model.named_parameters():
        assert torch.allclose(before[n] - p.detach(), expected[n], atol=1e-5), n
    weight = nn.Parameter(torch.ones(3))
    opt = c.hvd.DistributedOptimizer(torch.optim.SGD([weight], lr=1.0), backward_passes_per_step=2)
    for _ in range(2):
        weight.sum().backward()
    raises(AssertionError, lambda: weight.sum().backward())  # a third pass before the step


# ---- barrier and join ------------------------------------------------------------------------


@check
def check_barrier(c: Ctx) -> None:
    marker = c.tmp / "barrier_marker"
    if c.rank == 0:
        time.sleep(0.3)
        marker.write_text("rank 0 was here")
    c.hvd.barrier()
    assert marker.exists()
    c.hvd.barrier()
    if c.rank == 0:
        marker.unlink()
    # test_barrier_with_multiple_collectives
    bcast = c.hvd.broadcast_async(torch.eye(3), root_rank=0)
    gather1, gather2 = c.hvd.allgather_async(torch.eye(5)), c.hvd.allgather_async(torch.zeros([5, 5]))
    allreduce_tensor = torch.eye(5)
    handle = c.hvd.allreduce_async(allreduce_tensor)
    c.hvd.barrier()
    assert torch.equal(c.hvd.synchronize(handle), allreduce_tensor)
    for h in (bcast, gather1, gather2):
        c.hvd.synchronize(h)


@check
def check_horovod_join_allreduce(c: Ctx) -> None:
    def div(t: torch.Tensor, s: int) -> torch.Tensor:
        return t.div(s, rounding_mode="trunc") if t.dtype in INT_TYPES else t / s

    for dtype, dim, first_join_rank, caching in itertools.product(
        [*INT_TYPES, torch.float32, torch.float64], [1, 2, 3], range(c.size), [False, True]
    ):
        torch.manual_seed(1234)
        tensor_a = torch.FloatTensor(*([5] * dim)).random_(-100, 100).to(dtype)
        tensor_b = torch.FloatTensor(*([17] * dim)).random_(-100, 100).to(dtype)
        if caching:
            c.hvd.synchronize(c.hvd.allreduce_async(tensor_a, name="tensor_a", average=True))
            c.hvd.synchronize(c.hvd.allreduce_async(tensor_b, name="tensor_b", average=True))
        if c.rank == first_join_rank:
            ret = c.hvd.join()
        else:
            handle_a = c.hvd.allreduce_async(tensor_a, name="tensor_a", average=True)
            handle_b = c.hvd.allreduce_async(tensor_b, name="tensor_b", average=True)
            averaged_a, averaged_b = c.hvd.synchronize(handle_a), c.hvd.synchronize(handle_b)
            ret = c.hvd.join()
            assert torch.allclose(averaged_a, div(tensor_a * (c.size - 1), c.size), 0)
            assert torch.allclose(averaged_b, div(tensor_b * (c.size - 1), c.size), 0)
        assert ret != first_join_rank
        assert c.hvd.allgather_object(ret) == [ret] * c.size


@check
def check_horovod_join_allgather_and_broadcast(c: Ctx) -> None:
    tensor = torch.FloatTensor(*([17] * 3))
    for op, first_join_rank in itertools.product(["allgather", "broadcast"], range(c.size)):
        if c.rank == first_join_rank:
            ret = c.hvd.join()
        else:
            if op == "allgather":
                raises(RuntimeError, lambda: c.hvd.allgather(tensor))
            else:
                raises(RuntimeError, lambda: c.hvd.broadcast(tensor, c.rank, name="test_horovod_join_broadcast"))
            ret = c.hvd.join()
        assert ret != first_join_rank
        assert c.hvd.allgather_object(ret) == [ret] * c.size


# ---- the harness -----------------------------------------------------------------------------


def run_checks(rank: int, world_size: int, out_dir: Path) -> None:
    """Every check in order on this rank; each outcome (None or a traceback) to out_dir."""
    import torch.distributed as dist

    import dtf.horovod as hvd

    torch.set_num_threads(1)
    resync = dist.new_group(backend="gloo")  # after a failed check: all ranks start the next one together
    outcomes: dict[str, str | None] = {}
    hvd.init()  # the process group run_on_ranks made
    for name, fn in CHECKS.items():
        started = time.perf_counter()
        try:
            fn(Ctx(hvd, rank, world_size, out_dir))
            outcomes[name] = None
        except Exception:
            outcomes[name] = traceback.format_exc()
        dist.barrier(group=resync)
        if os.environ.get("DTF_CHECK_TIMES") and rank == 0:
            print(f"{name}: {time.perf_counter() - started:.2f}s", flush=True)
    hvd.shutdown()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcomes))


@pytest.fixture(scope="module")
def outcomes() -> Iterable[dict[int, list[dict[str, str | None]]]]:
    """Each world size's outcomes per rank, made once (one process group per world size)."""
    by_world: dict[int, list[dict[str, str | None]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in WORLD_SIZES:
            out = Path(tmp) / str(world)
            out.mkdir()
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            run_on_ranks(run_checks, world, out)
            by_world[world] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
        yield by_world


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", list(CHECKS))
def test_horovod(outcomes: dict[int, list[dict[str, str | None]]], name: str, world: int) -> None:
    failed = {r: o[name] for r, o in enumerate(outcomes[world]) if o[name] is not None}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())
