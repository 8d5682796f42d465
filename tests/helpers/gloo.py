"""Run a function on N gloo ranks in child processes (for unit tests of collective code)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.reduction import DupFd
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from dtf.dist.env import free_port

PRELOAD = ["torch", "torch._dynamo", "dtf.train.loop"]


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    output: None,
) -> None:
    os.environ.clear()  # the caller's, not the forkserver's (started by an earlier test, with its environment)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # Passed: leave without the interpreter's finalization, where gloo's worker threads now and then
    # abort the process ("terminate called without an active exception", SIGABRT) after the test is
    # done (seen on torch 2.13 under load; cf. pytorch#179291). A failure above still raises as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _CallersOutput:
    """The caller's stdout and stderr, sent to a rank with its arguments: it forks from a server an
    earlier test may have started, whose output went elsewhere (that test's capfd, say)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_write_to, (DupFd(1), DupFd(2)))


def _write_to(out: Any, err: Any) -> None:
    for duplicate, fd in ((out, 1), (err, 2)):
        received = duplicate.detach()
        os.dup2(received, fd)
        os.close(received)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """fn(rank, world_size, *args) on each rank; an assertion failing on any rank fails the caller.
    The ranks fork from a server that imported torch and dtf's training stack once for this test
    process (as dtf's local launcher does for a run), instead of importing them again each."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), args, dict(os.environ), _CallersOutput()),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )
