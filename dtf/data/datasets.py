"""The built-in data sets. Each builder returns a (train, test) pair of map-style datasets,
generated from a seed so that every rank (and every test) sees the very same data."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset, TensorDataset

from dtf.errors import UserError

Splits = tuple[Dataset, Dataset]


def scalar_field(
    num_points: int = 10000, num_test: int = 2000, low: float = -5.0, high: float = 5.0, seed: int = 1234
) -> Splits:
    """Points uniform in [low, high]^2 with target z = sin(y) + cos(x) (Maggy's example)."""
    if not 0 < num_test < num_points:
        raise UserError(f"data.dataset.num_test={num_test} must be between 1 and num_points-1 ({num_points - 1})")
    g = torch.Generator().manual_seed(seed)
    xy = torch.empty(num_points, 2).uniform_(low, high, generator=g)
    z = (torch.sin(xy[:, 1]) + torch.cos(xy[:, 0])).unsqueeze(1)
    n_train = num_points - num_test
    return TensorDataset(xy[:n_train], z[:n_train]), TensorDataset(xy[n_train:], z[n_train:])


def digits(image_size: int = 28, margin: int = 4, test_fraction: float = 0.2, seed: int = 1234) -> Splits:
    """scikit-learn's 1,797 real 8x8 digits (offline), scaled to [0, 1], laid out like MNIST (the
    digit resized to fill the middle, `margin` blank pixels around it, 1 x image_size x image_size),
    normalised like MNIST, split train/test by a seeded permutation."""
    from sklearn.datasets import load_digits

    if not 0.0 < test_fraction < 1.0:
        raise UserError(f"data.dataset.test_fraction={test_fraction} must be in (0, 1)")
    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if not 0 <= 2 * margin < image_size:
        raise UserError(f"data.dataset.margin={margin} leaves no room in data.dataset.image_size={image_size}")
    inner = image_size - 2 * margin
    if inner != 8:
        images = torch.nn.functional.interpolate(images, size=(inner, inner), mode="bilinear")
    # MNIST's digits sit in a blank border: the CNN's unpadded 5x5 convolutions then see all of the digit.
    images = torch.nn.functional.pad(images, (margin, margin, margin, margin))
    images = (images - 0.1307) / 0.3081  # MNIST's normalisation, as in Horovod's example
    labels = torch.tensor(bunch.target, dtype=torch.long)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = max(1, round(len(labels) * test_fraction))
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[test_idx], labels[test_idx])


def fake_images(
    num_samples: int = 4096,
    num_test: int = 512,
    shape: Sequence[int] = (1, 28, 28),
    num_classes: int = 10,
    seed: int = 1234,
) -> Splits:
    """Random normal images with random labels, for throughput measurements."""
    g = torch.Generator().manual_seed(seed)
    total = num_samples + num_test
    x = torch.randn(total, *shape, generator=g)
    y = torch.randint(0, num_classes, (total,), generator=g)
    return TensorDataset(x[:num_samples], y[:num_samples]), TensorDataset(x[num_samples:], y[num_samples:])
