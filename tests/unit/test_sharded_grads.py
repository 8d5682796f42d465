"""Gradients of a sharded step equal DDP's, element for element (upstream pytorch#162338 saw
FSDP2 on gloo sum gradients instead of averaging them; SGD would be off by the world size)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from dtf.config.schema import DDPStrategyConfig, FSDPStrategyConfig, MicsStrategyConfig
from dtf.dist.compat import fsdp_param_groups
from dtf.dist.env import DistEnv
from dtf.models.blocks import find_blocks
from dtf.strategy.ddp import DDPStrategy
from dtf.strategy.fsdp import FSDPStrategy
from dtf.strategy.mics import MicsStrategy
from tests.helpers.gloo import run_on_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def _grads_match_ddp(rank: int, world: int, kind: str, backwards: int = 1) -> None:
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(rank))  # different data per rank
    y = torch.randn(8, 1, generator=torch.Generator().manual_seed(100 + rank))
    ddp, _ = DDPStrategy(OmegaConf.structured(DDPStrategyConfig())).setup(_model(), torch.optim.SGD, env)
    for _ in range(backwards):
        nn.functional.mse_loss(ddp(x), y).backward()
    if kind == "fsdp":
        strategy: FSDPStrategy = FSDPStrategy(OmegaConf.structured(FSDPStrategyConfig()))
    else:
        strategy = MicsStrategy(OmegaConf.structured(MicsStrategyConfig(partition_group_size=2)))
    sharded, _ = strategy.setup(_model(), torch.optim.SGD, env)
    for _ in range(backwards):
        nn.functional.mse_loss(sharded(x), y).backward()
    for p, q in zip(sharded.parameters(), ddp.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7)
    if backwards > 1:
        dist.barrier()
        return
    # and a gradient is the mean over ranks: recompute the full-batch gradient in one model
    full_x = torch.cat([torch.randn(8, 2, generator=torch.Generator().manual_seed(r)) for r in range(world)])
    full_y = torch.cat([torch.randn(8, 1, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)])
    single = _model()
    nn.functional.mse_loss(single(full_x), full_y).backward()
    for p, q in zip(sharded.parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
    dist.barrier()


def test_fsdp2_gradients_equal_ddp_on_two_ranks() -> None:
    run_on_ranks(_grads_match_ddp, 2, "fsdp")


def test_hsdp_gradients_equal_ddp_on_four_ranks() -> None:
    run_on_ranks(_grads_match_ddp, 4, "mics")


def test_hsdp_gradients_accumulated_over_two_backwards_without_no_sync_equal_ddp() -> None:
    # On CPU mics reduces across the groups while the backward goes on and writes the shards back
    # at its end; a unit whose gradients hold a previous backward's is reduced at once instead,
    # since FSDP2 adds the new shard to them as soon as its hook returns.
    run_on_ranks(_grads_match_ddp, 4, "mics", 2)


def _overlap_equals_blocking(rank: int, world: int) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from dtf.strategy import cpu_overlap

    env = DistEnv(rank, world, rank, torch.device("cpu"))
    issued: list[int] = []
    add = cpu_overlap._EndOfBackward.add
    cpu_overlap._EndOfBackward.add = lambda self, *a: (issued.append(1), add(self, *a))[1]  # type: ignore[method-assign]
    overlapped, _ = FSDPStrategy(OmegaConf.structured(FSDPStrategyConfig())).setup(_model(), torch.optim.SGD, env)
    blocking = _model()  # what FSDPStrategy shards, without the overlap
    for block in reversed(find_blocks(blocking, None)):
        fully_shard(block)
    fully_shard(blocking)
    units = [m for m in overlapped.modules() if isinstance(m, FSDPModule)]
    assert len(units) == 4 and all(g.unshard_async_op for u in units for g in fsdp_param_groups(u))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (overlapped, blocking)]
    # Step 1: a backward on fresh gradients reduce-scatters beside the backward, once for each of
    # the 3 units with parameters (the root has none of its own). Step 2: two backwards without
    # no_sync; in the second FSDP2 adds to the first's shards, so it reduce-scatters at once.
    for backwards, async_expected in ((1, [3]), (2, [3, 0])):
        for opt in optimizers:
            opt.zero_grad()
        for expected in async_expected:
            issued.clear()
            for i, model in enumerate((overlapped, blocking)):
                x = torch.randn(8, 2, generator=torch.Generator().manual_seed(rank + backwards))
                nn.functional.mse_loss(model(x), x[:, :1]).backward()
                if i == 0:
                    assert len(issued) == expected
        for p, q in zip(overlapped.parameters(), blocking.parameters(), strict=True):
            assert torch.equal(p.grad.to_local(), q.grad.to_local())  # the same operations: bit for bit
        for opt in optimizers:
            opt.step()
    for p, q in zip(overlapped.parameters(), blocking.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local())
    dist.barrier()


def test_fsdp2_on_cpu_overlaps_its_collectives_and_gives_the_blocking_gradients_bit_for_bit() -> None:
    run_on_ranks(_overlap_equals_blocking, 2)


def test_default_blocks_of_the_built_in_models() -> None:
    from dtf.models.approximator import Approximator
    from dtf.models.mnist_cnn import MnistCNN

    assert [type(b).__name__ for b in find_blocks(Approximator(), None)] == ["Linear"] * 3
    assert [type(b).__name__ for b in find_blocks(MnistCNN(), None)] == ["Conv2d", "Conv2d", "Linear", "Linear"]
