"""One switch, same result: every sharding strategy trains like DDP (SGD, so a gradient-scale
error cannot hide) and holds the per-rank memory the ZeRO paper promises.

The runs go through the ranks' own body (dtf.train.loop.run) on gloo ranks started once per test
(tests.helpers.inprocess.train_on_ranks): ~1 s a run instead of ~10 s through `python -m dtf`.
What is compared here is the strategies, not the launcher (dtf.cli, dtf.launch and dtf.rank never
look at the strategy); the command line runs FSDP in tests/dist/test_precision.py and
tests/e2e/test_checkpoint.py, ZeRO-1 in tests/e2e/test_slurm.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dtf.models.approximator import Approximator
from dtf.strategy.mics import BF16_ACROSS_TOLERANCE, relative_distance
from tests.helpers.embedding_lm import TinyGPT
from tests.helpers.inprocess import train_on_ranks

SGD = [
    "optimizer=sgd",
    "optimizer.lr=0.01",
    "optimizer.momentum=0.9",
    "trainer.max_epochs=2",
    "data.dataset.num_points=2400",
    "data.dataset.num_test=400",
]
# strategy.cross_group_dtype=bfloat16 against DDP after SGD's 2 epochs (32 steps, momentum 0.9):
# the losses within 1% (measured 0.5%), the parameters within dtf's BF16_ACROSS_TOLERANCE.
MICS_BF16_LOSS_TOLERANCE = 1e-2
BF16_ACROSS = ["strategy.cross_group_dtype=bfloat16"]
STRATEGIES_2 = {
    "zero1": ["strategy=zero", "strategy.stage=1"],
    "zero2": ["strategy=zero", "strategy.stage=2"],
    "zero3": ["strategy=zero", "strategy.stage=3"],
    "fsdp": ["strategy=fsdp"],
}


@dataclass
class Run:
    summary: dict[str, Any]
    run_dir: Path


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("strategies")


def _train(runs_dir: Path, world: int, *runs: tuple[str, list[str]]) -> dict[str, Run]:
    """The runs, in order, on `world` ranks started once; each in runs_dir/<name>."""
    summaries = train_on_ranks(world, list(runs), runs_dir)
    return {name: Run(summary, runs_dir / name) for name, summary in summaries.items()}


def _assert_same_training(run: Run, reference: Run, rel: float = 1e-5) -> None:
    a, b = run.summary, reference.summary
    assert a["steps_per_rank"] == b["steps_per_rank"]
    assert a["train_loss_per_epoch"] == pytest.approx(b["train_loss_per_epoch"], rel=rel)
    assert a["test_loss_per_epoch"] == pytest.approx(b["test_loss_per_epoch"], rel=rel)
    assert a["params_sha256_consistent"]
    ours = torch.load(run.run_dir / "model.pt", weights_only=True)
    theirs = torch.load(reference.run_dir / "model.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=rel, atol=1e-5)


@pytest.fixture(scope="module")
def two_ranks_sgd(runs_dir: Path) -> dict[str, Run]:
    """DDP and each of STRATEGIES_2 on 2 ranks, SGD."""
    return _train(
        runs_dir, 2, ("ddp2", ["strategy=ddp", *SGD]), *[(name, [*args, *SGD]) for name, args in STRATEGIES_2.items()]
    )


@pytest.mark.parametrize("name", list(STRATEGIES_2))
def test_strategy_trains_like_ddp_on_two_ranks(two_ranks_sgd: dict[str, Run], name: str) -> None:
    run = two_ranks_sgd[name]
    assert run.summary["strategy"] == ("fsdp" if name == "fsdp" else "zero")
    assert run.summary["world_size"] == 2
    _assert_same_training(run, two_ranks_sgd["ddp2"])


@pytest.mark.slow
def test_mics_on_four_ranks_trains_like_ddp(runs_dir: Path) -> None:
    runs = _train(
        runs_dir,
        4,
        ("ddp4", ["strategy=ddp", *SGD]),
        ("mics4", ["strategy=mics", "strategy.partition_group_size=2", *SGD]),
        ("mics4_bf16", ["strategy=mics", "strategy.partition_group_size=2", *BF16_ACROSS, *SGD]),
    )
    assert runs["mics4"].summary["strategy"] == "mics" and runs["mics4"].summary["world_size"] == 4
    _assert_same_training(runs["mics4"], runs["ddp4"])
    # Across the groups in bf16: the replicas still agree bit for bit, the model stays within the
    # tolerances above of DDP's, and is not equal to fp32 MiCS's (or the setting did nothing).
    bf16, ddp = runs["mics4_bf16"], runs["ddp4"]
    assert bf16.summary["params_sha256_consistent"]
    for key in ("train_loss_per_epoch", "test_loss_per_epoch"):
        assert bf16.summary[key] == pytest.approx(ddp.summary[key], rel=MICS_BF16_LOSS_TOLERANCE)
    ours = torch.load(bf16.run_dir / "model.pt", weights_only=True)
    theirs = torch.load(ddp.run_dir / "model.pt", weights_only=True)
    assert relative_distance(ours, theirs) < BF16_ACROSS_TOLERANCE
    exact = torch.load(runs["mics4"].run_dir / "model.pt", weights_only=True)
    assert any(not torch.equal(ours[k], exact[k]) for k in ours)


def test_cnn_blocks_and_fsdp_options_train_like_ddp(runs_dir: Path) -> None:
    cnn = ["+experiment=digits_cnn", "trainer.max_epochs=1", "model.dropout=0.0"]
    runs = _train(
        runs_dir,
        2,
        ("cnn_ddp", cnn),
        # activation checkpointing and CPU offload change where tensors live, never the numbers
        (
            "cnn_fsdp",
            [*cnn, "strategy=fsdp", "trainer.activation_checkpointing=[Conv2d,Linear]", "strategy.cpu_offload=true"],
        ),
    )
    _assert_same_training(runs["cnn_fsdp"], runs["cnn_ddp"], rel=1e-4)


# Mixed precision (trainer.precision) on every strategy: tests/dist/test_precision.py.


# -- memory ---------------------------------------------------------------------------------
ADAM_DEEP = [
    "model=deep_mlp",
    "optimizer=adam",
    "trainer.max_steps=2",
    "data.dataset.num_points=1000",
    "data.dataset.num_test=100",
    "trainer.export_weights=false",
]


def _ratios(run: Run, reference: Run) -> list[float]:
    ref = reference.summary["model_state_bytes"][0]
    return [b / ref for b in run.summary["model_state_bytes"]]


def test_model_state_bytes_follow_the_zero_formulas(runs_dir: Path) -> None:
    n = 2
    runs = _train(
        runs_dir,
        n,
        ("mem_ddp", ADAM_DEEP),
        *[(f"mem_{name}", [*args, *ADAM_DEEP]) for name, args in STRATEGIES_2.items()],
    )
    ddp = runs["mem_ddp"]
    num_params = sum(p.numel() for p in __import__("dtf.models.deep_mlp", fromlist=["DeepMLP"]).DeepMLP().parameters())
    # DDP, fp32 Adam: 4 (param) + 4 (grad) + 8 (two moments) bytes per parameter, + one step counter per tensor
    assert ddp.summary["model_state_bytes"] == [16 * num_params + 4 * 20] * n
    expected = {
        "zero1": (8 + 8 / n) / 16,  # optimizer state sharded
        # ZeRO-2 promises at most (4 + 12/N)/16; FSDP2 also keeps parameters sharded between steps,
        # so torch's stage 2 measures 1/N like stage 3.
        "zero2": 1 / n,
        "zero3": 1 / n,
        "fsdp": 1 / n,
    }
    for name, ratio in expected.items():
        measured_all = _ratios(runs[f"mem_{name}"], ddp)
        assert len(measured_all) == n
        for measured in measured_all:
            assert measured == pytest.approx(ratio, rel=0.05), (name, measured, ratio)
    assert (4 + 12 / n) / 16 >= expected["zero2"]
    # trainer.memory_check's estimate, made before the model existed, is what the ranks then held
    # (ZeRO-2's is its peak, parameters gathered from forward to backward: more than at rest)
    for name in ("ddp", *expected):
        run = runs[f"mem_{name}"].summary
        most = max(run["model_state_bytes"])
        if name == "zero2":
            assert run["model_state_estimate_bytes"] == pytest.approx((4 + 12 / n) / 16 * 16 * num_params, rel=0.01)
        else:
            assert run["model_state_estimate_bytes"] == pytest.approx(most, rel=0.001), name


@pytest.mark.slow
def test_mics_holds_one_partition_groups_share(runs_dir: Path) -> None:
    mics = [(f"mem_mics{g}", ["strategy=mics", f"strategy.partition_group_size={g}", *ADAM_DEEP]) for g in (2, 4)]
    runs = _train(runs_dir, 4, ("mem_ddp4", ADAM_DEEP), *mics)
    ddp = runs["mem_ddp4"]
    for group in (2, 4):
        measured_all = _ratios(runs[f"mem_mics{group}"], ddp)
        assert len(measured_all) == 4
        for measured in measured_all:
            assert measured == pytest.approx(1 / group, rel=0.05), (group, measured)


def test_meta_init_materialises_only_the_local_shards(runs_dir: Path) -> None:
    runs = _train(
        runs_dir,
        2,
        (
            "meta",
            [
                "strategy=fsdp",
                "strategy.meta_init=true",
                "model=deep_mlp",
                "trainer.max_epochs=2",
                "data.dataset.num_points=2400",
                "data.dataset.num_test=400",
            ],
        ),
        (
            "meta_ref",
            [
                "model=deep_mlp",
                "trainer.max_steps=1",
                "data.dataset.num_points=1000",
                "data.dataset.num_test=100",
                "trainer.export_weights=false",
            ],
        ),
    )
    run = runs["meta"]
    measured_all = _ratios(run, runs["meta_ref"])
    assert len(measured_all) == 2
    for measured in measured_all:
        assert measured == pytest.approx(0.5, rel=0.05)
    # initialised locally (its own seed per shard), it still learns the field
    assert run.summary["test_loss_per_epoch"][-1] < 0.5


def test_delayed_init_of_a_whole_replica_is_the_eager_init_bit_for_bit(runs_dir: Path) -> None:
    # DDP and ZeRO-1 with strategy.meta_init: built on meta, allocated on the device, initialised by
    # reset_parameters in the constructor's order: the same weights as built eagerly
    runs = _train(
        runs_dir,
        2,
        ("eager", ADAM_DEEP),
        ("ddp_meta", [*ADAM_DEEP, "strategy.meta_init=true"]),
        ("zero1_meta", [*ADAM_DEEP, "strategy=zero", "strategy.meta_init=true"]),
    )
    eager = runs["eager"].summary["params_sha256"]
    assert runs["ddp_meta"].summary["params_sha256"] == eager
    assert runs["zero1_meta"].summary["params_sha256"] == eager


def test_mics_meta_init_gives_every_replica_of_a_shard_the_same_weights(runs_dir: Path) -> None:
    # ranks 0 and 2 hold the same shard in different replica groups (and 1 and 3): with a seed per
    # rank they would start, and stay, different
    runs = _train(
        runs_dir,
        4,
        (
            "mics_meta",
            [
                "strategy=mics",
                "strategy.partition_group_size=2",
                "strategy.meta_init=true",
                "model=deep_mlp",
                "trainer.max_steps=3",
                "data.dataset.num_points=1000",
                "data.dataset.num_test=100",
            ],
        ),
    )
    assert runs["mics_meta"].summary["world_size"] == 4
    assert runs["mics_meta"].summary["params_sha256_consistent"]


# -- ZeRO stage 1: element-wise shards -------------------------------------------------------
TINY_GPT = [
    "model._target_=embedding_lm.TinyGPT",
    "~model.in_features",
    "~model.hidden",
    "~model.out_features",
    "data.dataset._target_=embedding_lm.successor_tokens",
    "~data.dataset.low",
    "~data.dataset.high",
    "loss=cross_entropy",
    "metrics=none",
]
MEMORY_MODELS = {
    "approximator": ([], Approximator),  # one 100x100 weight holds 95% of it
    "tiny_gpt": (TINY_GPT, TinyGPT),  # ~79% of it in the token embedding
}
ADAM_SHORT = [
    "optimizer=adam",
    "trainer.max_steps=2",
    "data.dataset.num_points=1000",
    "data.dataset.num_test=100",
    "trainer.export_weights=false",
]


@pytest.fixture(scope="module")
def zero1_memory(runs_dir: Path) -> dict[tuple[str, int], Run]:
    """(model, N) -> ZeRO-1 on N ranks, and (model, 0) -> DDP on 2 ranks; each world size's runs
    are made the first time one of them is asked for."""

    class Runs(dict[tuple[str, int], Run]):
        def __missing__(self, key: tuple[str, int]) -> Run:
            world = key[1] or 2
            runs = [
                (f"mem1_zero1_{m}_{world}", [*STRATEGIES_2["zero1"], *args, *ADAM_SHORT])
                for m, (args, _) in MEMORY_MODELS.items()
            ]
            if world == 2:
                runs += [(f"mem1_ddp_{m}", [*args, *ADAM_SHORT]) for m, (args, _) in MEMORY_MODELS.items()]
            done = _train(runs_dir, world, *runs)
            for m in MEMORY_MODELS:
                self[m, world] = done[f"mem1_zero1_{m}_{world}"]
                if world == 2:
                    self[m, 0] = done[f"mem1_ddp_{m}"]
            return self[key]

    return Runs()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("model", list(MEMORY_MODELS))
def test_zero1_holds_one_nth_of_the_optimizer_state_on_every_rank(
    zero1_memory: dict[tuple[str, int], Run], model: str, n: int
) -> None:
    _, build = MEMORY_MODELS[model]
    params = list(build().parameters())  # a tied weight counts once, as the optimizer sees it
    num_params = sum(p.numel() for p in params)
    ddp = zero1_memory[model, 0]
    # DDP, fp32 Adam: 4 (param) + 4 (grad) + 8 (two moments) bytes per parameter, + a step counter per tensor
    assert ddp.summary["model_state_bytes"] == [16 * num_params + 4 * len(params)] * 2
    measured = _ratios(zero1_memory[model, n], ddp)
    assert len(measured) == n
    # Every rank: its parameters and gradients in full, 1/N of the moments. The tolerance covers
    # the step counters (one per piece of a parameter) and the padding to a multiple of N.
    assert measured == pytest.approx([(4 + 4 + 8 / n) / 16] * n, rel=1e-3), (model, n, measured)


def test_zero1_keeps_param_groups_like_ddp(runs_dir: Path) -> None:
    # nanoGPT's recipe as a user's optimizer factory: weight decay on matrices only, and another LR
    # for biases and norms; SGD with momentum, so that a difference cannot hide.
    groups = [
        *TINY_GPT,
        "optimizer=sgd",
        "optimizer._target_=embedding_lm.decay_matrices_only",
        "optimizer.lr=0.05",
        "optimizer.momentum=0.9",
        "data.dataset.num_points=1280",
        "data.dataset.num_test=256",
        "trainer.max_epochs=2",
    ]
    settings = ["+optimizer.weight_decay=0.1", "+optimizer.no_decay_lr_factor=3.0"]
    runs = _train(
        runs_dir,
        2,
        ("groups_ddp", [*groups, *settings]),
        ("groups_zero1", [*STRATEGIES_2["zero1"], *groups, *settings]),
        ("groups_none", [*STRATEGIES_2["zero1"], *groups, "+optimizer.weight_decay=0.0"]),
    )
    zero1 = runs["groups_zero1"]
    _assert_same_training(zero1, runs["groups_ddp"])
    # the groups' settings matter: without them the run ends elsewhere
    assert runs["groups_none"].summary["params_sha256"] != zero1.summary["params_sha256"]
