"""What rank 0 shows: a progress bar (plain lines off a TTY). What it records is dtf.train.loggers'."""

from __future__ import annotations

import sys

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
