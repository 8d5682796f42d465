"""The links between a run's ranks, measured on its own process groups in about a second: what
strategy=auto and strategy.partition_group_size=auto choose by (dtf.strategy.choose).

Two kinds of group: the ranks of one node (inside), and the ranks with the same local rank on every
node (across). Every group of a kind runs at once, as a sharded strategy's collectives do, so
the figure across is what a node's link carries with all its ranks sending. Each kind is timed
with a one-element all-reduce after a millisecond of compute on every rank, less that compute
alone: the wait a step's collective pays, where the ranks arrive at it from their own compute (on
cores that several ranks share, that wait is several times an idle all-reduce's). Its 2 (n-1) ring
hops over n ranks give the latency of one hop. Then with all-reduces four times larger each round
from 256 KiB until one takes 50 ms (64 MiB at most, or when the budget runs out). Every rank
takes the slowest rank's times (an all-reduce MAX), so all of them compute the same figures.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dtf.dist.topology import Layout, Links

_FIRST_BYTES = 256 * 1024
_LAST_BYTES = 64 * 1024 * 1024
_LONG_ENOUGH_S = 0.05
_LATENCY_REPEATS = 25  # about 60 ms in all: a median that a few slow draws do not move
_WORK_SIDE = 128  # a 128 x 128 matmul, _WORK_TIMES times: about 1 ms on one CPU thread
_WORK_TIMES = 20


def measure(layout: Layout, rank: int, device: torch.device, budget_s: float = 1.5) -> Links:
    """Collective over the whole world: every rank calls it with the same layout."""
    deadline = time.perf_counter() + budget_s
    nodes, per_node = layout.nodes, layout.ranks_per_node
    across = inside = None
    across_latency = inside_latency = 0.0
    if nodes > 1:
        groups = [[node * per_node + local for node in range(nodes)] for local in range(per_node)]
        across_latency, seconds, size = _time_kind(groups, rank, device, deadline)
        # every rank of a node sends 2 (n-1)/n of the tensor to a rank on another node
        across = per_node * 2 * (nodes - 1) / nodes * size / seconds
    if per_node > 1:
        groups = [[node * per_node + local for local in range(per_node)] for node in range(nodes)]
        inside_latency, seconds, size = _time_kind(groups, rank, device, deadline)
        inside = 2 * (per_node - 1) / per_node * size / seconds
    return Links(across, inside, across_latency, inside_latency)


def _time_kind(groups: list[list[int]], rank: int, device: torch.device, deadline: float) -> tuple[float, float, int]:
    """(latency of one ring hop, seconds of the last all-reduce less its latency, its bytes) for
    this kind of group, the slowest rank's."""
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    try:
        small = torch.zeros(1, device=device)
        dist.all_reduce(small, group=mine)  # connects the group
        hops = 2 * (len(groups[0]) - 1)  # a one-element all-reduce's ring: once round to reduce, once to share
        work = torch.ones(_WORK_SIDE, _WORK_SIDE, device=device)
        alone = statistics.median(_timed_work(work, None, device) for _ in range(_LATENCY_REPEATS))
        after_work = statistics.median(_timed_work(work, (small, mine), device) for _ in range(_LATENCY_REPEATS))
        (latency,) = _slowest([max(after_work - alone, 1e-6)], device)
        size = _FIRST_BYTES
        while True:
            tensor = torch.ones(size // 4, device=device)
            took = _timed(tensor, mine, device)
            # the next round takes about 4x as long: stop where it would pass this rank's deadline
            out_of_time = 5 * took > deadline - time.perf_counter()
            seconds, stop = _slowest([took, float(out_of_time)], device)  # every rank stops at the same round
            if seconds >= _LONG_ENOUGH_S or size >= _LAST_BYTES or stop:
                return latency / hops, max(seconds - latency, 1e-9), size
            size *= 4
    finally:
        dist.destroy_process_group(mine)


def _timed_work(work: torch.Tensor, then: tuple[torch.Tensor, dist.ProcessGroup] | None, device: torch.device) -> float:
    """Seconds of the fixed compute, then (where given) a one-element all-reduce over the group."""
    _sync(device)
    started = time.perf_counter()
    for _ in range(_WORK_TIMES):
        torch.mm(work, work)
    if then is not None:
        dist.all_reduce(then[0], group=then[1])
    _sync(device)
    return time.perf_counter() - started


def _timed(tensor: torch.Tensor, group: dist.ProcessGroup, device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    _sync(device)
    return time.perf_counter() - started


def _slowest(values: list[float], device: torch.device) -> list[float]:
    """The most any rank has of each value (each by its own clock), on every rank: they all decide alike."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
