"""dtf.dist.probe on real gloo ranks of this machine: every rank ends with the same figures (they
choose alike, or their collectives would not match), each a bandwidth and a latency where the
layout has such a link (its time: benchmarks/topology.py). Its figures against tc's shaping: the shaped-hosts
test in tests/e2e/test_multinode.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtf.dist.probe import measure
from dtf.dist.topology import Layout
from tests.helpers.gloo import run_on_ranks


def _probe_agrees(rank: int, world_size: int, nodes: int) -> None:
    layout = Layout(nodes, world_size // nodes)
    links = measure(layout, rank, torch.device("cpu"), budget_s=1.0)
    figures = [links.across_bytes_per_s, links.inside_bytes_per_s, links.across_latency_s, links.inside_latency_s]
    everyone: list[object] = [None] * world_size
    dist.all_gather_object(everyone, figures)
    assert all(f == figures for f in everyone), everyone  # the same on every rank, bit for bit
    if nodes > 1:
        assert links.across_bytes_per_s is not None and links.across_bytes_per_s > 1e6 and links.across_latency_s > 0
    else:
        assert links.across_bytes_per_s is None
    if world_size // nodes > 1:
        assert links.inside_bytes_per_s is not None and links.inside_bytes_per_s > 1e6 and links.inside_latency_s > 0
    else:
        assert links.inside_bytes_per_s is None


def test_one_node_of_two_ranks_and_two_nodes_of_two() -> None:
    run_on_ranks(_probe_agrees, 2, 1)
    run_on_ranks(_probe_agrees, 4, 2)
