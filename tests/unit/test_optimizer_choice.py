"""dtf.train.optimizer: torch's fused kernel where the user left the implementation open, and the
user's choice (or torch's default) wherever it was made or fused cannot run."""

from __future__ import annotations

import functools

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from dtf.train.optimizer import fused_where_possible
from tests.helpers.inprocess import compose


def _built(*overrides: str, params: list | None = None) -> torch.optim.Optimizer:
    factory = instantiate(compose(*overrides).optimizer)
    return fused_where_possible(factory)(params if params is not None else nn.Linear(3, 2).parameters())


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_the_default_optimizers_are_fused_on_the_cpu(name: str) -> None:
    assert _built(f"optimizer={name}").defaults["fused"] is True


def test_the_users_choice_stands() -> None:
    assert not _built("+optimizer.fused=false").defaults["fused"]
    chosen = _built("+optimizer.foreach=true")
    assert chosen.defaults["foreach"] is True and not chosen.defaults["fused"]


def test_parameters_fused_cannot_take_are_left_to_torch() -> None:
    # fp64 is fused; integers are not for torch, bf16 (whose fused CPU update differs) not for dtf.
    assert _built(params=[nn.Parameter(torch.zeros(2, dtype=torch.float64))]).defaults["fused"] is True
    ints = [nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)]
    assert not _built(params=ints).defaults["fused"]
    assert not _built(params=[nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]).defaults["fused"]
    groups = [{"params": list(nn.Linear(2, 2).parameters()), "lr": 0.1}]
    assert _built(params=groups).defaults["fused"] is True


def test_an_optimizer_without_a_fused_kernel_is_built_as_given() -> None:
    factory = functools.partial(torch.optim.RMSprop, lr=0.1)
    assert fused_where_possible(factory) is factory


def test_the_fused_step_is_the_same_update() -> None:
    # The same formulas: a few Adam steps fused and in torch's loop agree to float32 rounding.
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    fused, loop = torch.optim.Adam(a.parameters(), 1e-2, fused=True), torch.optim.Adam(b.parameters(), 1e-2)
    for _ in range(5):
        x = torch.randn(8, 4)
        for model, opt in ((a, fused), (b, loop)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)
