"""strategy=auto and strategy.partition_group_size=auto, made concrete on the ranks at start: the
links measured (dtf.dist.probe), the model's size and each plan's memory verdict (dtf.memory),
then the plan dtf.strategy.choose predicts fastest. Every rank runs the same probe; rank 0 decides
and tells the others, so each node's memory verdicts count and all ranks take one plan."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtf.config.schema import (
    AutoStrategyConfig,
    DDPStrategyConfig,
    FSDPStrategyConfig,
    MemoryCheck,
    MicsStrategyConfig,
    ZeroStrategyConfig,
)
from dtf.config.typed import StrategyConfig
from dtf.dist import env as dist_env
from dtf.dist import probe
from dtf.dist.topology import Layout
from dtf.errors import UserError
from dtf.memory import WHOLE_REPLICA, Estimate, Node, OptimizerFactory, estimate, shortfall
from dtf.strategy.choose import Choice, Model, NothingFits, choose
from dtf.strategy.traffic import Plan


def wants_choice(cfg: Any) -> bool:
    return isinstance(cfg, AutoStrategyConfig) or (
        isinstance(cfg, MicsStrategyConfig) and cfg.partition_group_size == "auto"
    )


def candidates(cfg: Any, world: int) -> list[Plan]:
    """The plans to choose among, the most sharded last (its memory verdict is the refusal when
    none fits). strategy=auto leaves out the plans another one runs as fast: zero stage 3 is fsdp,
    mics G=1 is DDP on FSDP's machinery, mics G=world is fsdp."""
    groups = [g for g in range(1, world + 1) if world % g == 0]
    if isinstance(cfg, MicsStrategyConfig):  # at G = world one group: nothing crosses, in any dtype
        return [Plan("mics", g, cfg.cross_group_dtype if g < world else "float32") for g in groups]
    middle = [Plan("mics", g) for g in groups if 1 < g < world]
    return [Plan("ddp", 1), Plan("zero1", 1), *middle, Plan("zero2", world), Plan("fsdp", world)]


def config_for(plan: Plan, cfg: Any) -> StrategyConfig:
    """The concrete strategy config of a plan, keeping what the user set (block classes, meta init)."""
    if isinstance(cfg, MicsStrategyConfig):
        return dataclasses.replace(cfg, partition_group_size=plan.group, cross_group_dtype=plan.cross_group_dtype)
    blocks = list(cfg.block_classes) if cfg.block_classes else None
    if plan.strategy == "ddp":
        return DDPStrategyConfig(meta_init=cfg.meta_init)
    if plan.strategy.startswith("zero"):
        return ZeroStrategyConfig(stage=int(plan.strategy[4:]), block_classes=blocks, meta_init=cfg.meta_init)
    if plan.strategy == "mics":
        return MicsStrategyConfig(partition_group_size=plan.group, block_classes=blocks, meta_init=cfg.meta_init)
    return FSDPStrategyConfig(block_classes=blocks, meta_init=cfg.meta_init)


def most_sharded(cfg: Any, world: int) -> StrategyConfig:
    """What the driver's memory check judges an auto choice by: the plan that holds the least."""
    return config_for(candidates(cfg, world)[-1], cfg)


def requested(cfg: Any) -> str:
    return "strategy=auto" if isinstance(cfg, AutoStrategyConfig) else "strategy.partition_group_size=auto"


def layout_of(env: dist_env.DistEnv) -> Layout | None:
    """The nodes and ranks per node, where every node runs as many ranks, consecutive ones (as
    every dtf launcher and torchrun place them); None where they do not."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    even = per_node > 0 and env.world_size % per_node == 0 and env.local_rank == env.rank % per_node
    agreed = torch.tensor([per_node, -per_node, 0 if even else 1], device=env.device)
    if env.world_size > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    most, least, uneven = agreed.tolist()
    if uneven or most != -least:
        return None
    return Layout(env.world_size // per_node, per_node)


def resolve(
    cfg: Any,
    env: dist_env.DistEnv,
    build: Callable[[], nn.Module] | None,
    optimizer_factory: OptimizerFactory | None,
    memory_check: MemoryCheck,
    precision: str,
) -> tuple[StrategyConfig, dict[str, Any]]:
    """The concrete strategy config for an auto one, and the record of the choice (summary.json's
    strategy_choice); rank 0 says in one line what it measured, chose and why. Collective.
    build: the model as the run builds it (None: a function's, unknown: mics takes a node's ranks)."""
    world = env.world_size
    asked = requested(cfg)
    if world == 1:
        plan = candidates(cfg, 1)[0]
        _say(env, f"{asked}: a world of 1 rank has nothing to choose between (no links to measure): {plan}")
        return config_for(plan, cfg), {"requested": asked, "plan": str(plan), "why": "one rank"}
    layout = layout_of(env)
    if layout is None:
        plan = candidates(cfg, world)[-1]
        _say(
            env,
            f"{asked}: the nodes do not hold equal runs of consecutive ranks (as a Spark stage may place them), "
            f"so no partition group stays inside a node: {plan}",
        )
        return config_for(plan, cfg), {"requested": asked, "plan": str(plan), "why": "uneven nodes"}
    started = time.perf_counter()
    links = probe.measure(layout, env.rank, env.device)
    probe_s = time.perf_counter() - started
    record: dict[str, Any] = {
        "requested": asked,
        "nodes": layout.nodes,
        "ranks_per_node": layout.ranks_per_node,
        "across_bytes_per_s": links.across_bytes_per_s,
        "inside_bytes_per_s": links.inside_bytes_per_s,
        "across_latency_s": links.across_latency_s,
        "inside_latency_s": links.inside_latency_s,
        "probe_s": probe_s,
    }
    if build is None:  # a function's model: shard inside a node, MiCS's own rule
        plan = Plan("mics", layout.ranks_per_node)
        _say(
            env,
            f"{asked}: measured {links.describe()}; the model is built by the function, so its size is not known "
            f"here: {plan}, sharded inside each node as MiCS does",
        )
        return config_for(plan, cfg), {**record, "plan": str(plan), "why": "model size unknown"}
    model, found = _model_figures(build, optimizer_factory, cfg)
    plans = candidates(cfg, world)
    verdicts = _verdicts(plans, cfg, found, env, memory_check, precision)
    choice: Choice | str | None = None
    if env.is_main:
        try:
            choice = choose(plans, layout, links, model, verdicts, dist.get_backend())
        except NothingFits as e:
            choice = str(e)
    choice = dist_env.broadcast_from_main(choice)
    if isinstance(choice, str):  # (on SLURM and Spark: there the driver could not check before the ranks)
        line = (
            f"trainer.memory_check: {asked} finds no strategy under which the model's state fits: even the most "
            f"sharded, {plans[-1]}, {choice}; use more ranks or nodes, or strategy=fsdp strategy.cpu_offload=true"
        )
        if memory_check == MemoryCheck.refuse:
            raise UserError(line)
        _say(env, f"warning: {line}; running it (trainer.memory_check=warn)")
        choice = choose(plans, layout, links, model, {}, dist.get_backend())
        choice = Choice(plans[-1], choice.predicted_s)
    _say(env, f"{asked}: measured {links.describe()} in {probe_s:.2g} s; chose {choice.plan}: {choice.describe()}")
    record.update(
        plan=str(choice.plan),
        overrides=choice.plan.overrides(),
        predicted_s=choice.predicted_s,
        refused=choice.refused,
    )
    return config_for(choice.plan, cfg), record


def _model_figures(
    build: Callable[[], nn.Module], optimizer_factory: OptimizerFactory | None, cfg: Any
) -> tuple[Model, Estimate]:
    """The model's bytes and sharded units, from the model built on the meta device (nothing
    allocated, nothing drawn from the run's random streams)."""
    from dtf.models.blocks import find_blocks

    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = build()
    except Exception as e:
        raise UserError(
            f"{requested(cfg)} chooses by the model's size, and the model cannot be built on the meta device "
            f"({type(e).__name__}: {e}): name a strategy (strategy=ddp, zero, fsdp or mics with "
            "strategy.partition_group_size=G)"
        ) from None
    found = estimate(model, optimizer_factory, WHOLE_REPLICA)
    units = len(find_blocks(model, list(cfg.block_classes) if cfg.block_classes else None)) + 1
    return Model(found.param_bytes, found.grad_bytes, units), found


# The share of the free memory a chosen plan's model state may take: the memory check's estimate
# is a lower bound (activations, buffers and the framework come on top), so a plan that would
# fill the memory with state alone is passed over for one that leaves room, where there is one.
ROOM_FOR_STATE = 0.5


def _verdicts(
    plans: list[Plan], cfg: Any, found: Estimate, env: dist_env.DistEnv, mode: MemoryCheck, precision: str
) -> dict[str, str | None]:
    """Each plan's memory verdict on this node, joined over the nodes (a plan that does not fit on
    one does not fit): with room to spare where some plan leaves it, else as the memory check
    judges. Collective."""
    from dtf import strategy as strategies

    mine: dict[str, tuple[str | None, str | None]] = {}
    if mode != MemoryCheck.off:
        node = Node(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), env.device)
        for plan in plans:
            shares = strategies.build(config_for(plan, cfg), precision).state_shares(env.world_size)
            estimate = dataclasses.replace(found, shares=shares)
            mine[str(plan)] = (shortfall(estimate, node, ROOM_FOR_STATE), shortfall(estimate, node))
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    roomy: dict[str, str | None] = {}
    tight: dict[str, str | None] = {}
    for verdicts in everyone:
        for name, (with_room, at_all) in verdicts.items():
            roomy[name] = roomy.get(name) or with_room
            tight[name] = tight.get(name) or at_all
    return roomy if any(roomy.get(str(p)) is None for p in plans) else tight


def _say(env: dist_env.DistEnv, line: str) -> None:
    if env.is_main:
        print(f"dtf: {line}", flush=True)
