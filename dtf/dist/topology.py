"""Where a run's ranks are and how fast their links are: what dtf.strategy.traffic counts bytes over,
dtf.dist.probe measures and dtf.strategy.choose chooses by."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Where the ranks run: nodes x ranks per node, rank r on node r // ranks_per_node."""

    nodes: int
    ranks_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


@dataclass(frozen=True)
class Links:
    """What the probe measured: bytes per second that one host sends across its link (all its
    ranks at once) and that one rank sends to another of its host, and the latency of one ring hop
    on each (a small collective's time over its hops). None where there is no such link (one node;
    one rank per node)."""

    across_bytes_per_s: float | None
    inside_bytes_per_s: float | None
    across_latency_s: float = 0.0
    inside_latency_s: float = 0.0

    def describe(self) -> str:
        parts = []
        if self.across_bytes_per_s is not None:
            latency = f"{self.across_latency_s * 1e3:.2g} ms"
            parts.append(f"across nodes {_rate(self.across_bytes_per_s)} per node (latency {latency} a hop)")
        if self.inside_bytes_per_s is not None:
            latency = f"{self.inside_latency_s * 1e3:.2g} ms"
            parts.append(f"inside a node {_rate(self.inside_bytes_per_s)} per rank (latency {latency} a hop)")
        return ", ".join(parts) or "no links (one rank)"


def _rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"
