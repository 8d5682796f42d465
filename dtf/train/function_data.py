"""The data a training function gets (trainer=function, dtf.run_function): each rank's share of
the training and test sets, and what happens when the function shards them again itself.

A function written for Horovod or DDP keeps its `DistributedSampler(train_set)`. Over dtf's share
it would shard the share: each rank would train on 1/N of its 1/N. So while the function runs, a
DistributedSampler (or a subclass) built over a share gets the whole set instead, and dtf says
so once: the data is sharded once, by the user's sampler. Any other sampler that shards by rank
(it has `num_replicas` and `rank`) cannot be handed the whole set safely: a DataLoader over a
share with one is refused, with the fix.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dtf.errors import UserError


class Shard(Dataset):
    """This rank's samples of a dataset: indices rank, rank + world, rank + 2 world, ...
    equal: the same number on every rank (the last len % world samples left out)."""

    def __init__(self, dataset: Dataset, rank: int, world_size: int, equal: bool, name: str) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        end = n - n % world_size if equal else n
        self.dataset, self.name = dataset, name
        self.indices: range = range(rank, end, world_size)
        self.whole = False
        self._sampler: DistributedSampler | None = None

    def unshard(self, sampler: DistributedSampler) -> None:
        """Gives the whole dataset to the user's sampler, which shards it itself."""
        self.whole = True
        self.indices = range(len(self.dataset))  # type: ignore[arg-type]
        self._sampler = sampler

    def used_on_this_rank(self) -> int:
        """How many samples the function sees on this rank: the weight of the value it returns."""
        return int(self._sampler.num_samples) if self._sampler is not None else len(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.indices[i]]

    def __getattr__(self, name: str) -> Any:
        """The user's dataset's own attributes (a TensorDataset's tensors, torchvision's classes and
        targets), as they are on the whole dataset: code written for it reads them unchanged; only
        len() and indexing give this rank's share. (Called for what the share itself lacks.)"""
        if name.startswith("__") or name in ("dataset", "indices", "whole", "name", "_sampler"):
            raise AttributeError(name)  # not set yet (while unpickled in a DataLoader worker)
        return getattr(self.dataset, name)


@contextlib.contextmanager
def watching_samplers(shards: list[Shard], is_main: bool) -> Iterator[None]:
    """While the function runs: its DistributedSamplers over a share get the whole set, and a
    DataLoader over a share with another rank-sharding sampler is refused (see the module doc)."""
    original_sampler_init = DistributedSampler.__init__
    original_loader_init = DataLoader.__init__
    said: list[str] = []

    @functools.wraps(original_sampler_init)
    def sampler_init(self: DistributedSampler, dataset: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(dataset, Shard) and dataset in shards and not dataset.whole:
            dataset.unshard(self)
            if is_main and not said:
                print(
                    f"dtf: your {type(self).__name__} shards {dataset.name} by rank: dtf gives it the whole "
                    f"{dataset.name} (not this rank's share), so the data is sharded once, by your sampler",
                    flush=True,
                )
            said.append(dataset.name)
        original_sampler_init(self, dataset, *args, **kwargs)

    @functools.wraps(original_loader_init)
    def loader_init(self: DataLoader, dataset: Any, *args: Any, **kwargs: Any) -> None:
        given = inspect.signature(original_loader_init).bind_partial(self, dataset, *args, **kwargs).arguments
        sampler = given.get("sampler") or getattr(given.get("batch_sampler"), "sampler", None)
        if isinstance(dataset, Shard) and not dataset.whole and _shards_by_rank(sampler):
            raise UserError(
                f"trainer.fn: your DataLoader over {dataset.name} has a {type(sampler).__name__}, which shards by "
                f"rank, but {dataset.name} is this rank's share already: drop the sampler, or use torch's "
                "DistributedSampler (dtf then gives it the whole set)"
            )
        original_loader_init(self, dataset, *args, **kwargs)

    DistributedSampler.__init__ = sampler_init  # type: ignore[method-assign]
    DataLoader.__init__ = loader_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DistributedSampler.__init__ = original_sampler_init  # type: ignore[method-assign]
        DataLoader.__init__ = original_loader_init  # type: ignore[method-assign]


def _shards_by_rank(sampler: Any) -> bool:
    replicas = getattr(sampler, "num_replicas", None)
    return isinstance(replicas, int) and replicas > 1 and isinstance(getattr(sampler, "rank", None), int)
