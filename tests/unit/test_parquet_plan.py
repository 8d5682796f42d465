"""The epoch plan of data=petastorm, checked against plain counting over explicit row ids."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from dtf.data.parquet.plan import (
    EpochOrder,
    Partitions,
    Segment,
    auto_partitions,
    batches_per_rank,
    eval_share,
    partitions_problem,
    remainder_rows,
    share_bounds,
    train_share,
    world_sizes_for,
)
from tests.helpers.plan_steps import rank_steps, skip_rows

SKEWED = [1000, 10, 10, 1]


def row_ids(segments: list[Segment], piece_rows: list[int]) -> list[int]:
    """Global row ids (row groups laid end to end in stored order) of the rows the segments name."""
    starts = np.concatenate([[0], np.cumsum(piece_rows)])
    return [int(starts[s.piece] + r) for s in segments for r in s.rows]


def shares(piece_rows: list[int], world: int, batch: int, pad: bool, epoch: int = 0, seed: int = 7) -> list[list[int]]:
    order = EpochOrder(piece_rows, seed, epoch, shuffle_row_groups=True, shuffle_rows=True)
    return [row_ids(train_share(order, world, r, batch, pad), piece_rows) for r in range(world)]


CASES = [
    (SKEWED, 2, 16),
    (SKEWED, 3, 16),
    (SKEWED, 3, 7),
    ([5000], 2, 64),  # one row group, two ranks: it is split between them
    ([1, 1, 1, 1, 1, 1], 3, 2),
    ([64, 0, 3, 0, 200], 4, 8),  # empty row groups are skipped
    ([33], 3, 11),  # exactly world x batch rows
]


@pytest.mark.parametrize(("piece_rows", "world", "batch"), CASES)
@pytest.mark.parametrize("pad", [False, True])
def test_every_rank_gets_the_same_whole_number_of_batches_from_the_promised_rows(
    piece_rows: list[int], world: int, batch: int, pad: bool
) -> None:
    n = sum(piece_rows)
    per_rank = shares(piece_rows, world, batch, pad)
    num_batches = batches_per_rank(n, world, batch, pad)
    assert num_batches == (math.ceil(n / (world * batch)) if pad else n // (world * batch)) >= 1
    assert [len(s) for s in per_rank] == [num_batches * batch] * world
    counts = Counter(i for s in per_rank for i in s)
    assert set(counts) <= set(range(n))
    if pad:
        assert set(counts) == set(range(n))  # nothing dropped
        assert sum(counts.values()) - n == remainder_rows(n, world, batch, pad=True) < world * batch
        for rank, s in enumerate(per_rank):  # a rank's padding repeats the first rows of its own share
            start, stop = share_bounds(n, world, rank)
            extra = len(s) - (stop - start)
            assert s[stop - start :] == s[: max(0, extra)]
    else:
        assert max(counts.values()) == 1  # nothing repeated
        assert n - len(counts) == remainder_rows(n, world, batch, pad=False) < world * batch


@pytest.mark.parametrize(("n", "world"), [(1021, 2), (1021, 3), (7, 4), (3, 5)])
def test_shares_before_trimming_differ_by_at_most_one_row(n: int, world: int) -> None:
    bounds = [share_bounds(n, world, r) for r in range(world)]
    sizes = [b - a for a, b in bounds]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))  # contiguous, in rank order


def test_skewed_row_groups_are_split_between_ranks_not_assigned_whole() -> None:
    order = EpochOrder(SKEWED, seed=0, epoch=0, shuffle_row_groups=False)
    pieces = [{s.piece for s in train_share(order, 2, r, 16, pad=False)} for r in range(2)]
    assert 0 in pieces[0] and 0 in pieces[1]  # the 1000-row group feeds both ranks


def test_shuffling_is_seeded_differs_by_epoch_and_reaches_rows_inside_row_groups() -> None:
    first = shares(SKEWED, 2, 16, pad=False, epoch=0)
    assert first == shares(SKEWED, 2, 16, pad=False, epoch=0)  # same seed and epoch: same rows, same order
    assert first != shares(SKEWED, 2, 16, pad=False, epoch=1)
    assert first != shares(SKEWED, 2, 16, pad=False, epoch=0, seed=8)
    # Rows inside the big row group are not read in stored order, and the row-group order changes too.
    big = next(s for s in train_share(EpochOrder(SKEWED, 0, 0, True, True), 1, 0, 16, False) if s.piece == 0)
    assert list(big.rows) != sorted(big.rows)
    orders = {tuple(dict.fromkeys(s.piece for s in EpochOrder(SKEWED, 0, e, True).segments(0, 1021))) for e in range(8)}
    assert len(orders) > 1


def test_no_shuffling_reads_rows_in_stored_order() -> None:
    order = EpochOrder(SKEWED, seed=3, epoch=5)
    assert row_ids(order.segments(0, 1021), SKEWED) == list(range(1021))


@pytest.mark.parametrize("start_batch", [0, 1, 17, 31])
def test_skipping_batches_leaves_exactly_the_rest_of_the_epoch(start_batch: int) -> None:
    share = train_share(EpochOrder(SKEWED, 1, 2, True, True), 2, 1, 16, pad=True)
    rest = skip_rows(share, start_batch * 16)
    assert row_ids(rest, SKEWED) == row_ids(share, SKEWED)[start_batch * 16 :]


@pytest.mark.parametrize(("piece_rows", "world"), [(SKEWED, 2), (SKEWED, 3), ([2], 3), ([0, 5, 0], 4), ([9], 1)])
def test_eval_shares_count_every_row_exactly_once(piece_rows: list[int], world: int) -> None:
    n = sum(piece_rows)
    real: list[int] = []
    lengths = set()
    for rank in range(world):
        segments, num_real = eval_share(piece_rows, world, rank)
        ids = row_ids(segments, piece_rows)
        lengths.add(len(ids))
        real += ids[:num_real]  # padding only ever follows the real rows
    assert lengths == {math.ceil(n / world)}
    assert sorted(real) == list(range(n))


@pytest.mark.parametrize("epoch", range(6))
def test_no_segment_names_an_empty_row_group(epoch: int) -> None:
    # Petastorm's workers publish nothing for a row group without rows: a segment for one would wait forever.
    piece_rows = [40, 0, 25, 0, 10, 0]
    order = EpochOrder(piece_rows, seed=1, epoch=epoch, shuffle_row_groups=True, shuffle_rows=True)
    for world in (1, 2, 3):
        for rank in range(world):
            for pad in (False, True):
                assert all(len(s) > 0 for s in train_share(order, world, rank, 4, pad))
        for rank in range(world):
            assert all(len(s) > 0 for s in eval_share(piece_rows, world, rank)[0])


# --- Canonical partitions: a global step's rows do not depend on the world size ------------------

C12 = 12
PARTITIONED = [300, 7, 50, 1, 0, 90, 33]  # skewed, an empty row group, 481 rows


def partitions(piece_rows: list[int], global_batch: int, pad: bool, epoch: int = 0, c: int = C12) -> Partitions:
    order = EpochOrder(piece_rows, seed=5, epoch=epoch, shuffle_row_groups=True, shuffle_rows=True)
    return Partitions(order, c, global_batch // c, pad)


def global_steps(plan: Partitions, world: int, piece_rows: list[int], start_row: int = 0) -> list[list[int]]:
    """Per step, the global batch as the ranks' batches laid end to end in rank order (row ids)."""
    per_rank = [rank_steps(plan, world, rank, start_row) for rank in range(world)]
    assert len({len(steps) for steps in per_rank}) == 1  # every rank takes the same number of steps
    out = []
    for t in range(len(per_rank[0])):
        batch: list[int] = []
        for rank in range(world):
            rows = [i for part in per_rank[rank][t] for i in row_ids(part, piece_rows)]
            assert len(rows) == plan.rows_per_step * C12 // world  # data.batch_size = G / N
            batch += rows
        out.append(batch)
    return out


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("global_batch", [12, 48, 96])
def test_every_world_size_dividing_c_trains_on_the_same_global_steps(pad: bool, global_batch: int) -> None:
    n = sum(PARTITIONED)
    for epoch in (0, 1):
        plan = partitions(PARTITIONED, global_batch, pad, epoch)
        reference = global_steps(plan, 1, PARTITIONED)
        assert len(reference) == batches_per_rank(n, 1, global_batch, pad) == plan.num_steps
        for world in (2, 3, 4, 6, 12):
            assert global_steps(plan, world, PARTITIONED) == reference, (world, epoch)
        # The step's rows: b rows from every partition (not a contiguous run of the epoch's sequence).
        assert reference[0] == [
            i for c in range(C12) for i in row_ids(plan.rows(c), PARTITIONED)[: global_batch // C12]
        ]


@pytest.mark.parametrize("pad", [False, True])
def test_partitions_are_cut_or_padded_to_one_length_and_drop_or_repeat_the_promised_rows(pad: bool) -> None:
    n, global_batch = sum(PARTITIONED), 48
    plan = partitions(PARTITIONED, global_batch, pad)
    b = global_batch // C12
    per_partition = [row_ids(plan.rows(c), PARTITIONED) for c in range(C12)]
    assert {len(p) for p in per_partition} == {plan.rows_per_partition}
    assert plan.rows_per_partition == batches_per_rank(n, C12, b, pad) * b
    bounds = [share_bounds(n, C12, c) for c in range(C12)]
    assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1
    counts = Counter(i for p in per_partition for i in p)
    if pad:
        assert set(counts) == set(range(n))
        # the same count as the even-batch plan between ranks gives: per rank, or per partition
        repeated = sum(counts.values()) - n
        assert repeated == remainder_rows(n, C12, b, pad=True) == remainder_rows(n, 4, global_batch // 4, pad=True)
        for c, p in enumerate(per_partition):  # a partition's padding repeats its own first rows
            lo, hi = bounds[c]
            assert p[hi - lo :] == p[: len(p) - (hi - lo)]
    else:
        assert max(counts.values()) == 1
        dropped = n - len(counts)
        assert dropped == remainder_rows(n, C12, b, pad=False) == remainder_rows(n, 4, global_batch // 4, pad=False)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 12])
@pytest.mark.parametrize("start_step", [0, 1, 3, 9])
def test_a_resume_at_a_step_reads_exactly_the_rest_of_the_epoch(world: int, start_step: int) -> None:
    plan = partitions(PARTITIONED, 48, pad=True)
    b = plan.rows_per_step
    whole = global_steps(plan, 1, PARTITIONED)
    assert global_steps(plan, world, PARTITIONED, start_row=start_step * b) == whole[start_step:]


def test_a_resume_at_another_global_batch_continues_every_partition_from_its_row() -> None:
    # 3 steps of G=48 on 2 ranks (12 rows of each partition used), resumed at G=24 on 4 ranks:
    # each partition goes on from its row 12, b=2 rows a step.
    before, after = partitions(PARTITIONED, 48, pad=False), partitions(PARTITIONED, 24, pad=False)
    used = 3 * before.rows_per_step
    rest = global_steps(after, 4, PARTITIONED, start_row=used)
    assert len(rest) == (after.rows_per_partition - used) // after.rows_per_step
    for c in range(C12):
        mine = [i for step in rest for i in step[c * 2 : c * 2 + 2]]
        whole = row_ids(after.rows(c), PARTITIONED)
        assert mine == whole[used : used + len(mine)]
        assert row_ids(before.rows(c), PARTITIONED)[:used] == whole[:used]  # the same partition sequence


def test_no_step_names_an_empty_row_group_and_ranks_read_only_their_partitions() -> None:
    piece_rows = [40, 0, 25, 0, 10, 0, 300]
    for epoch in range(4):
        plan = partitions(piece_rows, 24, pad=True, epoch=epoch)
        for world in (1, 2, 4):
            mine: list[set[int]] = []
            for rank in range(world):
                steps = rank_steps(plan, world, rank)
                assert all(len(s) > 0 for step in steps for part in step for s in part)
                mine.append({s.piece for step in steps for part in step for s in part})
                owned = {s.piece for c in plan.owned(world, rank) for s in plan.rows(c)}
                assert mine[-1] == owned


def test_auto_partitions_divide_the_global_batch_and_take_every_world_size_dividing_24() -> None:
    assert auto_partitions(64, 2) == 8 and auto_partitions(96, 4) == 24 and auto_partitions(16, 1) == 8
    assert auto_partitions(160, 5) == 40  # 5 ranks: divisible by 5, not refused
    for world in range(1, 13):
        for batch in (1, 3, 8, 32, 50):
            g = world * batch
            c = auto_partitions(g, world)
            assert partitions_problem(c, world, g) is None, (world, batch)
            assert all(
                partitions_problem(c, n, g) is None
                for n in (1, 2, 3, 4, 6, 8, 12)
                if g % n == 0 and 24 % n == 0 and c % n == 0
            )
    assert world_sizes_for(8, 64) == [1, 2, 4, 8]


def test_partitions_problem_names_both_numbers() -> None:
    assert partitions_problem(8, 3, 48) == "the world size 3 does not divide data.canonical_partitions=8"
    assert partitions_problem(12, 4, 40) == (
        "data.canonical_partitions=12 does not divide the global batch 40 (world size x data.batch_size)"
    )
    assert partitions_problem(12, 4, 48) is None


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("start_row", [0, 5, 16])
def test_the_streams_the_reader_reads_by_are_the_steps_laid_end_to_end(pad: bool, start_row: int) -> None:
    plan = partitions(PARTITIONED, 48, pad)
    for world in (1, 2, 3, 4, 6, 12):
        for rank in range(world):
            steps = rank_steps(plan, world, rank, start_row)
            streams = plan.rank_streams(world, rank, start_row)
            assert len(streams) == C12 // world
            for k, stream in enumerate(streams):
                assert len(stream) == len(steps) * plan.rows_per_step
                segments = [seg for step in steps for seg in step[k]]
                assert stream.pieces.tolist() == [seg.piece for seg in segments for _ in seg.rows]
                assert stream.rows.tolist() == [int(r) for seg in segments for r in seg.rows]
