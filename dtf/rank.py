"""The function every launcher starts on every rank: train, return the outcome, or record why not.

It lives in this light module and imports the training stack only in the rank, so the driver
(which composes, validates and launches) does not pay for importing it.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

from omegaconf import DictConfig

from dtf import failures
from dtf.errors import user_error_in
from dtf.results import EXIT_USER_ERROR, RunResult

LOST_PEER_GRACE_S = 1.0  # ten of the agent's polls (launcher.monitor_interval=0.1)


def rank_main(cfg: DictConfig, run_dir: str, payload: bytes | None = None) -> RunResult | None:
    """Rank 0 returns how the run ended (the others None, or Stopped like rank 0). A failure is
    recorded for the driver (dtf.failures) and ends the rank, a user error with exit status 2 (the
    driver prints its one line), anything else with 1, so the launcher stops the peers."""
    try:
        from dtf.worker import worker_main

        return worker_main(cfg, run_dir, payload)
    except Exception as e:
        from dtf.dist.env import attempt_number, rank_from_env

        failure = failures.record(run_dir, rank_from_env(), attempt_number(), e)
        status = EXIT_USER_ERROR if user_error_in(e) is not None else 1  # (also when Hydra wraps it)
        if multiprocessing.parent_process() is not None:
            # A rank the local launcher spawned: out at once, with nothing run on the way. The
            # error is recorded (the driver prints it, and a crash's traceback), and the
            # interpreter's exit would tear down the process group with its threads, or the ranks'
            # asynchronous exchange, still running, which aborts the process ("terminate called
            # without an active exception" and Python's dump of its extension modules): any
            # failure, bad input too, would end as a crash by SIGABRT.
            if status != EXIT_USER_ERROR:  # what elastic's @record keeps on the way out: the
                # error file, in the rank's log directory, which the driver names
                from torch.distributed.elastic.multiprocessing.errors import get_error_handler

                get_error_handler().record_exception(e)
            sys.stdout.flush()
            sys.stderr.flush()
            if failure.lost_peer:
                # A peer died first (killed, say) and this rank only saw its connection close. The
                # agent reports the first rank it sees exit: this one waits for it to see the peer.
                time.sleep(LOST_PEER_GRACE_S)
            os._exit(status)
        if status == EXIT_USER_ERROR:
            raise SystemExit(EXIT_USER_ERROR) from None
        raise
