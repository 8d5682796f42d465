"""What tracking tests compare: TensorBoard's event files (read by tensorboard's own reader), and
the flattened config as pandas flattens it (an independent computation of MLflow's params)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} over every event file of the run (a resumed run's too; later wins)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return scalars


def training_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """TensorBoard's scalars of the loop, without those its hparams record writes at the end (hparam/*,
    at step 0 where TensorBoard keeps them; MLflow gets them at the last step)."""
    return {tag: v for tag, v in tensorboard_scalars(run_dir).items() if not tag.startswith("hparam/")}


def as_float32(values: dict[int, float]) -> dict[int, float]:
    """TensorBoard keeps float32: another logger's float64 values, as TensorBoard would hold them."""
    return {step: float(np.float32(v)) for step, v in values.items()}


def flattened(cfg: Any) -> dict[str, str]:
    """cfg's values by dotted key, as strings (pandas.json_normalize; an empty section is one key)."""
    import pandas as pd
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    row = pd.json_normalize(container, sep=".").iloc[0].to_dict()
    return {k: str(v) for k, v in row.items()}
