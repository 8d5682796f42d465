"""trainer=function / dtf.run_function: a plain single-machine training function (Maggy's
approximator as its post writes it, tests/helpers/maggy_function.py) made distributed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dtf.data.datasets import scalar_field
from dtf.models.approximator import Approximator
from tests.helpers.run_command import run_command

FUNCTION = ["trainer=function", "trainer.fn._target_=maggy_function.train"]


def full_test_loss(run_dir: Path, num_points: int, num_test: int) -> float:
    """The exported model's MSE over the whole test set, in this one process."""
    model = Approximator()
    model.load_state_dict(torch.load(run_dir / "model.pt"))
    _, test = scalar_field(num_points=num_points, num_test=num_test)
    x, y = test[:]
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y, reduction="sum").double() / len(test))


def test_on_one_rank_it_is_the_plain_function_bit_for_bit(tmp_path: Path) -> None:
    # dtf.run_function from a user's script: the function, the model class and the datasets are
    # shipped to the rank; on one rank the run is the function run in plain Python.
    body = """
import json, torch, dtf
from dtf.data.datasets import scalar_field
from dtf.models.approximator import Approximator
from dtf.train.summary import params_sha256
from dtf.train.rng import seed_everything
from maggy_function import train

train_set, test_set = scalar_field(num_points=3000, num_test=500)
built = []
def module(**kw):
    built.append(Approximator(**kw))
    return built[-1]
seed_everything(0)
plain = train(module, {"hidden": 50}, train_set, test_set)
s = dtf.run_function(train, module=Approximator, train_set=train_set, test_set=test_set, hparams={"hidden": 50},
                     overrides=["launcher.nproc=1", "trainer.progress=off"], run_dir="run")
print(json.dumps([plain, params_sha256(built[0].state_dict()), s]))
"""
    done = run_command([sys.executable, "-c", body], cwd=tmp_path, timeout=300)
    plain, plain_digest, summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["result"] == plain and summary["params_sha256"] == plain_digest
    assert summary["world_size"] == 1 and summary["steps_per_rank"] == [2 * 40]  # 2 epochs of ceil(2500 / 64)


SMALL = ["data.dataset.num_points=4000", "data.dataset.num_test=1000"]


def check_two_ranks(run) -> dict:  # type: ignore[no-untyped-def]
    """It trained on 2 ranks that agree, and returned the loss over the whole test set."""
    s = run.summary
    assert s["world_size"] == 2 and s["params_sha256_consistent"]
    assert s["steps_per_rank"] == [2 * 24] * 2  # 2 epochs of ceil(1500 / 64) on each rank
    assert s["result"] < 0.5  # z = sin(y) + cos(x) has variance ~1: it learned
    # What the ranks returned, averaged by their test samples, is the loss over the whole test set.
    assert s["result"] == pytest.approx(full_test_loss(run.run_dir, 4000, 1000), rel=1e-5)
    return s


# strategy=ddp and strategy=zero (stage 1) against each other: tests/dist/test_function_ranks.py
@pytest.mark.parametrize("strategy", [["strategy=zero", "strategy.stage=2"], ["strategy=fsdp"]])
def test_on_two_ranks_it_trains_under_the_sharded_strategies_and_the_ranks_agree(dtf, strategy: list[str]) -> None:  # type: ignore[no-untyped-def]
    check_two_ranks(dtf(*FUNCTION, *strategy, *SMALL))


def test_uneven_data_on_three_sharded_ranks_never_hangs(dtf) -> None:  # type: ignore[no-untyped-def]
    # 8,001 training samples and 193 test samples on 3 ranks: the test shares (65, 64, 64) make 2,
    # 1 and 1 batches of 64, and FSDP's forward is a collective in training; evaluation must not be.
    run = dtf(
        *FUNCTION,
        "strategy=fsdp",
        "launcher.nproc=3",
        "data.dataset.num_points=8194",
        "data.dataset.num_test=193",
        "trainer.dist_timeout_s=30",
        timeout=150,
    )
    s = run.summary
    assert s["steps_per_rank"] == [2 * 42] * 3 and s["data_dropped_per_epoch"] == 0  # 2667 each: ceil(2667 / 64)
    assert s["result"] == pytest.approx(full_test_loss(run.run_dir, 8194, 193), rel=1e-5)


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["trainer=function"], "dtf: error: trainer.fn._target_ is not set"),
        (
            [*FUNCTION, "+trainer.fn.epochs=3"],
            "dtf: error: trainer.fn.epochs is not a parameter of maggy_function.train",
        ),
    ],
)
def test_what_function_mode_cannot_do_is_one_line(dtf, args: list[str], start: str) -> None:  # type: ignore[no-untyped-def]
    run = dtf(*args, expect=2)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(start), run.stderr


def test_a_torchrun_style_function_and_a_horovodrunner_return_rank_0s_value(tmp_path: Path) -> None:
    # TorchDistributor's contract: the function makes its own process group from the environment;
    # HorovodRunner's: hvd.init() in the function, `import horovod.torch` given by install()
    body = """
import json, torch, torch.distributed as dist, dtf
from dtf.horovod import HorovodRunner, install

def plain(scale):
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": total.item() * scale}
    dist.destroy_process_group()
    return out

def with_horovod(offset):
    import horovod.torch as hvd
    hvd.init()
    return {"rank": hvd.rank(), "mean": hvd.allreduce(torch.tensor([float(hvd.rank())])).item() + offset}

if __name__ == "__main__":
    a = dtf.run_function(plain, 10, mode="torchrun", overrides=["launcher.nproc=2"], run_dir="plain")
    install()
    b = HorovodRunner(np=-2, run_dir="hvd").run(with_horovod, offset=1.0)
    print(json.dumps([a, b]))
"""
    (tmp_path / "script.py").write_text(body)
    done = run_command([sys.executable, "script.py"], cwd=tmp_path, timeout=300)
    plain, horovod = json.loads(done.stdout.strip().splitlines()[-1])
    assert plain == {"rank": 0, "world": 2, "sum": 30.0} and horovod == {"rank": 0, "mean": 1.5}
    for run_dir, returned in (("plain", plain), ("hvd", horovod)):
        summary = json.loads((tmp_path / run_dir / "summary.json").read_text())
        assert summary["mode"] == "torchrun" and summary["world_size"] == 2 and summary["result"] == returned
    assert "rank 0 returned {'rank': 0, 'mean': 1.5}" in done.stdout
