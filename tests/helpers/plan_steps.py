"""The canonical partitions' steps as segment lists, walked one segment at a time: the tests'
independent account of which rows a rank's step takes, to check the reader's array-based one
(Partitions.rank_streams) and the rows a run actually trained on against."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from dtf.data.parquet.plan import Partitions, Segment


def skip_rows(segments: list[Segment], num_skip: int) -> list[Segment]:
    """The segments without their first num_skip rows (a resume in the middle of an epoch)."""
    out = []
    for seg in segments:
        if num_skip >= len(seg):
            num_skip -= len(seg)
            continue
        out.append(Segment(seg.piece, seg.rows[num_skip:]) if num_skip else seg)
        num_skip = 0
    return out


def take_rows(segments: Sequence[Segment], size: int) -> Iterator[list[Segment]]:
    """Consecutive pieces of size rows each (the segments cut where needed); a short tail is left out."""
    piece: list[Segment] = []
    have = 0
    for seg in segments:
        i = 0
        while i < len(seg):
            take = min(size - have, len(seg) - i)
            piece.append(Segment(seg.piece, seg.rows[i : i + take]) if (i, take) != (0, len(seg)) else seg)
            have += take
            i += take
            if have == size:
                yield piece
                piece, have = [], 0


def rank_steps(plan: Partitions, world_size: int, rank: int, start_row: int = 0) -> list[list[list[Segment]]]:
    """This rank's steps from start_row of every partition on: per step, per owned partition,
    the segments of its b rows (a rank's batch is their concatenation, in this order)."""
    streams = [take_rows(skip_rows(plan.rows(c), start_row), plan.rows_per_step) for c in plan.owned(world_size, rank)]
    return [list(step) for step in zip(*streams, strict=True)]
