"""Which rows each rank reads in an epoch, computed from row-group sizes alone.

Petastorm shards by whole row groups, so skewed row groups give ranks different numbers
of batches and DDP hangs. Here every rank computes the same plan from the Parquet
metadata: a seeded order of the row groups (and of the rows inside each), cut into
C canonical partitions, contiguous shares of the global row sequence whose sizes differ by
at most one row (a row group may be split between partitions). Each partition is then
trimmed to, or padded up to, the same whole number of steps of b = G / C rows (G: the global
batch). Every step takes b rows from every partition; rank r of N owns the partitions
[r C / N, (r + 1) C / N) and its batch is their b-row pieces, concatenated. So the rows of a
global step depend on (row-group sizes, seed, epoch, C, G) and never on N: 1, 2, 3, 4, 6 or 12
ranks at one G with C = 12 train on the same batches (MosaicML Streaming's canonical nodes).
A run resumed mid-epoch reads exactly the rows an uninterrupted run would have read, on any
world size that divides C.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dtf.errors import UserError


@dataclass(frozen=True)
class Segment:
    """Rows of one row group, by their index inside it, in the order they are used."""

    piece: int
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class Span:
    """Positions [start, stop) of one row group's rows in their epoch order (a RowOrder): a
    Segment whose rows are not computed (the reader's workers permute the row groups they read)."""

    piece: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class RowOrder:
    """The order of every row group's rows in one epoch: seeded per row group, or as stored."""

    seed: int = 0
    epoch: int = 0
    shuffle: bool = False

    def of(self, piece: int, num_rows: int) -> np.ndarray:
        return rows_of_piece(num_rows, piece, self.seed, self.epoch, self.shuffle)


STORED = RowOrder()


@dataclass(frozen=True)
class Stream:
    """Rows in the order they are used, as arrays: the row group of each (pieces) and its position
    in that row group's epoch order (positions; its index in the row group: rows)."""

    pieces: np.ndarray
    positions: np.ndarray
    order: RowOrder = STORED
    piece_rows: Sequence[int] = ()  # row-group sizes, for rows (needed where order shuffles)

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, span: slice) -> Stream:
        return Stream(self.pieces[span], self.positions[span], self.order, self.piece_rows)

    @property
    def rows(self) -> np.ndarray:
        """Each row's index in its row group (computes the permutations: the reader does not need them)."""
        if not self.order.shuffle:
            return self.positions
        out = np.empty_like(self.positions)
        for piece in np.unique(self.pieces).tolist():
            at = self.pieces == piece
            out[at] = self.order.of(piece, int(self.piece_rows[piece]))[self.positions[at]]
        return out


def stream_of(segments: Sequence[Segment]) -> Stream:
    """The rows of segments, one after the other (as stored: positions are the rows)."""
    if not segments:
        return Stream(np.empty(0, np.int64), np.empty(0, np.int64))
    pieces = np.repeat(np.asarray([s.piece for s in segments], np.int64), [len(s) for s in segments])
    return Stream(pieces, np.concatenate([s.rows for s in segments]).astype(np.int64, copy=False))


def stream_of_spans(spans: Sequence[Span], order: RowOrder, piece_rows: Sequence[int]) -> Stream:
    """The rows of spans, one after the other, in their row groups' order."""
    lengths = np.asarray([len(s) for s in spans], np.int64)
    pieces = np.repeat(np.asarray([s.piece for s in spans], np.int64), lengths)
    # position i of the stream is span k's start + (i - the stream position span k begins at)
    offsets = np.asarray([s.start for s in spans], np.int64) - (np.cumsum(lengths) - lengths)
    positions = np.arange(len(pieces), dtype=np.int64) + np.repeat(offsets, lengths)
    return Stream(pieces, positions, order, piece_rows)


def batches_per_rank(num_rows: int, world_size: int, batch_size: int, pad: bool) -> int:
    """Full batches every rank yields per epoch: the remainder is dropped, or padded up to one more batch."""
    per_step = world_size * batch_size
    return math.ceil(num_rows / per_step) if pad else num_rows // per_step


def remainder_rows(num_rows: int, world_size: int, batch_size: int, pad: bool) -> int:
    """Rows dropped (pad=False) or repeated (pad=True) per epoch, over all ranks."""
    used = batches_per_rank(num_rows, world_size, batch_size, pad) * world_size * batch_size
    return used - num_rows if pad else num_rows - used


def _rng(seed: int, *keys: int) -> np.random.Generator:
    # SeedSequence wants non-negative entropy; a negative trainer.seed still maps to a fixed stream.
    return np.random.default_rng([seed % 2**63, *keys])


def piece_order(num_pieces: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    return _rng(seed, epoch, 0).permutation(num_pieces) if shuffle else np.arange(num_pieces)


def rows_of_piece(num_rows: int, piece: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order of one row group's rows in an epoch (its own stream, so a rank computes only what it reads)."""
    return _rng(seed, epoch, 1, piece).permutation(num_rows) if shuffle else np.arange(num_rows)


@dataclass(frozen=True)
class EpochOrder:
    """The global row sequence of one epoch: row groups in a (seeded) order, rows in a (seeded) order."""

    piece_rows: Sequence[int]
    seed: int = 0
    epoch: int = 0
    shuffle_row_groups: bool = False
    shuffle_rows: bool = False

    @property
    def num_rows(self) -> int:
        return int(sum(self.piece_rows))

    @property
    def row_order(self) -> RowOrder:
        return RowOrder(self.seed, self.epoch, self.shuffle_rows)

    def spans(self, start: int, stop: int) -> list[Span]:
        """The rows at global positions [start, stop) of the sequence, one span per row group.

        Row groups without rows (an empty file is one) hold no position and get no span:
        Petastorm's workers publish nothing for them, so a reader waiting for one would wait in vain.
        """
        order = piece_order(len(self.piece_rows), self.seed, self.epoch, self.shuffle_row_groups)
        sizes = np.asarray(self.piece_rows, dtype=np.int64)[order]
        ends = np.cumsum(sizes)
        out: list[Span] = []
        k = int(np.searchsorted(ends, start, side="right"))  # the first row group that holds position start
        while start < stop and k < len(order):
            if sizes[k] == 0:
                k += 1
                continue
            begin = int(ends[k] - sizes[k])
            lo, hi = start - begin, min(stop, int(ends[k])) - begin
            out.append(Span(int(order[k]), lo, hi))
            start = begin + hi
            k += 1
        return out

    def segment(self, span: Span) -> Segment:
        """A span's rows: their indices in the row group."""
        perm = self.row_order.of(span.piece, int(self.piece_rows[span.piece]))
        return Segment(span.piece, perm[span.start : span.stop])

    def segments(self, start: int, stop: int) -> list[Segment]:
        """The rows at global positions [start, stop) of the sequence, one segment per row group (see spans)."""
        return [self.segment(s) for s in self.spans(start, stop)]


def share_bounds(num_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous share of num_rows positions; shares differ in size by at most one row."""
    return rank * num_rows // world_size, (rank + 1) * num_rows // world_size


def train_spans(order: EpochOrder, world_size: int, rank: int, batch_size: int, pad: bool) -> list[Span]:
    """This rank's rows of the epoch: exactly batches_per_rank(...) * batch_size of them."""
    num_rows = order.num_rows
    target = batches_per_rank(num_rows, world_size, batch_size, pad) * batch_size
    start, stop = share_bounds(num_rows, world_size, rank)
    if target <= stop - start:
        return order.spans(start, start + target)
    # Padding repeats the share's own first rows; with at least one batch per rank a share
    # holds at least batch_size rows and the padding is at most one batch, so it suffices.
    missing = target - (stop - start)
    assert missing <= stop - start, "padding needs at least world_size * batch_size rows"
    return order.spans(start, stop) + order.spans(start, start + missing)


def train_share(order: EpochOrder, world_size: int, rank: int, batch_size: int, pad: bool) -> list[Segment]:
    """train_spans' rows, as segments."""
    return [order.segment(s) for s in train_spans(order, world_size, rank, batch_size, pad)]


# auto partitions: a divisor of the global batch that every world size dividing 24 (1, 2, 3, 4,
# 6, 8, 12, 24) also divides, where the global batch allows it.
AUTO_PARTITIONS_BASE = 24


def auto_partitions(global_batch: int, world_size: int) -> int:
    """data.canonical_partitions=auto on a fresh run: gcd(G, lcm(N, 24)).

    It divides G (whole steps from every partition), the world size divides it (N divides G and
    lcm(N, 24)), and so does every other world size that divides both G and 24: a resume on
    those at the same G continues the same sequence. (gcd(G, 24) alone would refuse a fresh run
    on, say, 5 ranks.)"""
    return math.gcd(global_batch, math.lcm(world_size, AUTO_PARTITIONS_BASE))


def partitions_problem(num_partitions: int, world_size: int, global_batch: int) -> str | None:
    """Why C partitions cannot feed N ranks at a global batch G (None: they can)."""
    if num_partitions % world_size:
        return f"the world size {world_size} does not divide data.canonical_partitions={num_partitions}"
    if global_batch % num_partitions:
        return (
            f"data.canonical_partitions={num_partitions} does not divide the global batch "
            f"{global_batch} (world size x data.batch_size)"
        )
    return None


def world_sizes_for(num_partitions: int, global_batch: int) -> list[int]:
    """The world sizes that C partitions can feed at one global batch: the divisors of C."""
    return [n for n in range(1, num_partitions + 1) if num_partitions % n == 0 and global_batch % n == 0]


def choose_partitions(setting: int | str, recorded: int | None, world_size: int, batch_size: int) -> int:
    """data.canonical_partitions: a number as given; auto: the checkpoint's (a resumed run keeps
    its sequence), else auto_partitions(G, N). UserError when the world size or G does not fit it."""
    global_batch = world_size * batch_size
    if setting != "auto":
        chosen, why = int(setting), f"data.canonical_partitions={setting}"
    elif recorded is not None:
        chosen, why = recorded, f"the run's checkpoint recorded data.canonical_partitions={recorded}"
    else:
        return auto_partitions(global_batch, world_size)
    problem = partitions_problem(chosen, world_size, global_batch)
    if problem is None:
        return chosen
    sizes = ", ".join(map(str, world_sizes_for(chosen, chosen)))
    fits = f"a world size that divides {chosen} ({sizes}) and a global batch that {chosen} divides"
    if setting == "auto":
        raise UserError(f"{problem} ({why}): resume on {fits}, or start afresh with checkpoint.resume=never")
    raise UserError(f"{problem}: use {fits}, or data.canonical_partitions=auto")


@dataclass(frozen=True)
class Partitions:
    """One epoch cut into num_partitions canonical partitions, each the same number of steps long."""

    order: EpochOrder
    num_partitions: int
    rows_per_step: int  # b = G / C: the rows every step takes from every partition
    pad: bool

    @property
    def num_steps(self) -> int:
        """Steps per epoch: the even-batch rule between ranks of today, applied to partitions."""
        return batches_per_rank(self.order.num_rows, self.num_partitions, self.rows_per_step, self.pad)

    @property
    def rows_per_partition(self) -> int:
        return self.num_steps * self.rows_per_step

    def rows(self, partition: int) -> list[Segment]:
        """The partition's rows of the epoch: its share, cut to or padded up (with its own first
        rows) to rows_per_partition."""
        return train_share(self.order, self.num_partitions, partition, self.rows_per_step, self.pad)

    def spans(self, partition: int) -> list[Span]:
        """rows(partition), as spans."""
        return train_spans(self.order, self.num_partitions, partition, self.rows_per_step, self.pad)

    def owned(self, world_size: int, rank: int) -> range:
        per_rank = self.num_partitions // world_size
        return range(rank * per_rank, (rank + 1) * per_rank)

    def rank_streams(self, world_size: int, rank: int, start_row: int = 0) -> list[Stream]:
        """This rank's partitions from start_row on, cut to whole steps: step t takes rows
        [t b, (t + 1) b) of each: the rows the reader reads, as arrays."""
        steps = max(0, self.rows_per_partition - start_row) // self.rows_per_step
        stop = start_row + steps * self.rows_per_step
        order, sizes = self.order.row_order, self.order.piece_rows
        return [stream_of_spans(self.spans(c), order, sizes)[start_row:stop] for c in self.owned(world_size, rank)]


def eval_share(piece_rows: Sequence[int], world_size: int, rank: int) -> tuple[list[Segment], int]:
    """(segments, number of real rows) of this rank's test rows, in stored order.

    Every rank gets ceil(N / world_size) rows so all run the same number of forwards; the
    real rows come first, then at most one padding row (the share's first row, or row 0 of
    the data set for a rank without rows) that the evaluation weighs zero.
    """
    order = EpochOrder(piece_rows)
    num_rows = order.num_rows
    start, stop = share_bounds(num_rows, world_size, rank)
    length = math.ceil(num_rows / world_size)
    segments = order.segments(start, stop)
    if stop - start < length:
        filler = start if stop > start else 0
        segments += order.segments(filler, filler + length - (stop - start))
    return segments, stop - start
