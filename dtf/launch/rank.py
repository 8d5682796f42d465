"""The function launchers start on every rank. It lives in this light module and imports the
training stack only in the rank, so the driver (which only composes, validates and launches)
does not pay for importing it."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig


def rank_main(cfg: DictConfig, run_dir: str) -> dict[str, Any] | None:
    from dtf.worker import spawned_rank_main

    return spawned_rank_main(cfg, run_dir)
