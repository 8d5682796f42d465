"""The epoch plan of data=petastorm, checked against plain counting over explicit row ids."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from dtf.data.parquet.plan import (
    EpochOrder,
    Segment,
    batches_per_rank,
    eval_share,
    remainder_rows,
    share_bounds,
    skip_rows,
    train_share,
)

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
