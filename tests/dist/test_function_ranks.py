"""trainer=function on 2 gloo ranks, and Horovod-style training beside dtf's own: one process group
runs every run in a row (dtf.train.function.run and dtf.train.loop.run, as a launcher's rank
would), and the tests read what each left behind.

- ZeRO-1 in function mode is dtf.strategy.zero1's element-wise sharding: the parameters end as
  under DDP, and each rank holds (4 + 4 + 8/N) / 16 of DDP's model state (Adam, fp32).
- A DistributedSampler the function keeps shards the whole set once (said once); without one,
  dtf's share; another rank-sharding sampler is refused.
- dtf.report is exact over the ranks.
- hvd.DistributedOptimizer trains the parameters dtf's DDP loop trains (SGD, same data order).
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dtf.data.datasets import scalar_field
from dtf.models.approximator import Approximator
from tests.helpers.gloo import run_on_ranks
from tests.helpers.inprocess import compose_config

WORLD = 2
SMALL = ["data.dataset.num_points=4000", "data.dataset.num_test=1000"]
MAGGY = ["trainer=function", "trainer.fn._target_=maggy_function.train", *SMALL]
LOOP = ["optimizer=sgd", "trainer.max_epochs=2", "data.dataset.num_points=2000", "data.dataset.num_test=200"]
SAMPLERS = ["distributed", "none", "own"]


def _function_run(name: str, overrides: list[str], root: Path, env: Any, payload: Any = None) -> None:
    from dtf.config.typed import typed
    from dtf.train import function

    (root / name).mkdir(parents=True, exist_ok=True)
    function.run(typed(compose_config([f"launcher.nproc={WORLD}", *overrides])), env, root / name, payload)


def _sampler_runs(rank: int, root: Path, env: Any) -> None:
    from returned_values import Indexed, indices_seen

    from dtf.train.function import SHIPPED, Payload

    for kind in SAMPLERS:
        sink: list[int] = []
        printed = io.StringIO()
        payload = Payload(
            indices_seen, train_set=Indexed(100), test_set=Indexed(30), hparams={"sampler": kind, "sink": sink}
        )
        try:
            with contextlib.redirect_stdout(printed):
                _function_run(
                    f"sampler_{kind}",
                    [f"trainer.fn={{_target_:{SHIPPED},_partial_:true}}", "trainer.objective=test/seen"],
                    root,
                    env,
                    payload,
                )
            outcome = {"seen": sink, "printed": printed.getvalue()}
        except Exception as e:
            outcome = {"error": str(e), "type": type(e).__name__}
        (root / f"sampler_{kind}_rank{rank}.json").write_text(json.dumps(outcome))


def _horovod_loop(rank: int, root: Path) -> None:
    """The Horovod way, on the same model, data and order as dtf's run LOOP (seed 0, shuffled by
    a DistributedSampler seeded alike, batch 32 per rank, SGD at the LR x world size)."""
    import torch.nn.functional as F
    from hydra.utils import instantiate

    import dtf.horovod as hvd
    from dtf.train.rng import seed_everything

    cfg = compose_config(LOOP)
    train_set, _ = instantiate(cfg.data.dataset)
    hvd.init()
    seed_everything(0)
    model = instantiate(cfg.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sampler = torch.utils.data.DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=0)
    loader = torch.utils.data.DataLoader(train_set, batch_size=cfg.data.batch_size, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    if rank == 0:
        torch.save(model.state_dict(), root / "horovod.pt")
    hvd.shutdown()


def _all_runs(rank: int, world_size: int, root: Path) -> None:
    from dtf.config.typed import typed
    from dtf.dist import env as dist_env
    from dtf.train import loop

    torch.set_num_threads(1)
    env = dist_env.init("cpu", "gloo", 60.0)  # the group run_on_ranks made
    errors = {}
    steps = {
        "ddp": lambda: _function_run("ddp", [*MAGGY, "strategy=ddp"], root, env),
        "zero": lambda: _function_run("zero", [*MAGGY, "strategy=zero"], root, env),
        "report": lambda: _function_run(
            "report", ["trainer=function", "trainer.fn._target_=returned_values.mean_of_batch_means", *SMALL], root, env
        ),
        "samplers": lambda: _sampler_runs(rank, root, env),
        "loop": lambda: loop.run(
            typed(compose_config([f"launcher.nproc={world_size}", *LOOP])), env, _made(root / "loop")
        ),
        "horovod": lambda: _horovod_loop(rank, root),
    }
    for name, step in steps.items():
        try:
            step()
        except Exception:
            errors[name] = traceback.format_exc()
    (root / f"errors_rank{rank}.json").write_text(json.dumps(errors))


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def runs() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run_on_ranks(_all_runs, WORLD, root)
        for rank in range(WORLD):
            errors = json.loads((root / f"errors_rank{rank}.json").read_text())
            assert not errors, "\n".join(f"{k} (rank {rank}):\n{v}" for k, v in errors.items())
        yield root


def summary(root: Path, name: str) -> dict[str, Any]:
    return json.loads((root / name / "summary.json").read_text())


def test_zero_stage_1_moves_the_parameters_as_ddp_and_holds_three_quarters_of_its_state(runs: Path) -> None:
    ddp, zero = summary(runs, "ddp"), summary(runs, "zero")
    assert zero["strategy_settings"]["stage"] == 1 and zero["params_sha256"] == ddp["params_sha256"]
    assert ddp["params_sha256_consistent"] and zero["params_sha256_consistent"]
    # Maggy's MLP, Adam in fp32: DDP holds 4 + 4 + 8 bytes per parameter, ZeRO-1 4 + 4 + 8/N
    p = sum(t.numel() for t in Approximator().parameters())
    for r in range(WORLD):
        assert ddp["model_state_bytes"][r] == 16 * p + 4 * 6  # + Adam's step counter for each of 6 tensors
        slice_elements = -(-p // WORLD)
        assert abs(zero["model_state_bytes"][r] - (8 * p + 8 * slice_elements)) <= 4 * (6 + WORLD)  # steps, padding
        assert zero["model_state_bytes"][r] / ddp["model_state_bytes"][r] == pytest.approx(0.75, abs=0.001)
    # element-wise: the optimizer state is split in halves, not by whole parameters
    assert abs(zero["optimizer_state_bytes"][0] - zero["optimizer_state_bytes"][1]) <= 8 * 2 + 4 * 6


def test_a_users_distributed_sampler_shards_the_whole_set_once_and_dtf_says_so_once(runs: Path) -> None:
    seen = [json.loads((runs / f"sampler_distributed_rank{r}.json").read_text()) for r in range(WORLD)]
    assert [sorted(s["seen"]) for s in seen] == [list(range(0, 100, 2)), list(range(1, 100, 2))]
    assert seen[0]["printed"].count("dtf: your DistributedSampler shards train_set by rank") == 1
    assert "DistributedSampler" not in seen[1]["printed"]  # rank 0 says it


def test_without_a_sampler_each_rank_gets_dtfs_share(runs: Path) -> None:
    seen = [json.loads((runs / f"sampler_none_rank{r}.json").read_text()) for r in range(WORLD)]
    assert [sorted(s["seen"]) for s in seen] == [list(range(0, 100, 2)), list(range(1, 100, 2))]
    assert "DistributedSampler" not in seen[0]["printed"]


def test_another_sampler_that_shards_by_rank_is_refused(runs: Path) -> None:
    for r in range(WORLD):
        outcome = json.loads((runs / f"sampler_own_rank{r}.json").read_text())
        assert outcome["type"] == "UserError" and "has a RankSampler, which shards by rank" in outcome["error"]


def test_dtf_report_is_exact_over_the_ranks(runs: Path) -> None:
    s = summary(runs, "report")
    model = Approximator()
    model.load_state_dict(torch.load(runs / "report" / "model.pt"))
    x, y = scalar_field(num_points=4000, num_test=1000)[1][:]
    with torch.no_grad():
        exact = (model(x) - y).pow(2).double().mean().item()
    assert s["result"]["exact_loss"] == pytest.approx(exact, rel=1e-6)


def test_horovods_distributed_optimizer_trains_what_dtfs_ddp_trains(runs: Path) -> None:
    dtf_state = torch.load(runs / "loop" / "model.pt")
    horovod_state = torch.load(runs / "horovod.pt")
    assert summary(runs, "loop")["global_step"] == 2 * 29  # 1800 samples, 900 a rank, batches of 32
    for name, value in dtf_state.items():
        assert torch.allclose(horovod_state[name], value, rtol=1e-6, atol=1e-7), name
