"""The bytes a strategy sends per optimizer step, and over which links: across hosts, or inside one.

The collectives are rings, as gloo and NCCL run them for large tensors: a ring over n ranks in
group order passes every rank's data once round (an all-gather or a reduce-scatter of S bytes
sends (n-1)/n x S from each rank to the next) or twice (an all-reduce: 2 (n-1)/n x S). A hop from
a rank to the next that lands on another host crosses that host's link; the others stay inside it.
Ranks are placed as every launcher places them: consecutive ranks on one host.

Per step, with M the model's parameter (and gradient) bytes:
- ddp: one all-reduce of the gradients over all ranks;
- zero stage 1: the same, then an all-gather of the updated parameters (in chunks of units);
- zero stage 2: an all-gather of the parameters (kept from forward to backward), a reduce-scatter
  of the gradients;
- zero stage 3 and fsdp: an all-gather in forward, another in backward, a reduce-scatter;
- mics with groups of G: the same three inside each group of G ranks, then an all-reduce of each
  rank's 1/G of the gradients across the groups, among the ranks that hold the same shard (in
  bf16 with strategy.cross_group_dtype=bfloat16: half the fp32 gradients' bytes).

gloo has no ring reduce-scatter: its reduce_scatter_tensor all-reduces the whole tensor and keeps a
slice, twice a ring's bytes (measured on the veth counters of scripts/local-hosts.sh's hosts, as
benchmarks/topology.py does). NCCL's is a ring.

Small tensors are latency-bound instead: a ring collective over n ranks takes n-1 hops (an
all-gather) or 2 (n-1) (an all-reduce) one after the other, each waiting for the last, so
dtf.strategy.choose charges every hop of a collective the step waits for the probe's latency per
hop (the latency across for all hops of a ring that crosses hosts: it runs at the pace of its
slowest). Collectives that run beside the compute, on gloo's threads as on CUDA streams, overlap
their latencies, and only their bytes count: the gradients' all-reduces (DDP's buckets, mics's
across the groups), FSDP's all-gathers (prefetched) and reduce-scatters (dtf.strategy.cpu_overlap
on CPU), and zero stage 1's all-gathers after the step (beside the next forward, in chunks of units).
Not mics's reduce-scatter inside its groups on gloo, where the all-reduce across the groups starts
from its output at once (dtf.strategy.mics).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtf.dist.topology import Layout


@dataclass(frozen=True)
class Plan:
    """A strategy with its sharding: group = how many ranks share one copy of the model state
    (1 for ddp and zero stage 1, whose parameters are whole on every rank; the world for zero
    stages 2-3 and fsdp; G for mics)."""

    strategy: str  # ddp, zero1, zero2, zero3, fsdp, mics
    group: int
    cross_group_dtype: str = "float32"  # mics: the dtype its all-reduce across the groups sends

    def __str__(self) -> str:
        if self.strategy == "mics":
            return f"mics G={self.group}" + (" bf16" if self.cross_group_dtype == "bfloat16" else "")
        if self.strategy.startswith("zero"):
            return f"zero stage {self.strategy[4:]}"
        return self.strategy

    def overrides(self) -> list[str]:
        """The command line that runs this plan."""
        if self.strategy == "mics":
            found = ["strategy=mics", f"strategy.partition_group_size={self.group}"]
            if self.cross_group_dtype != "float32":
                found.append(f"strategy.cross_group_dtype={self.cross_group_dtype}")
            return found
        if self.strategy.startswith("zero"):
            return ["strategy=zero", f"strategy.stage={self.strategy[4:]}"]
        return [f"strategy={self.strategy}"]


@dataclass(frozen=True)
class Traffic:
    """Bytes per step: the most any one host sends across its link, the most any one rank sends
    to ranks of its own host, and the ring hops the step waits for, one after the other, of the
    collectives that cross hosts and of those that stay inside them."""

    across_per_host: float
    inside_per_rank: float
    hops_across: int
    hops_inside: int


def plans(world: int) -> list[Plan]:
    """Every plan a world of this size can run: ddp, zero stages 1-3, fsdp, mics at each G that
    divides the world."""
    found = [Plan("ddp", 1), Plan("zero1", 1), Plan("zero2", world), Plan("zero3", world), Plan("fsdp", world)]
    return found + [Plan("mics", g) for g in range(1, world + 1) if world % g == 0]


def per_step(
    plan: Plan, layout: Layout, param_bytes: float, grad_bytes: float, units: int = 1, backend: str = "gloo"
) -> Traffic:
    """The traffic of one optimizer step. param_bytes: what an all-gather moves (the model's
    parameters in the dtype they are gathered in); grad_bytes: what the reduction moves (fp32
    gradients under autocast); units: the sharded units (FSDP's blocks and root), each its own
    collectives over its share of the bytes; the DDP family's gradients go as one bucketed all-reduce."""
    world = layout.world
    rings = _Rings(layout)
    reduce_scatter = rings.all_reduce if backend == "gloo" else rings.all_gather  # a ring's bytes, see above
    everyone = [list(range(world))]
    if plan.strategy == "ddp":
        rings.all_reduce(everyone, grad_bytes, 1, overlapped=True)
    elif plan.strategy == "zero1":
        rings.all_reduce(everyone, grad_bytes, 1, overlapped=True)
        rings.all_gather(everyone, param_bytes, units, overlapped=True)  # in chunks, beside the next forward
    elif plan.strategy in ("zero2", "zero3", "fsdp"):
        for _ in range(1 if plan.strategy == "zero2" else 2):
            rings.all_gather(everyone, param_bytes, units, overlapped=True)
        reduce_scatter(everyone, grad_bytes, units, overlapped=True)
    elif plan.strategy == "mics":
        g = plan.group
        if world % g:
            raise ValueError(f"G={g} does not divide the world size {world}")
        partitions = [list(range(start, start + g)) for start in range(0, world, g)]
        for _ in range(2):
            rings.all_gather(partitions, param_bytes, units, overlapped=True)
        # on gloo with more than one group, each unit's all-reduce across starts from its output
        reduce_scatter(partitions, grad_bytes, units, overlapped=backend == "nccl" or g == world)
        replicas = [list(range(offset, world, g)) for offset in range(g)]  # the ranks holding one shard
        across = grad_bytes / g / (2 if plan.cross_group_dtype == "bfloat16" else 1)  # fp32 gradients, or bf16
        rings.all_reduce(replicas, across, units, overlapped=True)
    else:
        raise ValueError(f"no traffic formula for strategy {plan.strategy!r}")
    return rings.traffic()


class _Rings:
    """Adds up the rings' hops: groups passed together run at the same time, each its own ring."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.across = [0.0] * layout.nodes
        self.inside = [0.0] * layout.world
        self.hops_across = 0
        self.hops_inside = 0

    def all_reduce(self, groups: list[list[int]], size: float, times: int, overlapped: bool = False) -> None:
        self._rings(groups, 2 * size, times, 0 if overlapped else 2)

    def all_gather(self, groups: list[list[int]], size: float, times: int, overlapped: bool = False) -> None:
        self._rings(groups, size, times, 0 if overlapped else 1)

    def _rings(self, groups: list[list[int]], passes_bytes: float, times: int, waited_passes: int) -> None:
        """waited_passes: the times round the ring the step waits for (0: it overlaps compute)."""
        node_of = self.layout.node_of
        crosses = inside = False
        hops = waited_passes * (max(len(group) for group in groups) - 1)  # the groups' rings run side by side
        for group in groups:
            n = len(group)
            if n == 1:
                continue
            sent = passes_bytes * (n - 1) / n  # what each rank sends to the next, over all `times`
            for rank, nxt in zip(group, group[1:] + group[:1], strict=True):
                if node_of(rank) != node_of(nxt):
                    self.across[node_of(rank)] += sent
                    crosses = True
                else:
                    self.inside[rank] += sent
                    inside = True
        if crosses:  # a ring that crosses runs at the pace of its slowest hop
            self.hops_across += times * hops
        elif inside:
            self.hops_inside += times * hops

    def traffic(self) -> Traffic:
        return Traffic(max(self.across), max(self.inside), self.hops_across, self.hops_inside)
