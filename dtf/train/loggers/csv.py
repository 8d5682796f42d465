"""logger=csv: <run_dir>/metrics.csv, one row per logged step and a column per scalar (step first),
as pandas.read_csv reads it. Values logged at one step (training figures, then an evaluation's)
share its row, written once the next step's values come (or at the end); a scalar first seen
later adds a column, and the file is rewritten with it."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any


class CsvLogger:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.columns: list[str] = ["step"]
        self.written: list[dict[str, Any]] = []  # the rows in the file
        self.pending: dict[str, Any] | None = None  # the latest step's row, still open to its values

    def start(self, state: Any) -> None:
        """A resumed run keeps the rows up to its checkpoint's step (later ones are trained again)."""
        if not self.path.exists():
            return
        with self.path.open(newline="") as f:
            reader = csv.DictReader(f)
            self.columns = list(reader.fieldnames or ["step"])
            self.written = [row for row in reader if row.get("step") and int(row["step"]) <= state.step]
        self._rewrite()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.pending is not None and self.pending["step"] != step:
            self._flush()
        if self.pending is None:
            self.pending = {"step": step}
        self.pending.update(values)

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float | None]) -> None:
        pass  # the final figures are summary.json's; the config is .hydra/'s

    def finish(self, run_dir: Path) -> None:
        self._flush()

    def close(self, status: str) -> None:
        self._flush()

    def _flush(self) -> None:
        if self.pending is None:
            return
        row, self.pending = self.pending, None
        self.written.append(row)
        new = [k for k in row if k not in self.columns]
        if new or not self.path.exists():
            self.columns += new
            self._rewrite()
            return
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(row)

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.written)
        tmp.replace(self.path)
