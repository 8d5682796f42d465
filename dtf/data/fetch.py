"""data.fetch: how a DataLoader gets a batch out of a map-style dataset.

per_sample is torch's default: one __getitem__ per sample, then default_collate stacks them. For
tensors already in memory that dominates a small model's step (one indexing op and one stack per
sample). batched indexes each of a TensorDataset's tensors once with the batch's indices; the
sampler, and so the indices, are the same, and t[indices] holds exactly what stacking t[i] for
each i does: the same batches, bit for bit. A dataset with its own __getitems__ (which torch's
DataLoader calls with the batch's indices) is fetched by batch already.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler, Subset, TensorDataset, default_collate

from dtf.config.schema import Fetch
from dtf.errors import UserError


class TensorBatches(Dataset):
    """A TensorDataset (or a Subset of one) read a batch at a time: __getitems__ indexes each
    tensor once. Its batches come out whole: collate them with whole_batch."""

    def __init__(self, tensors: Sequence[torch.Tensor], rows: torch.Tensor | None = None) -> None:
        self.tensors = tuple(tensors)
        self.rows = rows  # a Subset's indices into the tensors, or None for all of them

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        row = int(self.rows[index]) if self.rows is not None else index
        return tuple(t[row] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> _Whole:
        rows = torch.as_tensor(indices, dtype=torch.long)
        if self.rows is not None:
            rows = self.rows[rows]
        # a list, as default_collate makes of a batch of tuples
        return _Whole([t[rows] for t in self.tensors])

    def batches(self, sampler: Sampler[int], batch_size: int, drop_last: bool) -> Iterator[list[torch.Tensor]]:
        """The batches a DataLoader over this dataset gives with this sampler (batch_size,
        drop_last), each indexed out of the tensors in one op per tensor: the same tensors, bit for bit."""
        order = torch.as_tensor(list(sampler), dtype=torch.long)
        rows = self.rows[order] if self.rows is not None else order
        stop = len(rows) - len(rows) % batch_size if drop_last else len(rows)
        for first in range(0, stop, batch_size):
            taken = rows[first : first + batch_size]
            yield [t[taken] for t in self.tensors]


class _Whole:
    """A batch already made (by TensorBatches.__getitems__), which collating leaves as it is."""

    def __init__(self, batch: list[torch.Tensor]) -> None:
        self.batch = batch


def whole_batch(data: Any) -> Any:
    """collate_fn beside TensorBatches: its batches as they are; anything else as torch collates it."""
    return data.batch if isinstance(data, _Whole) else default_collate(data)


def tensor_batches(dataset: Dataset) -> TensorBatches | None:
    """The dataset read by batch, where it is a TensorDataset or Subsets of one; else None."""
    if isinstance(dataset, TensorDataset):
        return TensorBatches(dataset.tensors)
    if isinstance(dataset, Subset):
        inner = tensor_batches(dataset.dataset)
        if inner is None:
            return None
        rows = torch.as_tensor(list(dataset.indices), dtype=torch.long)
        return TensorBatches(inner.tensors, rows if inner.rows is None else inner.rows[rows])
    return None


def fetching(dataset: Dataset, mode: Fetch) -> tuple[Dataset, Callable[[Any], Any] | None, bool]:
    """(the dataset to load from, its collate_fn (None: torch's default), whether it is fetched
    by batch) for data.fetch."""
    if mode == Fetch.per_sample:
        return dataset, None, False
    batches = tensor_batches(dataset)
    if batches is not None:
        return batches, whole_batch, True
    if callable(getattr(dataset, "__getitems__", None)):  # torch's DataLoader calls it with the batch
        return dataset, None, True
    if mode == Fetch.batched:
        raise UserError(
            f"data.fetch=batched: data.dataset (a {type(dataset).__name__}) cannot be indexed by a batch of "
            "indices; give it __getitems__(indices) returning the samples, or use data.fetch=auto"
        )
    return dataset, None, False
