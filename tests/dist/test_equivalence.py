"""The proof that sharding, averaging, accumulation and LR scaling are right: a 2-rank dtf run
ends where a plain single-process PyTorch loop over the same global batches ends."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DistributedSampler

from dtf.data.datasets import scalar_field
from dtf.models.approximator import Approximator


def plain_loop(
    *,
    world_size: int,
    batch_size: int,
    epochs: int,
    lr: float,
    optimizer: str,
    lr_scale: float,
    accum: int = 1,
    max_steps: int | None = None,
    clip: float | None = None,
    warmup_steps: int = 0,
    seed: int = 0,
) -> tuple[float, float, dict[str, torch.Tensor]]:
    """One process, no torch.distributed: each step sees the union of what the ranks would see."""
    torch.manual_seed(seed)
    model = Approximator()
    train, test = scalar_field()
    params = model.parameters()
    opt = (
        torch.optim.Adam(params, lr=lr * lr_scale) if optimizer == "adam" else torch.optim.SGD(params, lr=lr * lr_scale)
    )
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1 / lr_scale, total_iters=warmup_steps) if warmup_steps else None
    mse = torch.nn.MSELoss()
    step = 0
    for epoch in range(epochs if max_steps is None else 10**6):
        shards = []
        for rank in range(world_size):
            sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            idx = list(sampler)
            shards.append([idx[k : k + batch_size] for k in range(0, len(idx), batch_size)])
        num_micro = len(shards[0])
        total, count = 0.0, 0
        for start in range(0, num_micro, accum):
            window = range(start, min(start + accum, num_micro))
            for j in window:
                idx = [i for shard in shards for i in shard[j]]
                x, y = train[idx]
                loss = mse(model(x), y)
                (loss / len(window)).backward()
                total += loss.item() * len(idx)
                count += len(idx)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            step += 1
            if max_steps is not None and step >= max_steps:
                break
        if max_steps is not None and step >= max_steps:
            break
    with torch.no_grad():
        x, y = test[:]
        test_loss = mse(model(x), y).item()
    return total / count, test_loss, {f"net.{k}": v for k, v in model.net.state_dict().items()}


CASES = {
    "adam-linear": dict(
        args=["data.batch_size=32", "trainer.max_epochs=2"],
        loop=dict(batch_size=32, epochs=2, lr=1e-3, optimizer="adam", lr_scale=2.0),
    ),
    "sgd-sqrt-accum-clip-warmup-maxsteps": dict(
        args=[
            "optimizer=sgd",
            "optimizer.lr=0.05",
            "trainer.lr_scaling=sqrt",
            "data.batch_size=16",
            "trainer.grad_accum_steps=2",
            "trainer.grad_clip_norm=0.5",
            "trainer.warmup_steps=10",
            "trainer.max_steps=150",
        ],
        # the global batch is 2 ranks x 2 micro-batches x 16: sqrt scaling multiplies the LR by sqrt(4)
        loop=dict(
            batch_size=16,
            epochs=0,
            lr=0.05,
            optimizer="sgd",
            lr_scale=math.sqrt(2 * 2),
            accum=2,
            clip=0.5,
            warmup_steps=10,
            max_steps=150,
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_single_process_loop(dtf, case):  # type: ignore[no-untyped-def]
    spec = CASES[case]
    run = dtf("launcher.nproc=2", *spec["args"])
    s = run.summary
    train_loss, test_loss, params = plain_loop(world_size=2, **spec["loop"])
    assert s["world_size"] == 2 and s["steps_per_rank"][0] == s["steps_per_rank"][1] == s["global_step"]
    assert s["final_train_loss"] == pytest.approx(train_loss, rel=1e-4)
    assert s["final_test_loss"] == pytest.approx(test_loss, rel=1e-4)
    weights = torch.load(run.run_dir / "model.pt", weights_only=True)
    assert weights.keys() == params.keys()
    for k in params:
        torch.testing.assert_close(weights[k], params[k], rtol=1e-4, atol=1e-5)
