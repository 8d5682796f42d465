"""`python -m dtf.eval` on a checkpoint that 4 FSDP ranks trained, evaluated on 1 DDP rank: the
weights reshard, and every split's figures equal those the training run reported for that step
(its last validation, its test at the end), to float tolerance (the reductions run in another
order). A checkpoint of another model is refused in one line naming the first key that differs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dtf.errors import UserError
from tests.helpers.inprocess import compose_config, group_of_one, train_on_ranks
from tests.helpers.run_command import dtf_command, run_command

TRAINED = [
    "data.dataset.num_points=2400",
    "data.dataset.num_test=400",
    "data.val_fraction=0.2",
    "strategy=fsdp",
    "trainer.max_epochs=2",
    "checkpoint.every_n_steps=null",
]


@pytest.fixture(scope="module")
def fsdp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("eval")
    summary = train_on_ranks(4, [("run", TRAINED)], root)["run"]
    # What `python -m dtf` records of a run: the overrides it was given (dtf.eval composes them again).
    (root / "run" / ".hydra").mkdir()
    (root / "run" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([*TRAINED, "launcher.nproc=4"]))
    return root / "run", summary


def test_a_checkpoint_of_4_fsdp_ranks_evaluated_on_1_ddp_rank_gives_the_reported_figures(
    fsdp4: tuple[Path, dict[str, Any]],
) -> None:
    run_dir, s = fsdp4
    out = run_command(
        dtf_command(run_dir, "strategy=ddp", "launcher.nproc=1", "trainer.progress=off", module="dtf.eval"), timeout=300
    )
    checkpoint = run_dir / "checkpoints" / f"step_{s['global_step']:09d}"
    record = json.loads((checkpoint / "eval.json").read_text())
    assert record["trained_on"] == {"world_size": 4, "strategy": "fsdp"}
    assert (record["world_size"], record["strategy"], record["step"]) == (1, "ddp", s["global_step"])
    reported = {**s["evaluations"][-1], "test/loss": s["final_test_loss"], "test/rmse": s["final_metrics"]["test/rmse"]}
    assert set(record["metrics"]) == {"val/loss", "val/rmse", "test/loss", "test/rmse"}
    for key, value in record["metrics"].items():
        assert value == pytest.approx(reported[key], rel=1e-5), key
    assert f"dtf: evaluated {checkpoint} (step {s['global_step']}) on 1 rank(s), strategy=ddp: val loss " in out.stdout


def test_a_checkpoint_of_another_model_is_one_line_naming_the_first_key(fsdp4: tuple[Path, dict[str, Any]]) -> None:
    from dtf.config.typed import typed
    from dtf.train import evaluate as evaluation

    run_dir, s = fsdp4
    checkpoint = run_dir / "checkpoints" / f"step_{s['global_step']:09d}"
    cfg = compose_config([*TRAINED, "strategy=ddp", "model.hidden=50"])
    with group_of_one() as env, pytest.raises(UserError) as refused:
        evaluation.run(typed(cfg), env, run_dir / "evaluations", evaluation.EvalRequest(str(checkpoint)))
    assert str(refused.value) == (
        f"checkpoint {checkpoint} does not fit this run: model.net.0.weight has the shape [100, 2] there and [50, 2] "
        "here; evaluate it with the model it was trained with (leave out model overrides)"
    )
    from dtf.eval import evaluate

    with pytest.raises(UserError, match=r"^split=train: choose val, test or all$"):
        evaluate(run_dir, "train")


def test_a_checkpoint_damaged_in_place_is_never_evaluated(fsdp4: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    import shutil

    from dtf.eval import evaluate

    run_dir, s = fsdp4
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    checkpoint = copy / "checkpoints" / f"step_{s['global_step']:09d}"
    shard = sorted(checkpoint.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped, the same size: the cheap completeness check passes it
    shard.write_bytes(bytes(data))
    evaluations = sorted((copy / "evaluations").glob("*"))  # (an earlier test may have made some)
    for target in (copy, checkpoint):  # the run directory (its newest checkpoint) or the checkpoint itself
        with pytest.raises(
            UserError, match=rf"^{checkpoint} cannot be evaluated: {shard.name} is damaged \(its checksum"
        ):
            evaluate(target)
    assert sorted((copy / "evaluations").glob("*")) == evaluations  # refused before anything was written
