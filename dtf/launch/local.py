"""Ranks on this machine, started and watched by torch's elastic agent (torchrun's engine).

The agent gives every run its own free rendezvous port (c10d store on port 0), restarts
all ranks up to `max_restarts` times when one fails, and otherwise stops the survivors
at once, so a failed rank never leaves the others hanging in a collective.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing import util as mp_util
from pathlib import Path
from types import FrameType
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from dtf import elastic, failures, remote
from dtf.config.schema import LocalLauncherConfig
from dtf.config.typed import RunConfig
from dtf.dist import env as dist_env
from dtf.errors import Interrupted, RankFailedError, TooFewNodes, UserError
from dtf.launch import driver_watch, forkserver_exit, signed_rendezvous, stalls
from dtf.launch.base import Launcher, WorkerFn, in_place_result, rank_result
from dtf.launch.cut_off import CutOffWatch
from dtf.launch.nodes import Nodes, between_nodes, lost_node
from dtf.launch.oom import OomKills
from dtf.machine import THREADS_CHOSEN, threads_per_rank
from dtf.results import RunResult, Stopped


class LocalLauncher(Launcher):
    cfg: LocalLauncherConfig

    def launch(self, fn: WorkerFn, run: RunConfig, run_dir: str) -> RunResult | None:
        if dist_env.launched_externally():
            # Started by torchrun (or srun speaking its protocol): this process is a rank already.
            return in_place_result(fn(run, run_dir))
        nproc = self.cfg.nproc
        min_nodes, max_nodes = self.cfg.node_range()
        sizes = elastic.plan(run)
        if sizes is not None and sizes.elastic:  # the node counts that keep the global batch
            min_nodes, max_nodes = sizes.min_nodes, sizes.max_nodes
        nodes = Nodes.of(self.cfg) if max_nodes > 1 else None
        stop_signals = list(self.checkpoint.stop_signals)
        others = {r: Std.ALL for r in range(1, nproc)}
        logs = DefaultLogsSpecs(
            log_dir=str(Path(run_dir) / "logs"),
            # Rank 0 keeps the terminal (its progress bar); the others write to <run_dir>/logs.
            redirects=others,
            tee=others if self.cfg.tee_all_ranks else Std.NONE,
        )
        run_id = nodes.run_id() if nodes else uuid.uuid4().hex
        config = LaunchConfig(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            nproc_per_node=nproc,
            # One node: a fresh id and a free port for every run, so multirun jobs never collide.
            # Several: the nodes of one run meet at the endpoint, under one id (rank 0's run
            # directory is the run's, dtf.rank.run_rank; they must share it for the rendezvous' secret).
            run_id=run_id,
            rdzv_backend=RENDEZVOUS,
            rdzv_endpoint=nodes.endpoint if nodes else "127.0.0.1:0",
            rdzv_configs={
                **elastic.rdzv_configs(self.cfg.rdzv_configs),
                **(nodes.rdzv_configs() if nodes else {"is_host": True}),
            },
            max_restarts=self.cfg.restarts(),
            monitor_interval=self.cfg.monitor_interval,
            start_method=self.cfg.start_method,
            logs_specs=logs,
            local_addr=nodes.address if nodes else "127.0.0.1",
            # The agent shuts the ranks down on these; stop signals are passed on to them instead
            # (StopForwarding), so they save, stop and return, and the agent collects their results.
            signals_to_handle=",".join(s for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if s not in stop_signals),
        )
        # The agent logs every failure with a long traceback of its own; dtf reports the failed
        # rank in one line instead (and the rank's own traceback where it has one).
        # With the rendezvous store shared with the ranks (torch's default), keys the ranks of a failed
        # attempt wrote (their gloo addresses) survive into the restart, whose rank 0 then dials the
        # dead peer ("Connection refused"; pytorch#135712, #167288). Each attempt gets its own store instead.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        # Elastic's modules set their loggers' levels one by one (from LOGLEVEL), so each is quietened.
        for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process ..."
        start_resource_tracker_ignoring(stop_signals)
        failures.clear(run_dir)
        oom_kills = OomKills()
        signed_rendezvous.clear_refusal(run_dir)
        forwarding = StopForwarding(stop_signals)
        checkpoints = Path(run_dir) / self.checkpoint.dir
        watch = stalls.StallWatch(run_dir, run.trainer.stall_timeout_s, run.trainer.dist_timeout_s)
        if self.cfg.start_method == "forkserver":
            short_temp_dir()  # the forkserver's socket goes there
        try:
            with (
                refusals_reported(run_dir, config.rdzv_endpoint),
                standard_start_method(self.cfg.start_method),
                temp_files_in(Path(run_dir) / "logs"),
                sized_thread_pools(nproc, self.cfg.env.get("OMP_NUM_THREADS")),
                between_nodes(nodes),
                # what the nodes write to the rendezvous store is signed with it (signed_rendezvous)
                signed_rendezvous.secret_for(run_id, run_dir if nodes else None, functools.partial(refused, run_dir)),
                watch.watching(),
                CutOffWatch(run_dir, nodes.endpoint, nodes.address).watching() if nodes else contextlib.nullcontext(),
                ranks_without_main(),
                preloaded_forkserver(self.cfg.start_method, rank_imports(run.composed), stop_signals),
            ):
                # (with fn's name: elastic logs it)
                # (a rank of one node stops at a checkpoint when the driver dies; of several, it ends
                # at once, as the node's loss, which the other nodes handle: dtf.launch.driver_watch)
                entry = functools.partial(rank_of_this_node, fn, os.getpid(), nodes is None)
                entrypoint = functools.update_wrapper(entry, fn)
                results = elastic_launch(config, entrypoint)(run, run_dir)
        except RendezvousTimeoutError:
            # Too few nodes to meet launcher.nnodes' MIN (the first time, or after losing nodes) in join_timeout.
            newest = newest_checkpoint("", checkpoints)
            kept = (
                f"its newest checkpoint, step {newest.step} ({newest.checkpoint}), is intact"
                if newest.checkpoint
                else "it has no checkpoint"
            )
            wait = self.cfg.rdzv_configs.get("join_timeout", 600)
            raise TooFewNodes(
                f"fewer than {min_nodes} node(s) (launcher.nnodes={self.cfg.nnodes}) met at {config.rdzv_endpoint} "
                f"within {wait} s (launcher.rdzv_configs.join_timeout): the run stopped, and {kept}; the same "
                f"command on {min_nodes} or more nodes continues it"
            ) from None
        except RendezvousConnectionError as e:
            if nodes is None:
                raise  # one node meets on a port the system picks: not the user's to fix
            # The first node hosts the rendezvous on the port given; the others dial it.
            cause = " ".join(str(e.__cause__ or e).split())
            raise UserError(
                f"launcher.rdzv_endpoint={nodes.endpoint}: the nodes cannot meet there ({cause}): give the "
                "first node's address and a free port on it that every node reaches"
            ) from None
        except ChildFailedError as e:
            if forwarding.received and died_of(e, forwarding.received):
                # ranks still starting up die of the signal (their handler is not installed yet)
                return newest_checkpoint(forwarding.received, checkpoints)
            raise failed_rank(e, run_dir, oom_kills) from None
        except SignalException as e:
            if forwarding.twice:  # a second stop signal: the agent killed the ranks
                return newest_checkpoint(f"{forwarding.received} (twice)", checkpoints)
            # Ctrl-C, SIGHUP, ... (or SIGTERM when it is not a stop signal): the agent stopped the ranks
            newest = newest_checkpoint(signal.Signals(e.sigval).name, checkpoints)
            raise Interrupted(signal.Signals(e.sigval).name, newest.checkpoint, newest.step) from None
        finally:
            forwarding.restore()
        if nodes is not None and 0 not in results:  # rank 0 runs on another node, and reports there
            print(f"dtf: this node's ranks are done; rank 0's node writes {run_dir}/summary.json", flush=True)
            return None
        return rank_result(results.get(0))


RENDEZVOUS = "dtf-c10d"


def bound_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch elastic's c10d rendezvous (torchrun's default), with its store listening only on the
    endpoint's address (127.0.0.1 on one node), not on every interface as TCPStore's server does,
    and its state signed with the run's secret (signed_rendezvous): the store has no
    authentication, and anyone who reaches it can write to it."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    is_host = params.get_as_bool("is_host")
    try:
        # Unsaid (launcher.node_rank unset): the node whose address the endpoint names hosts it;
        # a node that cannot listen there (not its address, or another agent of it already does) joins.
        store = dist_env.tcp_store(host, port, None, is_host is not False, timeout)
    except OSError as e:
        if is_host is None and e.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
            store = dist_env.tcp_store(host, port, None, False, timeout)
        else:
            reason = (e.strerror or str(e)).lower()
            raise RendezvousConnectionError(f"cannot host the rendezvous on {host}:{port}: {reason}") from None
    return create_handler(store, signed_rendezvous.backend_for(store, params.run_id, RENDEZVOUS), params)


rendezvous_handler_registry.register(RENDEZVOUS, bound_c10d_handler)


def refused(run_dir: str, e: signed_rendezvous.ForeignStateError) -> None:
    """Someone outside the run wrote to the rendezvous store: its other keys (the ranks' assignment,
    rank 0's address) cannot be trusted either, and the run's state there is gone. The ranks end at
    once (SIGKILL: stopped gracefully, the other nodes' ranks would stop with them and return, and
    their agents would wait for this one at torch's exit barrier, 300 s); the other nodes' ranks fail
    for the loss of these, and their drivers report the refusal recorded in the shared run dir."""
    signed_rendezvous.record_refusal(run_dir, e)
    for child in multiprocessing.active_children():
        if child.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)


# How a node sees a refusal: its own (ForeignStateError), or another node's, whose ranks and store went away.
_REFUSED_OR_LOST = (
    signed_rendezvous.ForeignStateError,
    ChildFailedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)


@contextlib.contextmanager
def refusals_reported(run_dir: str, endpoint: str) -> Iterator[None]:
    """A write to the rendezvous store that no node of the run made, refused by this node or by
    another (which killed its ranks and ended, taking the store with it on the first node: this
    node sees that loss, in one of these ways), ends the run in one line that says so."""
    try:
        yield
    except _REFUSED_OR_LOST as e:
        seen = signed_rendezvous.recorded_refusal(run_dir)
        if seen is None and isinstance(e, signed_rendezvous.ForeignStateError):
            seen = str(e)  # (the run dir could not take the record)
        if seen is None:
            raise
        raise RankFailedError(
            f"{seen} at {endpoint}, or a node with another run directory (every node's hydra.run.dir must be the "
            "same): it was refused unread, nothing of it ran, and the run stopped; keep the nodes' network to the "
            "cluster's (docs/launchers.md), and the same command continues from the newest checkpoint"
        ) from None


def rank_of_this_node(fn: WorkerFn, driver: int, one_node: bool, run: RunConfig, run_dir: str) -> RunResult | None:
    """A rank of launcher=local: in a session of its own (in_own_session), which must therefore end
    with the driver by itself (dtf.launch.driver_watch)."""
    stop_with = list(run.checkpoint.stop_signals) if one_node else []
    driver_watch.watch(driver, int(os.environ.get("RANK", "0")), stop_with, run.trainer.dist_timeout_s)
    result = in_own_session(fn, run, run_dir)
    driver_watch.finished()
    return result


def in_own_session(fn: WorkerFn, run: RunConfig, run_dir: str) -> RunResult | None:
    """A rank starts a session of its own, as torchrun's ranks do (start_new_session=True). Linux's
    autogroup scheduler shares the cores between sessions first: ranks left in the driver's session
    (the terminal's, the test runner's) share one group, and on a busy machine each gets less of a
    core than a rank of torchrun's; dtf measured 1.1-1.4 times raw DDP's step time that way
    (docs/development.md). Signals still reach the ranks: the terminal's Ctrl-C/SIGHUP and a kill
    of the driver reach the agent, which stops the ranks (signals_to_handle), or passes stop
    signals on to them (StopForwarding), by pid; SLURM tracks the processes of a job, not sessions."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())  # the forkserver's blocked signals (preloaded_forkserver)
    if multiprocessing.get_start_method(allow_none=True) == "forkserver":
        # The rank's own processes (DataLoader workers, ...) start as a spawned rank's do, as its
        # children: from the run's forkserver they would be the server's, with its blocked signals.
        multiprocessing.set_start_method("spawn", force=True)
        # Its own temporary directory (for what its processes share), as a spawned rank makes one: the
        # one it inherits is the driver's (the server's socket is there), removed when the driver ends.
        multiprocessing.current_process()._config.pop("tempdir", None)  # type: ignore[attr-defined]
        # It ends with os._exit once multiprocessing's finalizers have run (after its result went to
        # the agent); a spawned rank then waits for its other threads and runs the atexit functions
        # too (dtf.results.exit_now): the run dir's release, the checkpoint writer's close,
        # Horovod's shutdown, the user's own.
        mp_util.Finalize(None, _atexit_functions, exitpriority=0)
    if temp_dir_too_long():  # else multiprocessing makes it where it should, if the rank needs one
        short_temp_dir()
    if os.getpgrp() != os.getpid():  # a group leader cannot (a spawned child never is one)
        os.setsid()
    return fn(run, run_dir)


def _atexit_functions() -> None:
    """As the interpreter's exit: the threads that are not daemons first (multiprocessing waits for
    them only after its finalizers, this one among them), then the atexit functions."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit.unregister(mp_util._exit_function)  # type: ignore[attr-defined]  # it is running: this is one of its finalizers
    atexit._run_exitfuncs()


def failed_rank(e: ChildFailedError, run_dir: str, oom_kills: OomKills | None = None) -> UserError:
    """The error of the rank that failed first. A rank killed by a signal before it could record
    anything counts as first (its peers' errors are the consequence); otherwise the oldest record
    (dtf.failures). A rank that recorded an error and then died of a signal on its way out failed
    with that error: a process that exits while its gloo process group's threads run aborts
    ("terminate called without an active exception"), whether its error came first or not. A
    SIGKILL that the kernel's OOM killer sent is said to be out of memory."""
    records = failures.recorded(run_dir)
    first = failures.blamed(run_dir)
    killed = sorted(rank for rank, f in e.failures.items() if f.exitcode < 0 and rank not in records)
    logs = {r: os.path.dirname(f.error_file) if os.path.isabs(f.error_file) else "" for r, f in e.failures.items()}
    if killed:
        rank = killed[0]
        name = signal.Signals(-e.failures[rank].exitcode).name
        oom = oom_kills.ended(e.failures[rank].pid) if oom_kills is not None and name == "SIGKILL" else None
        if oom is not None:
            return RankFailedError(
                f"rank {rank} failed: out of memory: the kernel's OOM killer killed it (SIGKILL; {oom}): lower "
                "data.batch_size, shard the model's state (strategy=zero or strategy=fsdp), or give the run more "
                f"memory ({output_of(e, rank, run_dir)})"
            )
        return RankFailedError(f"rank {rank} failed: killed by signal {name} ({output_of(e, rank, run_dir)})")
    if first is not None:
        lost = lost_node(first, run_dir)
        if lost is not None:
            return RankFailedError(f"{lost} (rank {first.rank}'s logs: {logs.get(first.rank) or f'{run_dir}/logs'})")
        return failures.report(first, logs.get(first.rank) or f"{run_dir}/logs")
    rank, failure = min(e.failures.items())
    return RankFailedError(f"rank {rank} failed with exit code {failure.exitcode} ({output_of(e, rank, run_dir)})")


def output_of(e: ChildFailedError, rank: int, run_dir: str) -> str:
    """Where a failed rank's output is, also when it died before dtf's code ran in it (no error
    file): its log directory, or its own stderr file there; a node's local rank 0 writes to the
    terminal (its progress bar), where its output is, above this line."""
    failure = e.failures[rank]
    if os.path.isabs(failure.error_file):
        return f"its logs: {os.path.dirname(failure.error_file)}"
    if failure.local_rank == 0:
        return "its output is above"
    found = sorted(Path(run_dir, "logs").glob(f"*/attempt_*/{failure.local_rank}/stderr.log"), key=os.path.getmtime)
    return f"its error output: {found[-1]}" if found else f"its logs: {run_dir}/logs"


# A Unix socket's path holds 107 bytes; the forkserver's is <temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX.
_SOCKET_PATH_MAX = 107 - len("/pymp-12345678/listener-12345678")


def short_temp_dir() -> None:
    """Makes multiprocessing's temp dir now, where its sockets go (the forkserver's; a rank's, to pass
    tensors to its checkpoint writer): not under the run dir (temp_files_in), and under /tmp where
    the temp dir's path is too long for a socket's (a cluster's per-job TMPDIR can be), which
    failed with "AF_UNIX path too long"."""
    if not temp_dir_too_long():
        mp_util.get_temp_dir()
        return
    previous, tempfile.tempdir = tempfile.tempdir, "/tmp"
    try:
        mp_util.get_temp_dir()
    finally:
        tempfile.tempdir = previous


def temp_dir_too_long() -> bool:
    return len(os.fsencode(tempfile.gettempdir())) > _SOCKET_PATH_MAX and os.path.isdir("/tmp")


@contextlib.contextmanager
def temp_files_in(directory: Path) -> Iterator[None]:
    """torch's spawn leaves a pytorch-errorfile-*.pickle in the temp dir for every rank that fails:
    they go with the run's logs instead (the agent's own temp files too, while it starts ranks)."""
    directory.mkdir(parents=True, exist_ok=True)
    previous = tempfile.tempdir
    tempfile.tempdir = str(directory)
    try:
        yield
    finally:
        tempfile.tempdir = previous


@contextlib.contextmanager
def sized_thread_pools(nproc: int, configured: Any = None) -> Iterator[None]:
    """The ranks share this machine's cores: each rank's thread pools (torch's, and the OpenMP and
    BLAS pools that size themselves from OMP_NUM_THREADS when a rank imports them) get its share,
    as torchrun does, unless the user set OMP_NUM_THREADS (in the environment, or as
    launcher.env.OMP_NUM_THREADS: set here, before a rank imports anything). Without it every rank
    carries pools sized for the whole machine, which contend with the other ranks for the cores."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(configured or threads_per_rank(nproc))
    if not configured:
        os.environ[THREADS_CHOSEN] = "1"  # the ranks' start line may say so
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]
        os.environ.pop(THREADS_CHOSEN, None)


@contextlib.contextmanager
def ranks_without_main() -> Iterator[None]:
    """multiprocessing's spawn runs the starting process's __main__ again in every child, so that
    what it pickled by reference can be found there. A rank needs none of it: dtf's rank entry and
    the config travel by reference to dtf's modules, dtf.run_function's objects by value. And a
    script without an `if __name__ == "__main__":` guard would start its run again in every rank
    (a script piped to `python -`, whose __main__ is "<stdin>", could not be run again at all)."""
    from multiprocessing import spawn

    prepare = spawn.get_preparation_data

    def without_main(name: str) -> dict[str, Any]:
        data = prepare(name)
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
        return data

    spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        spawn.get_preparation_data = prepare


def rank_imports(composed: DictConfig) -> list[str]:
    """What every rank of this run imports before its first step: ~3-5 s of CPU each (torch, the
    loop, torch._dynamo at the optimizer's first step, torchmetrics when the run has metrics, and
    the fsspec package of each remote URL it names: s3fs, 0.4 s, for s3://). composed: the run's
    config as composed (RunConfig.composed), where its metrics and URLs are."""
    metrics = ["torchmetrics"] if composed.get("metrics") else []
    return ["dtf.rank", "dtf.train.loop", "torch._dynamo", *metrics, *_file_system_modules(composed)]


# The settings that may name a URL the ranks read or write.
_URL_KEYS = ("checkpoint.dir", "checkpoint.resume", "data.path", "data.val_path", "data.test_path")


def _file_system_modules(composed: DictConfig) -> list[str]:
    """The modules of the fsspec file systems of the run's remote URLs (one not installed is left
    to the refusal that names it: the forkserver passes over a preload it cannot import)."""
    modules = set()
    for key in _URL_KEYS:
        try:
            value = OmegaConf.select(composed, key, default=None)
        except OmegaConfBaseException:  # unset (???), or an interpolation the driver cannot resolve
            continue
        module = remote.file_system_module(value) if isinstance(value, str) else None
        if module is not None:
            modules.add(module)
    return sorted(modules)


# Signals a forkserver outlives: SLURM and a `kill` of the whole job send them to every process, and
# a dead forkserver reports the ranks it started as failed (exit status 255) while they still run.
_FORKSERVER_BLOCKS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


@contextlib.contextmanager
def preloaded_forkserver(method: str, modules: list[str], stop_signals: list[str]) -> Iterator[None]:
    """With launcher.start_method=forkserver (the default), one process imports what the ranks
    need (rank_imports) and forks every rank from it, instead of each rank importing it all again
    as spawned ranks do: a run's start costs the CPU of one rank's imports, not nproc's. The server
    is this run's own: started here, with this run's environment (which a forked rank inherits, as a
    spawned one inherits the driver's), and let go at the end, so the next run in this process (a
    sweep, dtf.run called again) gets a new one with its own environment.

    It starts with the signals that may be sent to every process blocked (not ignored: a rank
    forked from it unblocks them first thing, in_own_session, and one sent meanwhile then acts)."""
    if method != "forkserver":
        yield
        return
    from multiprocessing import forkserver, resource_tracker

    _let_go_of_forkserver()  # one this process started before, with another environment and preload
    forkserver.set_forkserver_preload(["dtf.launch.forkserver_exit", *modules])
    # Before the signals are blocked: starting the resource tracker (if it is not running) unblocks
    # SIGTERM after (bpo-33613), which the server would then start without.
    resource_tracker.ensure_running()
    blocked = {signal.Signals[name] for name in (*_FORKSERVER_BLOCKS, *stop_signals)}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    os.environ[forkserver_exit.SERVER] = "1"
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[forkserver_exit.SERVER]
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    try:
        yield
    finally:
        _let_go_of_forkserver()


def _let_go_of_forkserver() -> None:
    """multiprocessing keeps one forkserver per process and stops it only at exit (its _stop, for
    its own tests, waits for every process forked from it). Here: close this process's end of its
    "alive" pipe, which ends the server once the last rank it forked has ended too, reap it in the
    background, and forget it, so that the next run starts its own."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    with server._lock:
        pid, address = server._forkserver_pid, server._forkserver_address
        if pid is None:
            return
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
    if address and not mp_util.is_abstract_socket_namespace(address):
        with contextlib.suppress(OSError):
            os.unlink(address)
    threading.Thread(target=_reap, args=(pid,), name="dtf-forkserver-reaper", daemon=True).start()


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


@contextlib.contextmanager
def standard_start_method(method: str) -> Iterator[None]:
    """A spawned child sets the parent's *default* start method first thing, whatever context started
    it; in a worker of Hydra's joblib launcher that is "loky", which the child cannot recreate ("cannot
    find context for 'loky'"). While the ranks start, the default is a standard one."""
    current = multiprocessing.get_start_method(allow_none=True)
    if current in (None, "spawn", "fork", "forkserver"):
        yield
        return
    multiprocessing.set_start_method(method, force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(current, force=True)


# The resource tracker's warnings ("resource_tracker: There appear to be N leaked semaphore objects"):
# it unlinks what dead processes left it all the same.
_TRACKER_LEAK_WARNING = "ignore:resource_tracker:UserWarning"


def start_resource_tracker_ignoring(names: list[str]) -> None:
    """Python's resource tracker (a process multiprocessing starts for the ranks' queues) dies of
    SIGUSR1 like any process, and SLURM signals every process of a job: start it now, with the
    stop signals ignored (ignored signals stay ignored across exec), so it outlives them.

    Ranks that the agent kills (Ctrl-C, a failed peer) leave it the semaphores of their DataLoader
    workers' queues. It unlinks them when the driver's run ends, and would say so in a warning
    printed after the driver has gone, under the shell's prompt: it starts with that warning off
    (a -W option, which multiprocessing passes on to the processes it starts)."""
    from multiprocessing import resource_tracker

    previous = {signal.Signals[n]: signal.signal(signal.Signals[n], signal.SIG_IGN) for n in names}
    sys.warnoptions.append(_TRACKER_LEAK_WARNING)
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(_TRACKER_LEAK_WARNING)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def died_of(e: ChildFailedError, signal_name: str) -> bool:
    """Whether every failed rank was killed by that signal (not one that raised or exited)."""
    signum = signal.Signals[signal_name.split()[0]].value
    return all(failure.exitcode == -signum for failure in e.failures.values())


def newest_checkpoint(signal_name: str, checkpoint_root: Path) -> Stopped:
    """Where a run stands when the ranks could not say so themselves: what is on disk counts."""
    from dtf.train.checkpoint import committed, read_marker  # only here: it loads torch.distributed.checkpoint

    newest = committed(checkpoint_root)[:1]
    if not newest:
        return Stopped(signal_name, None, None)
    return Stopped(signal_name, read_marker(newest[0]).step, str(newest[0]))


class StopForwarding:
    """Passes stop signals that reach this process (the agent) on to the ranks it started, which
    agree on a step, save and return (dtf.signals). The ranks are this process's
    multiprocessing children (elastic starts them with torch.multiprocessing). A second signal
    to this process is the usual "I mean it": the agent kills the ranks without waiting."""

    def __init__(self, names: list[str]) -> None:
        self.received: str | None = None
        self.twice = False
        self._previous = {signal.Signals[n]: signal.signal(signal.Signals[n], self._forward) for n in names}

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        if self.received:  # the agent kills the ranks at once; a save they were making stays uncommitted
            self.twice = True
            raise SignalException(f"second stop signal {signum}", sigval=signal.SIGKILL)
        self.received = signal.Signals(signum).name
        for child in multiprocessing.active_children():
            if child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
