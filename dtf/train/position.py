"""Where a resumed run's data continues: the batch of the current epoch to start from
(TrainData.seek), and what the user should know where the checkpoint was written with another
world size, global batch or partitioning of the data."""

from __future__ import annotations

from dtf.data.interface import TrainData
from dtf.train.state import TrainState


def resume_at(
    data: TrainData,
    state: TrainState,
    world_size: int,
    saved_world: int,
    saved_batch: int | None = None,
    saved_partitions: int | None = None,
) -> tuple[int, list[str]]:
    """(the batch of the current epoch to start from, notes for the user). state: as resumed, with
    the data's position recorded anew (global_batch, canonical_partitions); saved_*: as the
    checkpoint recorded them."""
    used = state.samples_in_epoch
    epoch = state.epoch + 1
    start = data.seek(state.epoch, used)
    if not used:
        return start, []
    batch, partitions = state.global_batch, state.canonical_partitions
    if partitions is not None:  # every canonical partition continues from the row it reached
        if saved_partitions is not None and saved_partitions != partitions:
            return start, [
                f"data.canonical_partitions changed ({saved_partitions} -> {partitions}) in the middle of epoch "
                f"{epoch}: the rest of that epoch is cut differently, so some samples are seen twice and others "
                "not at all; later epochs are whole"
            ]
        if saved_batch is not None and saved_batch != batch:
            return start, [
                f"the global batch changed ({saved_batch} -> {batch}) in the middle of epoch {epoch}: every "
                f"partition continues from the row it had reached ({used // partitions}), but the batch "
                "composition differs from there on"
            ]
        return start, []
    num_batches = len(data)
    seen_twice = used - data.samples_after(start) if start < num_batches else 0
    moved = saved_world != world_size and not data.position_survives_world_size_change
    if moved and 0 < start < num_batches:
        return start, [
            f"the world size changed ({saved_world} -> {world_size}) in the middle of epoch "
            f"{epoch}: this data is read in per-rank shares, so for the rest of that epoch some "
            "samples are seen twice and others not at all; later epochs are whole"
        ]
    if seen_twice:
        return start, [f"the global batch changed: {seen_twice} samples of epoch {epoch} are seen twice"]
    return start, []
