"""Training functions (trainer=function) that return what users' functions return: a dict of
metrics named as the user likes, or a mean of batch means that dtf.report makes exact."""

import torch

import dtf


def accuracy(module, hparams, train_set, test_set):  # type: ignore[no-untyped-def]
    """{"accuracy": ...}: the share of test points the untrained model predicts within 1.0."""
    model = module(**hparams)
    model.eval()
    x, y = test_set[:]
    with torch.no_grad():
        hits = ((model(x) - y).abs() < 1.0).float()
    return {"accuracy": hits.mean().item()}


def mean_of_batch_means(module, hparams, train_set, test_set):  # type: ignore[no-untyped-def]
    """Maggy's way: test_loss / len(test_loader), a mean of batch means; and the exact mean
    reported beside it with dtf.report(name, total, count)."""
    model = module()
    model.eval()
    loader = torch.utils.data.DataLoader(test_set, batch_size=hparams.get("eval_batch", 64))
    batch_means, total, count = 0.0, 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum").item()
            batch_means += loss / len(x)
            total += loss
            count += len(x)
    dtf.report("exact_loss", total, count)
    return {"loss": batch_means / len(loader)}


class Indexed(torch.utils.data.Dataset):
    """Sample i is (i, 0): which samples a rank trained on can be read off its batches."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        return torch.tensor([float(i)]), torch.tensor([0.0])


class RankSampler(torch.utils.data.Sampler):
    """A sampler of the user's own that shards by rank (not a DistributedSampler)."""

    def __init__(self, n: int, num_replicas: int, rank: int) -> None:
        self.n, self.num_replicas, self.rank = n, num_replicas, rank

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.rank, self.n, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.num_replicas))


def indices_seen(module, hparams, train_set, test_set):  # type: ignore[no-untyped-def]
    """The training samples one epoch of this rank visits, with the user's own sampler (a
    DistributedSampler, or RankSampler) or none; into hparams["sink"]."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    sampler = {
        "distributed": lambda: torch.utils.data.DistributedSampler(train_set, shuffle=False),
        "own": lambda: RankSampler(len(train_set), world, rank),
        "none": lambda: None,
    }[hparams["sampler"]]()
    loader = torch.utils.data.DataLoader(train_set, batch_size=8, sampler=sampler)
    seen = [int(x) for xb, _ in loader for x in xb.flatten()]
    hparams["sink"].extend(seen)
    return {"seen": float(len(seen))}


def mean_ids(module, hparams, train_set, test_set, val_set):  # type: ignore[no-untyped-def]
    """For a data set whose targets are the samples' ids: the mean id of this rank's validation
    and test shares (val/ first: averaged over the validation samples)."""
    module()  # the function builds its model, as any does
    val_ids = torch.stack([torch.as_tensor(val_set[i][1]) for i in range(len(val_set))]).double()
    test_ids = torch.stack([torch.as_tensor(test_set[i][1]) for i in range(len(test_set))]).double()
    return {"val/mean_id": val_ids.mean().item(), "mean_id": test_ids.mean().item()}


def reads_its_datasets_attributes(module, hparams, train_set, test_set):  # type: ignore[no-untyped-def]
    """Code written for the whole TensorDataset: reads .tensors (and a torchvision-style .classes
    where the dataset has one); len() and indexing are this rank's share."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x = train_set.tensors[0]  # the whole training set, as the user built it
    if not torch.equal(train_set[1][0], x[rank + world]):  # the share: samples rank, rank + world, ...
        raise AssertionError("indexing is not this rank's share")
    if len(train_set) != len(x) // world:
        raise AssertionError(f"len {len(train_set)} is not this rank's share of {len(x)}")
    return {"train_rows": float(len(x)), "test_rows": float(len(test_set.tensors[0]))}
