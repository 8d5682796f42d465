from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.utils.data

from dtf.data.batch import batch_size_of, take_first
from dtf.data.datasets import digits, scalar_field
from dtf.data.samplers import EvalShardSampler
from dtf.train.metrics import MeanMetric
from tests.helpers.gloo import run_on_ranks


@pytest.mark.parametrize(("n", "world"), [(10, 3), (2000, 2), (7, 4), (2, 3), (1, 1)])
def test_eval_shards_count_every_sample_exactly_once(n: int, world: int) -> None:
    samplers = [EvalShardSampler(n, r, world) for r in range(world)]
    assert len({len(s) for s in samplers}) == 1  # same number of forwards on every rank
    assert len(samplers[0]) == math.ceil(n / world)
    for bs in (1, 2, 3, 64):
        real = []
        for s in samplers:
            idx = list(s)
            num_batches = math.ceil(len(idx) / bs)
            for j in range(num_batches):
                real += idx[j * bs : j * bs + s.num_real_in_batch(j, bs)]
        assert sorted(real) == list(range(n))


def test_take_first_and_batch_size_of_nested_batches() -> None:
    batch = {"x": torch.zeros(5, 2), "pair": (torch.ones(5), [torch.arange(5)])}
    cut = take_first(batch, 3)
    assert cut["x"].shape == (3, 2) and cut["pair"][0].shape == (3,) and cut["pair"][1][0].tolist() == [0, 1, 2]
    assert batch_size_of(batch) == 5 and batch_size_of((torch.zeros(4, 1), torch.zeros(4))) == 4


def test_scalar_field_is_the_promised_function_and_split() -> None:
    train, test = scalar_field()
    assert (len(train), len(test)) == (8000, 2000)
    xy, z = train[:]
    torch.testing.assert_close(z.squeeze(1), torch.sin(xy[:, 1]) + torch.cos(xy[:, 0]))
    assert xy.min() >= -5 and xy.max() <= 5
    again, _ = scalar_field()
    assert torch.equal(again[:][0], xy)  # seeded: every rank builds the same data


def test_digits_are_real_and_shaped_for_the_cnn() -> None:
    train, test = digits()
    assert len(train) + len(test) == 1797
    x, y = train[0]
    assert x.shape == (1, 28, 28) and 0 <= int(y) <= 9


def _metric_on_ranks(rank: int, world: int) -> None:
    metric = MeanMetric(torch.device("cpu"))
    # rank r sees r+1 samples of value r: the exact mean weights by count, not by rank
    metric.update(torch.tensor(float(rank)), rank + 1)
    expected = sum(r * (r + 1) for r in range(world)) / sum(r + 1 for r in range(world))
    assert metric.compute() == pytest.approx(expected)
    assert metric.local() == pytest.approx(rank)
    dist.barrier()


def test_mean_metric_is_exact_across_ranks() -> None:
    run_on_ranks(_metric_on_ranks, 3)


class _SignalsItselfOnce(torch.utils.data.TensorDataset):
    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        if i == 0:  # as SLURM's step-wide SIGUSR1 would reach a DataLoader worker
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().__getitem__(i)


_A_RANK_DIES_TAKING_A_BATCH = """
import os, socket, sys, threading, time
from multiprocessing import resource_sharer
from dtf.data.loader import start_worker

start_worker(0)
# A batch's tensors reach the rank as file descriptors served by the worker's resource sharer (torch's
# default sharing strategy). The rank connects, is killed (Ctrl-C) before it reads the challenge, and
# its socket closes with data unread: the serving thread sees the connection reset.
shared = resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))
address = shared._id[0]
rank = socket.socket(socket.AF_UNIX if isinstance(address, str) else socket.AF_INET)
rank.connect(address)
time.sleep(0.2)
rank.close()
time.sleep(0.2)
failing = threading.Thread(target=lambda: 1 / 0)  # any other error is still printed
failing.start()
failing.join()
print("served")
"""


def test_a_worker_prints_nothing_when_its_rank_dies_while_taking_a_batch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_A_RANK_DIES_TAKING_A_BATCH)], capture_output=True, text=True, timeout=60
    )
    assert done.stdout == "served\n", done.stderr
    assert "ConnectionResetError" not in done.stderr and "resource_sharer" not in done.stderr, done.stderr
    assert "ZeroDivisionError" in done.stderr


def test_dataloader_workers_survive_slurms_warning_signal() -> None:
    from dtf.data.loader import start_worker

    loader = torch.utils.data.DataLoader(
        _SignalsItselfOnce(torch.arange(8.0)), batch_size=2, num_workers=1, worker_init_fn=start_worker
    )
    assert [b[0].tolist() for b in loader] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
