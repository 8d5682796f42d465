"""What tracking tests compare: TensorBoard's event files (read by tensorboard's own reader), the
flattened config as pandas flattens it (an independent computation of MLflow's params), and W&B's
offline run file (its records decoded by wandb's own protobuf types)."""

from __future__ import annotations

import json
import struct
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


def wandb_records(run_file: Path) -> list[Any]:
    """The records of a W&B offline run file (run-<id>.wandb), as wandb's own protobuf Record. wandb 0.19+
    reads the file in its Go core only; its layout is LevelDB's log format under a 7-byte ':W&B' header
    (wandb <= 0.18's sdk/internal/datastore.py): 32 KiB blocks of chunks, each `crc32 (4) length (2)
    type (1)` then its bytes, type 1 a whole record, 2/3/4 its first/middle/last parts."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    block, pos, found, parts = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts + chunk)
            found.append(record)
            parts = b""
        elif kind in (2, 3):
            parts += chunk
    return found


def wandb_history(run_dir: Path) -> tuple[set[str], dict[str, dict[int, float]]]:
    """The W&B run ids of every offline run file of a dtf run dir (a resumed run writes one more), and
    the history they logged: key -> {step: value} (wandb's own _step, _runtime and _timestamp left out)."""
    ids: set[str] = set()
    history: dict[str, dict[int, float]] = {}
    for run_file in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                step = row.pop("_step")
                for key, value in row.items():
                    if not key.startswith("_"):
                        history.setdefault(key, {})[step] = value
    return ids, history
