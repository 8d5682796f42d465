"""dtf.strategy.optimizer_state.allocate_state, which a resume loads the optimizer's state into,
makes on every rank what torch's own zero-gradient step makes (torch.distributed.checkpoint.
state_dict's _init_optim_state): the same keys, and each tensor of the same kind, layout, shape, dtype and
device. Checked against torch's on the FSDP family's sharded parameters: unevenly sharded, one
rank's shard empty, and on a 2-D mesh as strategy=mics lays them out. That the resumed runs then
continue bit for bit is tests/e2e/test_checkpoint.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.gloo import run_on_ranks

# Each with the settings that change what its state holds.
OPTIMIZERS = [
    ("Adam", {"lr": 0.01}),
    ("Adam", {"lr": 0.01, "amsgrad": True}),
    ("AdamW", {"lr": torch.tensor(0.01)}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}),
    ("NAdam", {"lr": 0.01}),
    ("ASGD", {"lr": 0.01}),
]


def _layout(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        return (
            "DTensor",
            value.placements,
            value.device_mesh.shape,
            value.shape,
            local.shape,
            value.dtype,
            value.device,
        )
    if isinstance(value, torch.Tensor):
        return ("Tensor", value.shape, value.dtype, value.device)
    return type(value)


def _model(mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # 5 rows over 2 ranks: 3 and 2; 1 row: rank 1's shard is empty.
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 1))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _compare(rank: int, world_size: int, out: Path) -> None:
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.distributed.device_mesh import init_device_mesh

    from dtf.strategy.optimizer_state import allocate_state

    meshes = {
        "fsdp": init_device_mesh("cpu", (world_size,)),
        "mics": init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard")),
    }
    for mesh_name, mesh in meshes.items():
        for name, settings in OPTIMIZERS:
            cls = getattr(torch.optim, name)
            ours, theirs = _model(mesh), _model(mesh)
            mine, torchs = cls(ours.parameters(), **settings), cls(theirs.parameters(), **settings)
            allocate_state(mine)
            _init_optim_state(torchs)
            case = f"{mesh_name} {name} {settings}"
            assert mine.state, case  # made here, not left to torch's step
            for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
                assert sorted(mine.state[p]) == sorted(torchs.state[q]), case
                for key in torchs.state[q]:
                    assert _layout(mine.state[p][key]) == _layout(torchs.state[q][key]), f"{case} {key}"
            # The parameters are untouched, and the groups' settings (the learning rate) are the user's.
            for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
                assert torch.equal(p.to_local(), q.to_local()), case
            assert mine.param_groups[0]["lr"] is settings["lr"], case
    (out / f"{rank}.ok").touch()


def test_the_state_a_resume_loads_into_is_laid_out_as_torchs_step_makes_it(tmp_path: Path) -> None:
    run_on_ranks(_compare, 2, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.ok", "1.ok"]


class _OwnAdam(torch.optim.Adam):
    """An optimizer from outside torch.optim: what its state holds is its own business."""


@pytest.mark.parametrize("cls", [_OwnAdam, torch.optim.Adafactor])
def test_optimizers_it_cannot_vouch_for_are_left_to_torchs_step(cls: type[torch.optim.Optimizer]) -> None:
    from dtf.strategy.optimizer_state import allocate_state

    # Adafactor keeps factored row and column statistics, not shaped like the parameter.
    optimizer = cls(torch.nn.Linear(3, 4).parameters(), lr=0.01)
    allocate_state(optimizer)
    assert not optimizer.state
