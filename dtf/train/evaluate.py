"""One rank's side of dtf.eval: the model's weights from a committed checkpoint (DCP reshards
them onto this world size and strategy), and each split evaluated exactly as training evaluates
(every sample counted once, (sum, count) reduced over the ranks). Rank 0 writes eval.json into the
checkpoint's folder and prints the figures."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dtf.errors import UserError

if TYPE_CHECKING:
    from dtf.config.typed import RunConfig
    from dtf.dist.env import DistEnv
    from dtf.results import Finished

EVAL_FILE = "eval.json"
SPLITS = ("val", "test")


@dataclass(frozen=True)
class EvalRequest:
    """What the ranks evaluate: a committed checkpoint, on these splits (those the data has, for "all")."""

    checkpoint: str
    splits: tuple[str, ...] = ("all",)


def run(run: RunConfig, env: DistEnv, run_dir: Path, request: EvalRequest) -> Finished | None:
    """The ranks' side: the model from the checkpoint, each split evaluated; rank 0 returns the
    record (and writes eval.json), the others None. Collective."""
    from hydra.utils import instantiate

    from dtf.files import write_json
    from dtf.results import Finished
    from dtf.train import loop
    from dtf.train.checkpoint import load_app_state, read_marker
    from dtf.train.metrics import Metrics
    from dtf.train.rng import seed_everything
    from dtf.train.validator import Validator, describe

    checkpoint = Path(request.checkpoint)
    seed_everything(run.trainer.seed)
    parts = loop.setup_model(run, env)
    splits = loop.setup_data(run, env, None)
    model, optimizer = parts.strategy.setup(parts.model, instantiate(run.composed.optimizer), env)
    cfg = run.composed
    measures = Metrics.build(cfg.get("metrics"), env.device, cfg.get("loss"))
    validator = Validator(env, loop.step_forward(run, parts.precision, parts.model), measures, splits.val, splits.test)
    # The model's weights only (the optimizer's state is not needed, and may be another's).
    current = parts.strategy.state_dict(model, optimizer)
    app_state = {"model": current["model"]}
    load_app_state(checkpoint, app_state, "evaluate it with the model it was trained with (leave out model overrides)")
    parts.strategy.load_state_dict(model, optimizer, {**current, "model": app_state["model"]})
    wanted = [s for s in SPLITS if "all" in request.splits or s in request.splits]
    data = {"val": splits.val, "test": splits.test}
    missing = [s for s in wanted if data[s] is None and "all" not in request.splits]
    if missing:
        raise UserError(
            f"split={missing[0]}: this data has no {'validation' if missing[0] == 'val' else 'test'} split: "
            "choose another split, or give the data one"
        )
    metrics: dict[str, float] = {}
    for split in wanted:
        split_data = data[split]
        if split_data is None:
            continue
        result = validator.evaluate(model, split_data)
        assert result is not None
        loss, values = result
        metrics.update({f"{split}/loss": loss, **{f"{split}/{k}": v for k, v in values.items()}})
    if not env.is_main:
        return None
    marker = read_marker(checkpoint)
    record = {
        "checkpoint": str(checkpoint),
        "step": marker.step,
        "trained_on": {"world_size": marker.world_size, "strategy": marker.strategy},
        "world_size": env.world_size,
        "strategy": run.strategy.name,
        "metrics": metrics,
    }
    write_json(checkpoint / EVAL_FILE, record)

    print(
        f"dtf: evaluated {checkpoint} (step {marker.step}) on {env.world_size} rank(s), strategy={run.strategy.name}: "
        f"{describe(metrics)}; {checkpoint / EVAL_FILE}",
        flush=True,
    )
    return Finished(record)
