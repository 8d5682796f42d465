from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP

from dtf.config.schema import DDPStrategyConfig
from dtf.dist.env import DistEnv
from dtf.strategy.ddp import DDPStrategy
from dtf.train.schedule import build_scheduler, default_warmup_start_factor, lr_scale_factor, scale_lr
from tests.helpers.gloo import run_on_ranks


def test_lr_scale_factors() -> None:
    assert lr_scale_factor("none", 8) == 1 and lr_scale_factor("linear", 8) == 8
    assert lr_scale_factor("sqrt", 4) == 2


def test_warmup_ramps_from_single_rank_lr_to_scaled_lr() -> None:
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    scale_lr(opt, 4.0)
    sched = build_scheduler(
        opt, None, total_steps=100, warmup_steps=4, warmup_start_factor=default_warmup_start_factor(4.0, 4)
    )
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()  # type: ignore[union-attr]
    assert lrs[0] == pytest.approx(0.1) and lrs[4] == pytest.approx(0.4) and lrs[5] == pytest.approx(0.4)
    assert all(a < b for a, b in itertools.pairwise(lrs[:5]))


def test_user_scheduler_receives_total_steps_after_warmup() -> None:
    from functools import partial

    from dtf.train.schedule import cosine_over_run

    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    sched = build_scheduler(
        opt, partial(cosine_over_run, eta_min=0.0), total_steps=20, warmup_steps=0, warmup_start_factor=1.0
    )
    for _ in range(20):
        opt.step()
        sched.step()  # type: ignore[union-attr]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert math.isclose(default_warmup_start_factor(1.0, 10), 0.1)


def _no_sync_defers_the_all_reduce(rank: int, world: int) -> None:
    strategy = DDPStrategy(OmegaConf.structured(DDPStrategyConfig()))
    torch.manual_seed(0)
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    model, opt = strategy.setup(torch.nn.Linear(3, 1, bias=False), lambda p: torch.optim.SGD(p, lr=0.1), env)
    assert isinstance(model, DDP)
    x = torch.full((1, 3), float(rank + 1))
    with strategy.no_sync(model):
        model(x).sum().backward()
    local = model.module.weight.grad.clone()
    torch.testing.assert_close(local, x)  # not averaged: stayed local
    model(x).sum().backward()  # the window's last micro-batch synchronises both
    mean_x = sum(float(r + 1) for r in range(world)) / world
    torch.testing.assert_close(model.module.weight.grad, torch.full((1, 3), 2 * mean_x))
    full = strategy.full_state_dict(model)
    assert list(full) == ["weight"]  # no "module." prefix
    assert strategy.model_state_bytes(model, opt) == 2 * 3 * 4  # params + grads, SGD has no state
    # strategy.bucket_cap_mb=null on CPU: 4 MB buckets, whose all-reduces start during the backward
    assert model.bucket_bytes_cap == 4 * 2**20
    chosen = DDPStrategy(OmegaConf.structured(DDPStrategyConfig(bucket_cap_mb=25)))
    assert chosen.setup(torch.nn.Linear(3, 1), lambda p: None, env)[0].bucket_bytes_cap == 25 * 2**20
    dist.barrier()


def test_ddp_no_sync_and_state_dict() -> None:
    run_on_ranks(_no_sync_defers_the_all_reduce, 2)


def _model_dict_check(rank: int, world: int) -> None:
    strategy = DDPStrategy(OmegaConf.structured(DDPStrategyConfig()))
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    model = torch.nn.ModuleDict({"encoder": torch.nn.Linear(2, 4), "head": torch.nn.Linear(4, 1)})
    wrapped, _ = strategy.setup(model, lambda p: torch.optim.SGD(p, lr=0.1), env)
    assert all(isinstance(m, DDP) for m in wrapped.values())
    assert sorted(strategy.full_state_dict(wrapped)) == ["encoder.bias", "encoder.weight", "head.bias", "head.weight"]
    dist.barrier()


def test_model_dict_is_wrapped_per_module() -> None:
    run_on_ranks(_model_dict_check, 2)
