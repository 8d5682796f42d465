"""Elastic runs (launcher.nnodes=MIN:MAX): which world sizes a run may take, each rank's batch on
each of them, and what every change of membership cost.

The global batch stays the same on every world size (data.global_batch_size; for MIN:MAX without
it, the batch of the full-size run), so that a run that lost a node and went on, or gained one,
trains the model an uninterrupted run trains: the same samples in the same steps (dtf's data order
does not depend on the world size), from the newest checkpoint, which reshards onto any size.
Torch's elastic agent and its c10d rendezvous do the rest: a failed rank restarts every node's
ranks (launcher.max_restarts), a node that arrives restarts them at the next rendezvous.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtf.errors import UserError

if TYPE_CHECKING:
    from dtf.config.typed import RunConfig

# The c10d rendezvous' settings a user may give (torchrun's --rdzv-conf), in seconds or counts.
RDZV_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)
ENDED_DIR = Path("logs") / "ended"


@dataclass(frozen=True)
class Plan:
    """The sizes a run may take: nodes MIN..MAX (as the rendezvous admits them) of nproc ranks."""

    nproc: int
    min_nodes: int
    max_nodes: int
    global_batch: int | None  # samples per optimizer step over all ranks; None: per-rank batch fixed
    accum: int
    partitions: int | None  # Parquet's canonical partitions, where the plan fixes them
    legal_nodes: tuple[int, ...]  # node counts in [MIN, MAX] that keep the global batch
    asked: tuple[int, int]  # launcher.nnodes as given

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.max_nodes

    def world_sizes(self) -> list[int]:
        return [n * self.nproc for n in range(self.min_nodes, self.max_nodes + 1)]

    def per_rank_batch(self, world_size: int) -> int:
        assert self.global_batch is not None
        return self.global_batch // (world_size * self.accum)

    def describe(self) -> str:
        """For the start line: the sizes the run may take and what stays the same on all of them."""
        sizes = ", ".join(map(str, self.world_sizes()))
        nodes = f"{self.min_nodes}" if not self.elastic else f"{self.min_nodes} to {self.max_nodes}"
        left = sorted(set(range(self.asked[0], self.asked[1] + 1)) - set(range(self.min_nodes, self.max_nodes + 1)))
        out = f" (not {', '.join(map(str, left))}: cannot keep it)" if left else ""
        return f"elastic: {nodes} nodes{out}, world sizes {sizes}, global batch {self.global_batch} on each"


def plan(run: RunConfig, started_as: int | None = None) -> Plan | None:
    """The plan of a run with data.global_batch_size or launcher.nnodes=MIN:MAX (None: neither).
    UserError (one line) where no world size in the range can keep the global batch. started_as:
    the world size of ranks started by another launcher (torchrun), where the driver runs in them."""
    from dtf.config.schema import LocalLauncherConfig, ParquetDataConfig, SlurmLauncherConfig, TextDataConfig

    launcher = run.launcher
    accum = run.trainer.grad_accum_steps
    node_range = ("launcher.nnodes", "")  # the key of an elastic range, and its value
    if started_as is not None:
        low, high, nproc = 1, 1, started_as
    elif isinstance(launcher, LocalLauncherConfig):
        low, high = launcher.node_range()
        nproc = launcher.nproc
        node_range = ("launcher.nnodes", launcher.nnodes)
    elif isinstance(launcher, SlurmLauncherConfig) and launcher.elastic:
        low, high = launcher.node_range()
        nproc = launcher.tasks_per_node  # one agent per node starts them
        node_range = ("launcher.nodes", str(launcher.nodes))
    else:
        low, high, nproc = 1, 1, int(launcher.nproc)
    # As the user configured them: data.batch_size may be a world size's already (apply).
    given = run.data.global_batch_size
    if given is None and low == high:
        return None
    glob = given if given is not None else run.configured_batch_size * nproc * high * accum
    why = "data.global_batch_size" if given is not None else f"data.batch_size x {nproc * high} ranks at MAX"
    fits = [n for n in range(low, high + 1) if glob % (n * nproc * accum) == 0]
    partitions = None
    if isinstance(run.data, ParquetDataConfig | TextDataConfig):
        # auto, or a number: the user's, or (after apply) this plan's own, which plans the same sizes
        setting = run.data.canonical_partitions
        fixed = int(setting) if setting != "auto" else None
        sizes = [n * nproc for n in fits]
        if fixed is None and sizes:  # every size that fits the batch also divides these partitions
            from dtf.data.parquet.plan import AUTO_PARTITIONS_BASE

            batch = glob // accum
            partitions = math.gcd(batch, math.lcm(AUTO_PARTITIONS_BASE, *sizes))
        else:
            partitions = fixed
        if partitions is not None:
            fits = [n for n in fits if partitions % (n * nproc) == 0 and (glob // accum) % partitions == 0]
    key, value = node_range if low < high else ("data.global_batch_size", str(glob))
    if not fits:
        what = f"the global batch {glob} ({why})" + (f" with {partitions} canonical partitions" if partitions else "")
        sizes = [n * nproc for n in range(low, high + 1)]
        example = math.lcm(*sizes) * accum * max(1, glob // (math.lcm(*sizes) * accum))
        raise UserError(
            f"{key}={value}: no world size of this run ({', '.join(map(str, sizes))} ranks, x "
            f"trainer.grad_accum_steps={accum}) divides {what}: give data.global_batch_size a multiple of "
            f"{math.lcm(*sizes) * accum}, e.g. {example}"
        )
    # The rendezvous admits a range of node counts: the longest run of sizes that fit, from the smallest.
    first = fits[0]
    last = first
    while last + 1 in fits:
        last += 1
    return Plan(nproc, first, last, glob, accum, partitions, tuple(fits), (low, high))


def apply(run: RunConfig, world_size: int) -> RunConfig:
    """The run as the ranks of a world size take it, once that size is known (in a rank; on the
    driver where it knows it): each rank's batch and Parquet's partitions by the plan. run itself
    is left as it is, and what the user configured stays in the one returned (configured_batch_size),
    so that it may be applied again, to another size."""
    from dtf.config.schema import ParquetDataConfig, TextDataConfig

    p = plan(run)
    if p is None or p.global_batch is None:
        return run
    if p.global_batch % (world_size * p.accum):
        raise UserError(
            f"the world size {world_size} cannot keep the global batch {p.global_batch} (data.global_batch_size): "
            f"run on {', '.join(map(str, p.world_sizes()))} ranks"
        )
    data = replace(run.data, batch_size=p.per_rank_batch(world_size))
    if p.partitions is not None and p.elastic and isinstance(data, ParquetDataConfig | TextDataConfig):
        data = replace(data, canonical_partitions=p.partitions)  # every size the run may take divides them
    return replace(run, data=data)


def scaling_world_size(run: RunConfig, world_size: int) -> float:
    """The world size trainer.lr_scaling scales by: the one whose per-rank batch is data.batch_size
    as configured, so that the LR stays the same on every size of a run with a fixed global batch."""
    p = plan(run)
    if p is None or p.global_batch is None:
        return world_size
    return p.global_batch / (run.configured_batch_size * p.accum)


def rdzv_configs(given: dict[str, Any]) -> dict[str, Any]:
    """launcher.rdzv_configs, checked: the c10d rendezvous' own keys only."""
    for key in given:
        if key not in RDZV_KEYS:
            raise UserError(
                f"launcher.rdzv_configs.{key} is not a setting of torch's c10d rendezvous: use {', '.join(RDZV_KEYS)}"
            )
    return dict(given)


# What a membership change cost, recorded by the ranks of the world that ended and read by the next.


@dataclass(frozen=True)
class Ended:
    """Where a rank's world stood when it ended (a failed peer, a stop for a restart)."""

    rank: int
    world_size: int
    step: int
    time: float


def record_end(run_dir: Path, rank: int, world_size: int, step: int) -> None:
    from dtf.files import write_atomically

    path = run_dir / ENDED_DIR / f"rank_{rank}.json"
    with contextlib.suppress(OSError):  # a full disk: the change is recorded without its cost
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(asdict(Ended(rank, world_size, step, time.time()))))


def take_ended(run_dir: Path) -> list[Ended]:
    """The previous world's records, removed as they are read (rank 0, once the new world resumed)."""
    found = []
    for path in sorted((run_dir / ENDED_DIR).glob("rank_*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            found.append(Ended(**json.loads(path.read_text())))
        path.unlink(missing_ok=True)
    return found


def change(ended: list[Ended], resumed_step: int, old: int, new: int) -> dict[str, Any]:
    """One membership change, as summary.json lists it; time_lost_s is completed at the new world's
    first step (from ended_at: when the old world ended)."""
    mine = [e for e in ended if e.world_size == old]
    reached = max((e.step for e in mine), default=None)
    return {
        "step": resumed_step,
        "old_world_size": old,
        "new_world_size": new,
        "time_lost_s": None,
        "steps_recomputed": reached - resumed_step if reached is not None else None,
        "ended_at": max((e.time for e in mine), default=None),
    }


def complete(change: dict[str, Any], now: float) -> dict[str, Any]:
    """The change once the new world made its first step: the time from the old world's end."""
    done = {k: v for k, v in change.items() if k != "ended_at"}
    if change.get("ended_at") is not None:
        done["time_lost_s"] = round(now - change["ended_at"], 3)
    return done
