"""checkpoint.async_save on 2 gloo ranks of replicated (DDP) state: DCP gives each replicated
tensor to one rank to write; after the first save each rank copies only those (about half its
state), and every checkpoint still loads equal to a synchronous save of the same state."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.gloo import run_on_ranks


def _saves_alike(rank: int, world_size: int, root: Path) -> None:
    from dtf.config.schema import CheckpointConfig
    from dtf.dist.env import DistEnv
    from dtf.train.checkpoint import Checkpointer, load_app_state, verify

    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    torch.manual_seed(0)  # the same replica on both ranks, as DDP keeps it
    # Weights of 100 KB: replicated items that small are all written by rank 0 (dtf.train.save_plan).
    model = torch.nn.Sequential(*(torch.nn.Linear(160, 160) for _ in range(6)))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 160)).sum().backward()
    optimizer.step()

    def app_state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    sync = Checkpointer(CheckpointConfig(keep_last=3), root / "sync", env, strategy_name="ddp")
    in_background = Checkpointer(
        CheckpointConfig(async_save=True, keep_last=3), root / "async", env, strategy_name="ddp"
    )
    writer = in_background.writer
    assert writer is not None
    copied = []
    try:
        for step in (5, 6, 7):
            sync.write(step, app_state(), {"step": step})
            in_background.write(step, app_state(), {"step": step})
            in_background.finish()  # this save's reply: which buffers this rank's writer wrote
            copied.append(writer._buffers._written)
            with torch.no_grad():  # training goes on: each save must hold its own step's values
                for p in model.parameters():
                    p.mul_(0.5).add_(float(step))
            optimizer.param_groups[0]["lr"] /= 2
    finally:
        in_background.close()
    dist.barrier()  # rank 0's writer has committed the last save
    # What each rank copies after the first save: its share of the tensors, the two shares all of them.
    mine = copied[0]
    assert mine is not None and copied[1] == copied[2] == mine
    shares: list[frozenset[int]] = [frozenset()] * world_size
    dist.all_gather_object(shares, mine)
    tensors = len(writer._buffers._buffers)
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(range(tensors)), shares
    assert 0 < len(mine) < tensors
    for step in (5, 6, 7):
        path = in_background.path_of(step)
        assert verify(path) == (True, ""), verify(path)
        loaded = [copy.deepcopy(app_state()), copy.deepcopy(app_state())]
        for state, where in zip(loaded, (sync.path_of(step), path), strict=True):
            load_app_state(where, state)  # collective
        torch.testing.assert_close(loaded[0], loaded[1], rtol=0, atol=0)
        assert loaded[1]["optim"]["param_groups"][0]["lr"] == 1e-3 / 2 ** (step - 5)


def test_each_rank_copies_only_the_replicated_tensors_it_writes_and_every_save_equals_a_synchronous_one(
    tmp_path: Path,
) -> None:
    run_on_ranks(_saves_alike, 2, tmp_path)
