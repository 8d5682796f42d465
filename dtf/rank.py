"""The function every launcher starts on every rank: train, return the outcome, or record why not.

It lives in this light module and imports the training stack only in the rank, so the driver
(which composes, validates and launches) does not pay for importing it.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

from omegaconf import DictConfig

from dtf import failures
from dtf.errors import user_error_in
from dtf.results import EXIT_USER_ERROR, RunResult


def rank_main(cfg: DictConfig, run_dir: str, payload: bytes | None = None) -> RunResult | None:
    """Rank 0 returns how the run ended (the others None, or Stopped like rank 0). A failure is
    recorded for the driver (dtf.failures) and ends the rank: a user error quietly with exit status 2
    (the driver prints its one line), anything else by raising, so the launcher stops the peers."""
    try:
        from dtf.worker import worker_main

        return worker_main(cfg, run_dir, payload)
    except Exception as e:
        from dtf.dist.env import attempt_number, rank_from_env

        failures.record(run_dir, rank_from_env(), attempt_number(), e)
        if user_error_in(e) is not None:  # also when a _target_ raised it (Hydra wraps it)
            if multiprocessing.parent_process() is not None:
                # A rank the local launcher spawned: out at once, with nothing run on the way. The
                # error is recorded, and multiprocessing's exit handlers tear down the process
                # group with the ranks' (asynchronous) exchange possibly still in flight, which
                # can abort the process: bad input would be reported as a crash by SIGABRT.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(EXIT_USER_ERROR)
            raise SystemExit(EXIT_USER_ERROR) from None
        raise
