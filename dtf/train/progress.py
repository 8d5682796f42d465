"""What rank 0 shows and records: a progress bar (plain lines off a TTY) and TensorBoard."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


class Progress:
    """A tqdm bar on a terminal; one plain line per update elsewhere (logs, CI, SLURM)."""

    def __init__(self, mode: str, total_steps: int, enabled: bool) -> None:
        self.enabled = enabled and mode != "off"
        use_bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        self.total = total_steps
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True) if self.enabled and use_bar else None

    def update(self, step: int, epoch: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        text = " ".join(f"{k} {_fmt(v)}" for k, v in values.items())
        if self.bar is not None:
            self.bar.set_description(f"epoch {epoch}", refresh=False)
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(step - self.bar.n)
        else:
            print(f"epoch {epoch} step {step}/{self.total} {text}", flush=True)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


class TensorBoard:
    """Scalars and hparams into <run_dir>/tensorboard (rank 0 only; a no-op elsewhere). The event
    file is made at the first value: a run that logs nothing (already finished) leaves none."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.log_dir = run_dir / "tensorboard"
        self.enabled = enabled
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        if self._writer is None and self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.enabled:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float | None]) -> None:
        if self.enabled:
            clean = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in hparams.items()}
            self.writer.add_hparams(clean, {f"hparam/{k}": v for k, v in metrics.items()}, run_name=".")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
