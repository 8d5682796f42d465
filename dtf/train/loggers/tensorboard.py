"""logger=tensorboard: scalars and hparams into <run_dir>/tensorboard."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any


class TensorBoard:
    """The event file is made at the first value: a run that logs nothing (already finished) leaves none."""

    def __init__(self, run_dir: Path) -> None:
        self.log_dir = run_dir / "tensorboard"
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_writer_threads()
            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def start(self, state: Any) -> None:
        pass  # a resumed run appends to the same directory

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float | None]) -> None:
        clean = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in hparams.items()}
        self.writer.add_hparams(clean, {f"hparam/{k}": v for k, v in metrics.items()}, run_name=".")

    def finish(self, run_dir: Path) -> None:
        pass  # the event files are in the run dir already

    def close(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _quiet_writer_threads() -> None:
    """TensorBoard writes event files on a thread of its own, which also prints the error of a
    failed write (a full disk) as a traceback, before the writer raises it again where the rank logs
    next, and the rank reports it in one line. Only that thread's error is left unprinted."""
    previous = threading.excepthook
    if getattr(previous, "_dtf_quiet", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook._dtf_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook
