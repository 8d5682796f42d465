"""The debug presets (conf/debug/), in process on one rank: limits keep the first batches of each
split (the test loss is checked against the exported weights on the first test samples, computed
with torch alone), overfitting trains and evaluates on the same batches, and the profiler writes
a Chrome trace per rank of the steps asked for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from dtf.errors import UserError
from tests.helpers.inprocess import compose_config, train_in_process

# 2,000 training samples: 63 batches of 32 per epoch on one rank; 400 test samples.
SMALL = ["data.dataset.num_points=2400", "data.dataset.num_test=400", "checkpoint.every_n_steps=null"]


def _mse(cfg: DictConfig, weights: Path, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model = instantiate(cfg.model)
    model.load_state_dict(torch.load(weights, weights_only=True))
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([torch.as_tensor(s[1]) for s in samples]).to(torch.get_default_dtype())
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x).reshape(y.shape), y))


def test_every_preset_begins_with_the_command_that_uses_it() -> None:
    presets = sorted((Path(__file__).parents[2] / "conf" / "debug").glob("*.yaml"))
    assert {p.stem for p in presets} == {"fast", "limit", "overfit", "profile"}
    for preset in presets:
        lines = preset.read_text().splitlines()
        assert lines[:2] == ["# @package _global_", f"# python -m dtf debug={preset.stem}"], preset


def test_fast_runs_two_steps_and_keeps_nothing(tmp_path: Path) -> None:
    s = train_in_process([*SMALL, "debug=fast"], tmp_path / "run")
    assert s["global_step"] == 2 and s["weights_file"] is None and s["checkpoints_saved"] == 0
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "model.pt").exists()


def test_limits_keep_the_first_batches_of_each_split(tmp_path: Path, composed: Any) -> None:
    s = train_in_process(
        [*SMALL, "debug=limit", "trainer.limit_eval_batches=2", "trainer.export_weights=true"], tmp_path / "run"
    )
    assert s["data_batches_per_epoch"] == 6 and s["global_step"] == 3 * 6  # int(0.1 x 63) of each epoch
    assert s["samples_seen"] == 3 * 6 * 32
    _, test = instantiate(composed(*SMALL).data.dataset)
    first = [test[i] for i in range(2 * 32)]  # one rank evaluates the test set in its order
    assert s["final_test_loss"] == pytest.approx(_mse(composed(*SMALL), tmp_path / "run" / "model.pt", first), rel=1e-5)


def test_overfit_trains_and_evaluates_on_the_same_few_batches(tmp_path: Path, composed: Any) -> None:
    from dtf.data import loader
    from dtf.dist.env import DistEnv

    overrides = [*SMALL, "debug=overfit", "trainer.max_epochs=40"]
    s = train_in_process(overrides, tmp_path / "run")
    assert s["data_batches_per_epoch"] == 3 and s["samples_seen"] == 40 * 96
    curve = [e["val/loss"] for e in s["evaluations"]]
    assert curve[-1] < curve[0] / 4  # driven down on the batches it sees again and again
    cfg = compose_config(overrides)
    from dtf.config.typed import typed

    run = typed(cfg)
    train = loader.build_splits(run.data, DistEnv(0, 1, 0, torch.device("cpu")), seed=run.trainer.seed).train
    train.set_epoch(0)
    batches = [b for _, b in zip(range(3), train, strict=False)]
    samples = [(x, y) for bx, by in batches for x, y in zip(bx, by, strict=True)]
    assert curve[-1] == pytest.approx(_mse(composed(*SMALL), tmp_path / "run" / "model.pt", samples), rel=1e-5)


def test_profile_writes_a_chrome_trace_of_the_active_steps(tmp_path: Path) -> None:
    train_in_process([*SMALL, "debug=profile"], tmp_path / "run")
    traces = list((tmp_path / "run" / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1, traces
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"} <= names  # after 1 skipped and 1 of warm-up
    assert "ProfilerStep#1" not in names and "ProfilerStep#5" not in names


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.limit_train_batches=0", "trainer.limit_train_batches=0 is invalid: use a fraction"),
        ("trainer.limit_eval_batches=1.5", "trainer.limit_eval_batches=1.5 is invalid: use a fraction"),
        ("trainer.profiler.active=0", "trainer.profiler.active=0 is invalid: record at least 1 step"),
    ],
)
def test_bad_debug_settings_are_one_line_naming_the_key(override: str, message: str) -> None:
    from dtf.cli import freeze

    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        freeze(compose_config([override]))


def test_overfitting_with_a_limit_is_refused() -> None:
    from dtf.cli import freeze

    with pytest.raises(UserError, match=r"leave trainer\.limit_train_batches at null"):
        freeze(compose_config(["debug=overfit", "trainer.limit_train_batches=0.5"]))
