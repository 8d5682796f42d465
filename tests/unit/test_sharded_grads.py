"""Gradients of a sharded step equal DDP's, element for element (upstream pytorch#162338 saw
FSDP2 on gloo sum gradients instead of averaging them; SGD would be off by the world size)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from dtf.config.schema import DDPStrategyConfig, FSDPStrategyConfig, MicsStrategyConfig
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


def test_default_blocks_of_the_built_in_models() -> None:
    from dtf.models.approximator import Approximator
    from dtf.models.mnist_cnn import MnistCNN

    assert [type(b).__name__ for b in find_blocks(Approximator(), None)] == ["Linear"] * 3
    assert [type(b).__name__ for b in find_blocks(MnistCNN(), None)] == ["Conv2d", "Conv2d", "Linear", "Linear"]
