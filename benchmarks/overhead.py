"""dtf's per-step overhead against a plain hand-written PyTorch DDP loop, measured in one run.

    .venv/bin/python benchmarks/overhead.py [--repeats 5] [--epochs 40] [--nproc 2] [--batch-size 32]
    .venv/bin/python benchmarks/overhead.py --batch-sizes 32,256,1024 --epochs 10   # the table
    .venv/bin/python benchmarks/overhead.py --baseline /tmp/old   # also against another checkout

With --baseline DIR (e.g. `git worktree add /tmp/old <commit>`), each repeat also runs that
checkout's dtf, in turn with the others, and the verdict adds the ratio this / baseline: a change's
cost, A/B in one run.

With --batch-sizes, the same comparison at each per-rank batch size, then a table of the ratios,
then a torch.profiler summary of the floor's step at each size (one process: where the compute
goes) and dtf's own cost per step (one process: dtf's loop against the floor's, and the time in
dtf's own functions). --own-time prints only the last, quickly.
The hand-written loop reads its batches as users write it: a DataLoader over the TensorDataset,
one __getitem__ per sample and a default_collate per batch; dtf by default fetches each batch
with one indexing op per tensor (data.fetch=auto), the same batches.

Both train the default job (scalar-field MLP, Adam, per-rank batch 32, linear LR scaling,
gloo on CPU) with the same seed, alternating raw, dtf, raw, dtf, ... so that machine load
hits both alike. Each run reports its median optimizer-step wall time (warm-up excluded) and
its training time per step (the mean: what throughput sees; evaluation and checkpoint saves
excluded on both sides). The verdict is the median over repeats of each pair's ratio dtf / raw
(target: <= 1.05), with the quartiles of those ratios: on a shared 2-core machine single runs of
the same program scatter by 20% or more, so a ratio means something only next to its spread and
over many pairs. The step times of 2 ranks on 2 cores are not one bell: most steps take about the
same, a long tail of steps waits for the peer, and the median can jump between runs; the mean
ratio is the steadier of the two.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import dtf_summary

HERE = Path(__file__).resolve().parent


def run_raw(tmp: Path, i: int, args: argparse.Namespace, floor: bool = False) -> dict:
    """The hand-written loop (a per-sample DataLoader, as users write it), or with floor=True the
    compute floor (the same batches cut out of the tensors by indexing: nothing but torch)."""
    out = tmp / f"{'floor' if floor else 'raw'}{i}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        str(HERE / "raw_ddp.py"),
        f"--epochs={args.epochs}",
        f"--batch-size={args.batch_size}",
        f"--out={out}",
        f"--device={args.device}",
        *(["--floor"] if floor else []),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        if out.exists() and "terminate called without an active exception" in done.stderr:
            # gloo can abort a rank as the group is torn down, after the loop wrote its result (seen
            # about once in 50 runs here, even after the barrier below): the figures stand.
            print(f"note: the {'floor' if floor else 'raw loop'} aborted at teardown after writing its result")
            return json.loads(out.read_text())
        sys.exit(f"the raw loop failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_dtf(tmp: Path, i: int, args: argparse.Namespace, checkout: Path | None = None) -> dict:
    overrides = [
        f"launcher.nproc={args.nproc}",
        f"trainer.max_epochs={args.epochs}",
        f"data.batch_size={args.batch_size}",
        "trainer.progress=off",
        f"trainer.device={args.device}",
    ]
    return dtf_summary(tmp / f"{'baseline' if checkout else 'dtf'}{i}", overrides, checkout)


def compare(args: argparse.Namespace) -> tuple[float, float, float]:
    """Alternating raw, floor and dtf runs; prints them; returns the medians of the paired ratios
    (step time dtf / raw, training time per step dtf / raw, step time dtf / floor)."""
    raw, floor, ours, base = [], [], [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i in range(args.repeats):
            raw.append(run_raw(tmp, i, args))
            floor.append(run_raw(tmp, i, args, floor=True))
            ours.append(run_dtf(tmp, i, args))
            if args.baseline:
                base.append(run_dtf(tmp, i, args, Path(args.baseline).resolve()))
            print(
                f"batch {args.batch_size}, repeat {i + 1}/{args.repeats}: raw {raw[-1]['step_time_s'] * 1e3:.3f} "
                f"ms/step, floor {floor[-1]['step_time_s'] * 1e3:.3f} ms/step, "
                f"dtf {ours[-1]['step_time_s'] * 1e3:.3f} ms/step"
                + (f", baseline {base[-1]['step_time_s'] * 1e3:.3f} ms/step" if base else ""),
                flush=True,
            )
    raw_med = statistics.median(r["step_time_s"] for r in raw)
    floor_med = statistics.median(r["step_time_s"] for r in floor)
    dtf_med = statistics.median(r["step_time_s"] for r in ours)
    ratios = sorted(o["step_time_s"] / r["step_time_s"] for r, o in zip(raw, ours, strict=True))
    floor_ratios = sorted(o["step_time_s"] / f["step_time_s"] for f, o in zip(floor, ours, strict=True))
    mean_ratios = sorted(
        (o["train_seconds"] / o["global_step"]) / (r["train_seconds"] / r["num_steps"])
        for r, o in zip(raw, ours, strict=True)
    )
    print()
    print(f"{'':24}{'raw DDP loop':>14}{'floor':>14}{'dtf':>14}")
    print(f"{'median step time (ms)':24}{raw_med * 1e3:>14.3f}{floor_med * 1e3:>14.3f}{dtf_med * 1e3:>14.3f}")
    losses = (raw[-1]["final_train_loss"], floor[-1]["final_train_loss"], ours[-1]["final_train_loss"])
    print(f"{'final train loss':24}" + "".join(f"{loss:>14.6g}" for loss in losses))
    print(f"paired ratios dtf / raw: {' '.join(f'{r:.3f}' for r in ratios)}")
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    print(
        f"ratio dtf / raw: median {statistics.median(ratios):.3f} (quartiles {q1:.3f}-{q3:.3f}), "
        f"ratio of medians {dtf_med / raw_med:.3f}   [{args.repeats} alternating repeats, {args.nproc} ranks, "
        f"{args.epochs} epochs each, batch {args.batch_size} per rank]"
    )
    m1, _, m3 = statistics.quantiles(mean_ratios, n=4) if len(mean_ratios) > 1 else (mean_ratios[0],) * 3
    print(
        f"ratio of training time per step (mean) dtf / raw: median {statistics.median(mean_ratios):.3f} "
        f"(quartiles {m1:.3f}-{m3:.3f})\n",
        flush=True,
    )
    f1, _, f3 = statistics.quantiles(floor_ratios, n=4) if len(floor_ratios) > 1 else (floor_ratios[0],) * 3
    print(
        f"ratio dtf / floor: median {statistics.median(floor_ratios):.3f} (quartiles {f1:.3f}-{f3:.3f}); "
        f"pairs {' '.join(f'{r:.3f}' for r in floor_ratios)}\n",
        flush=True,
    )
    if base:
        against_base(ours, base)
    return statistics.median(ratios), statistics.median(mean_ratios), statistics.median(floor_ratios)


def against_base(ours: list[dict], base: list[dict]) -> None:
    """This checkout against the baseline's, pair by pair: step time, time per step, final loss."""
    steps = sorted(o["step_time_s"] / b["step_time_s"] for o, b in zip(ours, base, strict=True))
    means = sorted(
        (o["train_seconds"] / o["global_step"]) / (b["train_seconds"] / b["global_step"])
        for o, b in zip(ours, base, strict=True)
    )
    same = all(o["params_sha256"] == b["params_sha256"] for o, b in zip(ours, base, strict=True))
    print(
        f"this / baseline: median step ratio {statistics.median(steps):.3f} "
        f"(pairs {' '.join(f'{r:.3f}' for r in steps)}), "
        f"training time per step {statistics.median(means):.3f}; the same parameters in every pair: {same}\n",
        flush=True,
    )


def profile_step(batch_size: int, steps: int = 30) -> None:
    """Where one step of dtf's loop goes, in one process: its batches as dtf fetches them
    (dtf.data.loader.from_datasets, data.fetch=auto), the default model, Adam, MSE."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from dtf.config.schema import LoaderDataConfig
    from dtf.data.datasets import scalar_field
    from dtf.data.loader import from_datasets
    from dtf.dist.env import DistEnv
    from dtf.models.approximator import Approximator

    torch.set_num_threads(1)
    train, _ = scalar_field()
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    data, _ = from_datasets(train, None, LoaderDataConfig(batch_size=batch_size), env, seed=0)
    model, loss_fn = Approximator(), torch.nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def endless() -> Iterator[Any]:
        for epoch in itertools.count():
            data.set_epoch(epoch)
            yield from data

    batches = endless()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("dtf: fetch the batch"):
                x, y = next(batches)
            with record_function("dtf: forward + loss"):
                loss = loss_fn(model(x), y)
            with record_function("dtf: backward"):
                opt.zero_grad(set_to_none=True)
                loss.backward()
            with record_function("dtf: optimizer step"):
                opt.step()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=32)
    print(f"torch.profiler, {steps} steps of batch {batch_size} in one process ({data.describe()}):\n{table}")


def dtf_own_time(batch_size: int, epochs: int = 3, repeats: int = 3) -> None:
    """dtf's own cost per step, in one process on a process group of one: its loop (the default
    job, no metrics, no logger) against the floor's (the same model, optimizer and batches cut out
    of the tensors, under DDP too), alternating, medians; then cProfile's time per step in dtf's
    own functions (cProfile inflates small functions: read it as where, not how much)."""
    import cProfile
    import pstats
    import time

    import torch

    sys.path.insert(0, str(HERE.parent))
    from dtf.data.datasets import scalar_field
    from dtf.models.approximator import Approximator
    from tests.helpers.inprocess import group_of_one, train_in_process

    torch.set_num_threads(1)
    overrides = [f"data.batch_size={batch_size}", f"trainer.max_epochs={epochs}", "logger=[]", "metrics=none"]

    def floor() -> float:
        torch.manual_seed(0)
        (x, y), _ = (t.tensors for t in scalar_field())
        model = torch.nn.parallel.DistributedDataParallel(Approximator())
        opt, loss_fn = torch.optim.Adam(model.parameters(), 1e-3), torch.nn.MSELoss()
        times, last = [], time.perf_counter()
        for epoch in range(epochs):
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
            for first in range(0, len(x), batch_size):
                rows = order[first : first + batch_size]
                loss = loss_fn(model(x[rows]), y[rows])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                now = time.perf_counter()
                times.append(now - last)
                last = now
        return statistics.median(times[5:])

    floors, ours = [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(repeats):
            with group_of_one():
                floors.append(floor())
            ours.append(train_in_process(overrides, Path(d) / f"run{i}")["step_time_s"])
        profiler = cProfile.Profile()
        profiler.enable()
        summary = train_in_process(overrides, Path(d) / "profiled")
        profiler.disable()
    per_step = 1e6 / summary["global_step"]
    print(
        f"in one process, batch {batch_size}: floor {statistics.median(floors) * 1e6:.0f} us/step, dtf "
        f"{statistics.median(ours) * 1e6:.0f} us/step (medians of {repeats}; dtf / floor "
        f"{statistics.median(o / f for o, f in zip(ours, floors, strict=True)):.3f})"
    )
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    steps = summary["global_step"]
    rows = sorted(
        (tt, ct, f"{Path(file).name}:{line}:{name}")
        for (file, line, name), (_, calls, tt, ct, _) in stats.items()
        if "/dtf/" in file and calls >= steps  # called every step: not start-up's
    )[::-1]
    print(f"dtf's own functions called every step, cProfile time per step (us): {'own':>8}{'with callees':>14}")
    for tt, ct, where in rows[:12]:
        print(f"  {where:<46}{tt * per_step:>8.1f}{ct * per_step:>14.1f}")
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs", type=int, default=40, help="40 = the default job's trainer.max_epochs")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per rank (the default job's)")
    p.add_argument("--batch-sizes", help="comma-separated: compare at each, then a table")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cpu, or cuda (one GPU per rank: --nproc at most the GPUs)",
    )
    p.add_argument("--baseline", help="another dtf checkout, run in turn with this one: the ratio this / baseline")
    p.add_argument("--own-time", action="store_true", help="only dtf's own cost per step, in one process")
    args = p.parse_args()
    if args.own_time:
        for size in [int(b) for b in (args.batch_sizes or str(args.batch_size)).split(",")]:
            dtf_own_time(size)
        return
    if not args.batch_sizes:
        compare(args)
        return
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    table = {}
    for size in sizes:
        args.batch_size = size
        table[size] = compare(args)
    print(f"{'batch per rank':>16}{'step dtf / raw':>16}{'train time per step':>22}{'step dtf / floor':>18}")
    for size, (step, mean, over_floor) in table.items():
        print(f"{size:>16}{step:>16.3f}{mean:>22.3f}{over_floor:>18.3f}")
    print(f"(medians of {args.repeats} alternating pairs, {args.nproc} ranks, {args.epochs} epochs each)\n")
    for size in sizes:
        profile_step(size)
        dtf_own_time(size)


if __name__ == "__main__":
    main()
