"""strategy=auto's arithmetic, in process: the bytes each plan sends (dtf.strategy.traffic) against
the ring algorithms' closed forms, and the chooser (dtf.strategy.choose) on the cases that matter.
The probe and a run that chooses are tested across namespace hosts (tests/e2e/test_multinode.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtf.config.schema import AutoStrategyConfig, MicsStrategyConfig
from dtf.dist.topology import Layout, Links
from dtf.strategy.auto import candidates, config_for
from dtf.strategy.choose import Model, NothingFits, choose
from dtf.strategy.traffic import Plan, per_step, plans
from tests.helpers.inprocess import train_in_process

M = 8e6  # bytes of parameters (and of gradients)
MODEL = Model(M, M, units=9)
SLOW_ACROSS = Links(across_bytes_per_s=1.25e6, inside_bytes_per_s=1e9, across_latency_s=1e-3, inside_latency_s=1e-4)
EQUAL = Links(across_bytes_per_s=1e9, inside_bytes_per_s=1e9, across_latency_s=1e-4, inside_latency_s=1e-4)


@pytest.mark.parametrize(
    ("plan", "across", "inside"),
    [
        # 2 hosts x 2 ranks; a ring over n ranks sends 2(n-1)/n of an all-reduce's bytes, (n-1)/n of
        # an all-gather's, from each rank; a ring of all 4 ranks leaves each host once.
        (Plan("ddp", 1), 2 * 3 / 4 * M, 2 * 3 / 4 * M),
        (Plan("zero1", 1), (2 * 3 / 4 + 3 / 4) * M, (2 * 3 / 4 + 3 / 4) * M),
        (Plan("zero2", 4), (3 / 4 + 2 * 3 / 4) * M, (3 / 4 + 2 * 3 / 4) * M),  # gloo's reduce-scatter: an all-reduce
        (Plan("fsdp", 4), (2 * 3 / 4 + 2 * 3 / 4) * M, (2 * 3 / 4 + 2 * 3 / 4) * M),
        # G=2: the groups are the hosts; across, each host's 2 ranks all-reduce their half with
        # the other host's: 2 x (2 x 1/2 x M/2)
        (Plan("mics", 2), 2 * (2 * 1 / 2 * M / 2), (1 / 2 + 1 / 2 + 2 * 1 / 2) * M),
        (Plan("mics", 1), 2 * 3 / 4 * M, 2 * 3 / 4 * M),
        # strategy.cross_group_dtype=bfloat16: the fp32 gradients cross in half their bytes
        (Plan("mics", 2, "bfloat16"), 2 * (2 * 1 / 2 * M / 4), (1 / 2 + 1 / 2 + 2 * 1 / 2) * M),
    ],
)
def test_the_bytes_of_each_plan_are_the_rings_closed_forms(plan: Plan, across: float, inside: float) -> None:
    t = per_step(plan, Layout(2, 2), M, M, units=9)
    assert t.across_per_host == pytest.approx(across)
    assert t.inside_per_rank == pytest.approx(inside)


@pytest.mark.parametrize(
    ("plan", "across", "inside"),
    [
        # the ring hops the step waits for, 9 units, 2 hosts x 2 ranks: an all-gather over n ranks
        # takes n-1 hops, an all-reduce 2 (n-1); the gradients' all-reduces overlap the backward,
        # FSDP's all-gathers are prefetched and its reduce-scatters end beside the backward, zero 1's
        # all-gathers of the updated parameters run beside the next forward
        (Plan("ddp", 1), 0, 0),
        (Plan("zero1", 1), 0, 0),
        (Plan("fsdp", 4), 0, 0),
        (Plan("mics", 4), 0, 0),
        (Plan("mics", 2), 0, 9 * 2),  # its reduce-scatters inside, each an all-reduce on gloo
        (Plan("mics", 1), 0, 0),
    ],
)
def test_the_hops_each_plan_waits_for(plan: Plan, across: int, inside: int) -> None:
    t = per_step(plan, Layout(2, 2), M, M, units=9)
    assert (t.hops_across, t.hops_inside) == (across, inside)
    assert per_step(plan, Layout(2, 2), M, M, units=9, backend="nccl").hops_inside == 0  # on CUDA streams


def test_nccl_reduce_scatters_in_a_ring_and_one_host_sends_nothing_across() -> None:
    assert per_step(Plan("fsdp", 4), Layout(2, 2), M, M, backend="nccl").across_per_host == pytest.approx(3 * 3 / 4 * M)
    one_host = per_step(Plan("fsdp", 4), Layout(1, 4), M, M)
    assert one_host.across_per_host == 0 and one_host.hops_across == 0


def test_every_plan_of_a_world_of_six() -> None:
    assert [str(p) for p in plans(6)] == [
        "ddp",
        "zero stage 1",
        "zero stage 2",
        "zero stage 3",
        "fsdp",
        "mics G=1",
        "mics G=2",
        "mics G=3",
        "mics G=6",
    ]


def _auto(world: int, links: Links, layout: Layout, verdicts: dict[str, str | None] | None = None) -> str:
    return str(choose(candidates(AutoStrategyConfig(), world), layout, links, MODEL, verdicts or {}).plan)


def _mics(world: int, links: Links, layout: Layout, verdicts: dict[str, str | None] | None = None) -> str:
    return str(choose(candidates(MicsStrategyConfig(), world), layout, links, MODEL, verdicts or {}).plan)


def test_one_host_needs_no_sharding_for_speed() -> None:
    inside_only = Links(None, 1e9, 0.0, 1e-4)
    assert _auto(4, inside_only, Layout(1, 4)) == "ddp"
    assert _mics(4, inside_only, Layout(1, 4)) == "mics G=1"


def test_slow_links_across_hosts_shard_inside_each_host() -> None:
    assert _auto(4, SLOW_ACROSS, Layout(2, 2)) == "mics G=2"
    assert _mics(4, SLOW_ACROSS, Layout(2, 2)) == "mics G=2"
    assert _mics(8, SLOW_ACROSS, Layout(2, 4)) == "mics G=4"  # the ranks of one host, not the most shards


# deep_mlp (2.11 MB, 8 blocks + the root) on 2 namespace hosts x 2 ranks, and what the probe
# measured there (2026-11-29): at 1 Gbit/s mics G=1 stepped in 70 ms and G=2 in 112 ms (its 36
# hops inside, each waiting on ranks that share 2 cores), at 100 Mbit/s G=2 in 227 ms and G=1 in 293.
DEEP_MLP = Model(2.11e6, 2.11e6, units=9)
AT_1GBIT = Links(across_bytes_per_s=124e6, inside_bytes_per_s=729e6, across_latency_s=0.92e-3, inside_latency_s=0.56e-3)
AT_100MBIT = Links(12.0e6, 612e6, across_latency_s=0.64e-3, inside_latency_s=0.62e-3)


@pytest.mark.parametrize(("links", "chosen"), [(AT_1GBIT, "mics G=1"), (AT_100MBIT, "mics G=2")])
def test_the_hops_inside_outweigh_the_bytes_saved_across_until_the_link_is_slow(links: Links, chosen: str) -> None:
    mics = candidates(MicsStrategyConfig(), 4)
    assert str(choose(mics, Layout(2, 2), links, DEEP_MLP, {}).plan) == chosen


def test_equal_links_keep_the_fewest_bytes() -> None:
    assert _auto(4, EQUAL, Layout(2, 2)) == "ddp"


def test_memory_that_only_full_sharding_fits() -> None:
    full_only = {name: "needs 9 GiB" for name in ("ddp", "zero stage 1", "zero stage 2", "mics G=1", "mics G=2")}
    assert _auto(4, SLOW_ACROSS, Layout(2, 2), full_only) == "fsdp"
    assert _mics(4, SLOW_ACROSS, Layout(2, 2), full_only) == "mics G=4"


def test_nothing_fits_says_why_for_the_most_sharded() -> None:
    everything = {str(p): f"{p} needs too much" for p in candidates(AutoStrategyConfig(), 4)}
    with pytest.raises(NothingFits, match="fsdp needs too much"):
        _auto(4, SLOW_ACROSS, Layout(2, 2), everything)


def test_a_world_that_g_cannot_divide_evenly() -> None:
    # 3 hosts x 2 ranks: G is 1, 2, 3 or 6 (never 4); the slow links choose the hosts' 2
    assert [str(p) for p in candidates(MicsStrategyConfig(), 6)] == ["mics G=1", "mics G=2", "mics G=3", "mics G=6"]
    assert _mics(6, SLOW_ACROSS, Layout(3, 2)) == "mics G=2"
    # 3 hosts x 1 rank: 1 or 3, and no group stays inside a host: the fewest bytes across
    assert [str(p) for p in candidates(MicsStrategyConfig(), 3)] == ["mics G=1", "mics G=3"]
    assert _mics(3, SLOW_ACROSS, Layout(3, 1)) == "mics G=1"


def test_the_chosen_plan_keeps_the_users_settings() -> None:
    cfg = config_for(Plan("mics", 2), AutoStrategyConfig(block_classes=["Linear"], meta_init=True))
    assert isinstance(cfg, MicsStrategyConfig)
    assert (cfg.partition_group_size, cfg.block_classes, cfg.meta_init) == (2, ["Linear"], True)
    kept = config_for(Plan("mics", 4), MicsStrategyConfig(cpu_offload=True))
    assert isinstance(kept, MicsStrategyConfig) and kept.partition_group_size == 4 and kept.cpu_offload
    narrow = MicsStrategyConfig(cross_group_dtype="bfloat16")
    # at G = 4 there is one group: nothing crosses, and the config says fp32 (bf16 there is refused by hand)
    assert [str(p) for p in candidates(narrow, 4)] == ["mics G=1 bf16", "mics G=2 bf16", "mics G=4"]
    assert config_for(candidates(narrow, 4)[1], narrow).cross_group_dtype == "bfloat16"
    assert config_for(candidates(narrow, 4)[2], narrow).cross_group_dtype == "float32"


@pytest.mark.parametrize(("strategy", "chosen"), [("strategy=auto", "ddp"), ("strategy=mics", "mics")])
def test_a_world_of_one_rank_has_nothing_to_choose_and_says_so(
    strategy: str, chosen: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = train_in_process([strategy, "trainer.max_steps=2", "model=deep_mlp", "model.depth=2"], tmp_path / "run")
    said = capsys.readouterr().out
    assert "a world of 1 rank has nothing to choose between" in said, said
    assert summary["strategy"] == chosen and summary["strategy_choice"]["why"] == "one rank"
    if chosen == "mics":
        assert summary["strategy_choice"]["plan"] == "mics G=1"
