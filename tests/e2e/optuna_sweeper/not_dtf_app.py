"""A Hydra application that is not dtf, to run under hydra/sweeper=dtf (which refuses it in one line)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg: DictConfig) -> float:
    return float(cfg.x) ** 2


if __name__ == "__main__":
    main()
