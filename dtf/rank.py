"""What every launcher starts on every rank: set the process up, join the group, run dtf's loop
(dtf.train.loop) or the user's function (dtf.train.function), and return how the run ended, or
record why it did not.

The run arrives as the driver resolved, checked, typed and froze it (a dtf.config.typed.RunConfig,
pickled); the rank never looks at sys.argv nor types the config again, so multirun jobs and any
launcher can ship it as it is. This module imports the training stack only inside the rank: the
driver, which names rank_main, does not pay for importing it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from omegaconf import OmegaConf

from dtf import elastic, failures, rundir
from dtf.errors import user_error_in
from dtf.results import EXIT_USER_ERROR, RunResult, exit_now

if TYPE_CHECKING:
    from dtf.config.typed import RunConfig
    from dtf.dist.env import DistEnv
    from dtf.signals import StopRequest
    from dtf.train.evaluate import EvalRequest

LOST_PEER_GRACE_S = 1.0  # ten of the agent's polls (launcher.monitor_interval=0.1)


def rank_main(
    run: RunConfig, run_dir: str, payload: bytes | None = None, evaluate: EvalRequest | None = None
) -> RunResult | None:
    """Rank 0 returns how the run ended (the others None, or Stopped like rank 0). A failure is
    recorded for the driver (dtf.failures) and ends the rank, a user error with exit status 2 (the
    driver prints its one line), anything else with 1, so the launcher stops the peers.
    payload: dtf.run_function's function and objects. evaluate: dtf.eval's checkpoint to evaluate
    (instead of training)."""
    try:
        result = run_rank(run, run_dir, payload, evaluate)
        if multiprocessing.parent_process() is not None:
            _exit_now_on_success()
        return result
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        from dtf.dist.env import attempt_number, rank_from_env

        if user_error_in(e) is None:
            e = failures.no_space_left(e, run_dir) or e  # a full disk: one line, as any bad input's
        failure = failures.record(run_dir, rank_from_env(), attempt_number(), e)
        status = EXIT_USER_ERROR if user_error_in(e) is not None else 1  # (also when Hydra wraps it)
        if multiprocessing.parent_process() is not None:
            # A rank the local launcher spawned: out at once, with nothing run on the way. The
            # interpreter's exit would tear down the process group with its threads (or the ranks'
            # asynchronous exchange) still running, which aborts the process ("terminate called
            # without an active exception"): any failure, bad input too, would end as a SIGABRT.
            if status != EXIT_USER_ERROR:  # what elastic's @record keeps on the way out: the
                # error file, in the rank's log directory, which the driver names
                from torch.distributed.elastic.multiprocessing.errors import get_error_handler

                try:
                    get_error_handler().record_exception(e)
                except OSError:  # a full disk: the record above said it already; and an empty error
                    # file, which the agent would fail to parse (JSONDecodeError), is left nowhere
                    with contextlib.suppress(OSError, KeyError):
                        os.remove(os.environ["TORCHELASTIC_ERROR_FILE"])
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


def _exit_now_on_success() -> None:
    """A rank the local launcher spawned has done its work: once torch's wrapper has handed its
    result to the driver, the process ends with multiprocessing's sys.exit(0) (its spawn_main),
    which here skips the interpreter's teardown (dtf.results.exit_now). Any other status, a failure
    of that wrapper included, exits as usual."""
    usual = sys.exit

    def exit(code: str | int | None = None) -> NoReturn:
        if code is None or code == 0:
            exit_now(0)
        usual(code)

    sys.exit = exit


def run_rank(
    run: RunConfig, run_dir: str, payload: bytes | None = None, evaluate: EvalRequest | None = None
) -> RunResult | None:
    """One rank's run. Returns Finished on rank 0 and None elsewhere, or Stopped on every rank
    when a stop signal ended the run early."""
    from dtf.dist import env as dist_env

    stop_request = prepare_process(run)
    if run.checkpoint.async_save:  # before the group's threads start: forked now, not spawned later
        from dtf.train.checkpoint_writer import start_early

        start_early()
    shipped = None
    if payload is not None:  # dtf.run_function's
        from dtf.train import function

        shipped = function.load(payload)
        if shipped is not None and shipped.mode == function.TORCHRUN:  # the function makes its own group
            stop_request.restore()
            return function.run_torchrun(run, Path(run_dir), shipped)
    t = run.trainer
    env = dist_env.init(t.device, t.dist_backend, t.dist_timeout_s)
    across_nodes = env.world_size > int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    if across_nodes:
        run = agree_on_config(run, env)  # each node's driver composed one: all run rank 0's
    run = elastic.apply(run, env.world_size)  # a global batch kept on every world size: this size's per-rank batch
    # Under an external torchrun every rank composed its own config; rank 0's run dir wins.
    directory = Path(dist_env.broadcast_from_main(run_dir))
    if env.is_main and not (rundir.held_by_parent(directory) or run.launcher.name == "spark"):
        # No driver holds it for the whole run (SLURM, torchrun, several nodes): rank 0 does,
        # before anything reads or writes there (dtf.launch.driver_holds_run_dir).
        rundir.hold(directory)
    if across_nodes:
        from dtf.launch.nodes import record_nodes

        record_nodes(directory, env)
    if evaluate is not None:
        from dtf.train import evaluate as evaluation

        result: RunResult | None = evaluation.run(run, env, directory, evaluate)
    elif shipped is not None or run.trainer.fn is not None:  # trainer=function, dtf.run_function
        from dtf.train import function

        stop_request.restore()  # the function owns its loop: no step to stop at, signals act as usual
        result = function.run(run, env, directory, shipped)
    else:
        from dtf.train import loop

        result = loop.run(run, env, directory, stop_request)
    stop_request.restore()
    # Only on success: after an error the group must stay up until the error is recorded, or the
    # peers see "connection closed" first and the report blames the wrong rank.
    dist_env.destroy()
    return result


def prepare_process(run: RunConfig) -> StopRequest:
    """The rank's environment, its share of the machine's cores, and its stop-signal handlers."""
    import torch

    from dtf.machine import THREADS_CHOSEN, threads_per_rank
    from dtf.signals import StopRequest

    for key, value in run.launcher.env.items():
        os.environ.setdefault(str(key), str(value))
    if "OMP_NUM_THREADS" not in os.environ:  # ranks sharing a machine split its cores
        torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        os.environ[THREADS_CHOSEN] = "1"
    # From the start: a stop signal that arrives while the run is still setting up is not lost.
    return StopRequest(run.checkpoint.stop_signals, sigint_kills=True)


def agree_on_config(run: RunConfig, env: DistEnv) -> RunConfig:
    """Rank 0's config, on every rank; a node whose own config differed says so, once."""
    from dtf.dist.env import broadcast_from_main

    main: RunConfig = broadcast_from_main(run)
    if not env.is_main and int(os.environ.get("LOCAL_RANK", "0")) == 0 and _shared(main) != _shared(run):
        print(
            f"dtf: this node's config differs from rank 0's (node {os.environ.get('GROUP_RANK', '?')}): "
            "it runs rank 0's, as every node does",
            flush=True,
        )
    return main


def _shared(run: RunConfig) -> str:
    """Digest of what the nodes must agree on: all but the keys that name the node itself."""
    from dtf.train.summary import config_sha256

    mine = OmegaConf.to_container(run.composed, resolve=True)
    assert isinstance(mine, dict)
    for key in ("node_rank", "network_interface"):
        mine["launcher"].pop(key, None)
    return config_sha256(OmegaConf.create(mine))
