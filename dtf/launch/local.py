"""Ranks on this machine, started and watched by torch's elastic agent (torchrun's engine).

The agent gives every run its own free rendezvous port (c10d store on port 0), restarts
all ranks up to `max_restarts` times when one fails, and otherwise stops the survivors
at once, so a failed rank never leaves the others hanging in a collective.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from dtf.dist import env as dist_env
from dtf.errors import RankFailedError
from dtf.launch.base import Launcher, WorkerFn
from dtf.launch.failures import describe_failure


class LocalLauncher(Launcher):
    def launch(self, fn: WorkerFn, cfg: DictConfig, run_dir: str) -> Any:
        if dist_env.launched_externally():
            # Started by torchrun (or srun speaking its protocol): this process is a rank already.
            return fn(cfg, run_dir)
        nproc = self.cfg.nproc
        others = {r: Std.ALL for r in range(1, nproc)}
        logs = DefaultLogsSpecs(
            log_dir=str(Path(run_dir) / "logs"),
            # Rank 0 keeps the terminal (its progress bar); the others write to <run_dir>/logs.
            redirects=others,
            tee=others if self.cfg.tee_all_ranks else Std.NONE,
        )
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",  # a free port for every run, so multirun jobs never collide
            max_restarts=self.cfg.max_restarts,
            monitor_interval=self.cfg.monitor_interval,
            start_method=self.cfg.start_method,
            logs_specs=logs,
            local_addr="127.0.0.1",
        )
        # The agent logs every failure with a long traceback of its own; dtf reports the failed
        # rank in one line instead (and the rank's own traceback where it has one).
        # With the rendezvous store shared with the ranks (torch's default), keys the ranks of a failed
        # attempt wrote (their gloo addresses) survive into the restart, whose rank 0 then dials the
        # dead peer ("Connection refused"; pytorch#135712, #167288). Each attempt gets its own store instead.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process ..."
        try:
            results = elastic_launch(config, fn)(cfg, run_dir)
        except ChildFailedError as e:
            raise RankFailedError(describe_failure(e, run_dir)) from None
        return results.get(0)
