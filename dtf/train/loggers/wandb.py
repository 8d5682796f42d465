"""logger=wandb: a Weights & Biases run in <run_dir>/wandb; offline by default (no network: `wandb
sync <run_dir>/wandb/offline-run-*` uploads it later). The config as the run's config, every scalar
by TensorBoard's name at its step, summary.json and model.pt saved with the run. A resumed run
continues the same W&B run (its id is kept in the checkpoint, TrainState.wandb_run_id)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dtf.config.schema import WandbLoggerConfig


class WandbLogger:
    def __init__(self, settings: WandbLoggerConfig, run: Any, run_dir: Path, world_size: int) -> None:
        self.settings = settings
        self.config: dict[str, Any] = OmegaConf.to_container(run.composed, resolve=True, enum_to_str=True)  # type: ignore[assignment]  # a DictConfig: a dict
        self.run_dir = run_dir
        self.tags = [f"strategy:{run.strategy.name}", f"world_size:{world_size}", f"launcher:{run.launcher.name}"]
        self.run: Any = None

    def start(self, state: Any) -> None:
        import wandb

        s = self.settings
        self.run = wandb.init(
            project=s.project,
            entity=s.entity,
            mode=s.mode,  # type: ignore[arg-type]  # one of wandb's modes: WandbLoggerConfig checks it
            dir=str(self.run_dir),
            name=self.run_dir.name,
            config=self.config,
            tags=[*self.tags, *s.tags],
            id=state.wandb_run_id or None,
            resume="allow",
            notes=f"dtf run dir {self.run_dir.resolve()}",
        )
        state.wandb_run_id = self.run.id

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log(dict(values), step=step)

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float | None]) -> None:
        if self.run is not None:
            self.run.summary.update({f"hparam/{k}": v for k, v in metrics.items() if v is not None})

    def finish(self, run_dir: Path) -> None:
        if self.run is None:
            return
        for name in ("summary.json", "model.pt"):
            if (run_dir / name).exists():
                self.run.save(str(run_dir / name), base_path=str(run_dir), policy="now")

    def close(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status in ("finished", "pruned", "stopped") else 1)
            self.run = None
            import wandb

            # finish() leaves the run file to wandb's service process, which an atexit hook ends; a rank
            # that fails leaves by os._exit, without it: end the service here, so the file is whole.
            wandb.teardown()
