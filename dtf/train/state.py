"""Where a run stands, as the trainer keeps and checkpoints it.

Positions are kept in samples over all ranks, not in batches of one rank: a run resumed on
another world size (or batch size) finds its place in the epoch again, and its budget and
throughput stay right.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dtf.errors import UserError


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch in progress (0-based): epochs finished, while samples_in_epoch == 0
    # Samples of the current epoch trained on, over all ranks: a prefix of the epoch's sample order.
    # > 0 also means the epoch's end (its loss, evaluation) is still to come, even once all are used.
    samples_in_epoch: int = 0
    samples_seen: int = 0  # over all ranks, the whole run
    train_seconds: float = 0.0  # time in training steps (not evaluation, not checkpoint saves)
    train_loss_curve: list[float] = field(default_factory=list)  # per epoch, all ranks
    test_loss_curve: list[float] = field(default_factory=list)
    last_train_loss: float = math.nan
    last_test_loss: float | None = None

    @property
    def mid_epoch(self) -> bool:
        return self.samples_in_epoch > 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [name for name in asdict(self) if name not in state]
        if missing:
            raise UserError(
                "checkpoint.resume: this checkpoint was written by an older dtf (no "
                f"{', '.join(missing)}); start over with checkpoint.resume=never"
            )
        for name in asdict(self):
            value = state[name]
            setattr(self, name, list(value) if isinstance(value, list) else value)
