"""trainer.memory_check (dtf.memory): the estimate follows the ZeRO formulas, measured
optimizer state included; a run that cannot fit is refused in one line, before anything is built;
the check draws nothing from the run's random streams."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from torch import nn

from dtf import memory
from dtf.config.schema import DDPStrategyConfig, FSDPStrategyConfig, MemoryCheck, MicsStrategyConfig, ZeroStrategyConfig
from dtf.errors import UserError
from dtf.models.deep_mlp import DeepMLP
from dtf.strategy import build

ADAM = functools.partial(torch.optim.Adam, lr=1e-3)
N = 4  # ranks


def test_the_optimizer_state_is_measured_per_element_and_per_tensor() -> None:
    assert memory.optimizer_state_bytes(ADAM, torch.float32) == (8, 4)  # two moments; a step counter
    assert memory.optimizer_state_bytes(ADAM, torch.bfloat16) == (4, 4)
    assert memory.optimizer_state_bytes(functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), torch.float32) == (
        4,
        0,
    )
    assert memory.optimizer_state_bytes(functools.partial(torch.optim.SGD, lr=0.1), torch.float32) == (0, 0)


@pytest.mark.parametrize(
    ("cfg", "per_parameter"),
    [
        (DDPStrategyConfig(), 4 + 4 + 8),
        (ZeroStrategyConfig(stage=1), 4 + 4 + 8 / N),
        (ZeroStrategyConfig(stage=2), 4 + (4 + 8) / N),
        (ZeroStrategyConfig(stage=3), (4 + 4 + 8) / N),
        (FSDPStrategyConfig(), (4 + 4 + 8) / N),
        (MicsStrategyConfig(partition_group_size=2), (4 + 4 + 8) / 2),
    ],
)
def test_the_estimate_is_the_zero_formula_of_the_strategy(cfg: object, per_parameter: float) -> None:
    with torch.device("meta"):
        model = DeepMLP()
    params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    found = memory.estimate(model, ADAM, build(cfg).state_shares(N))  # type: ignore[arg-type]
    step_counters = 4 * tensors * found.shares.optim
    assert found.parameters == params
    assert found.bytes_per_rank == pytest.approx(per_parameter * params + step_counters, abs=1)


def _node() -> memory.Node:
    return memory.Node(N, torch.device("cpu"))


def test_a_run_that_cannot_fit_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "host_memory_available", lambda: 3 * 2**30)
    ddp = build(DDPStrategyConfig()).state_shares(N)
    with pytest.raises(UserError) as refused:
        memory.check(lambda: DeepMLP(width=4096, depth=8), ddp, ADAM, _node(), MemoryCheck.refuse)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("trainer.memory_check: the model's state needs")
    assert "3.00 GiB free" in line and "strategy=fsdp" in line and "trainer.memory_check=warn" in line
    # sharded over the 4 ranks, a quarter of it fits
    fsdp = build(FSDPStrategyConfig()).state_shares(N)
    assert memory.check(lambda: DeepMLP(width=4096, depth=8), fsdp, ADAM, _node(), MemoryCheck.refuse)


def test_warn_says_so_and_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(memory, "host_memory_available", lambda: 1000)
    found = memory.check(DeepMLP, memory.WHOLE_REPLICA, ADAM, _node(), MemoryCheck.warn)
    assert found is not None
    assert capsys.readouterr().out.startswith("dtf: warning: trainer.memory_check: the model's state needs")
    assert memory.check(DeepMLP, memory.WHOLE_REPLICA, ADAM, _node(), MemoryCheck.off) is None


def test_the_check_draws_nothing_from_the_runs_random_streams() -> None:
    def drawing_model() -> nn.Module:  # a constructor that draws from every stream
        random.random(), np.random.rand(), torch.rand(1)
        return DeepMLP()

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    memory.check(drawing_model, memory.WHOLE_REPLICA, ADAM, _node(), MemoryCheck.refuse)
    after = (torch.rand(1).item(), random.random(), np.random.rand())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    assert after == (torch.rand(1).item(), random.random(), np.random.rand())


def test_this_machines_free_memory_is_read() -> None:
    free = memory.host_memory_available()
    assert free is not None and 0 < free < 2**50
