"""How long a checkpoint save holds up the training loop: synchronous (`dcp.save` in the loop)
against `checkpoint.async_save=true` (the loop copies the state into shared memory; a writer
process beside each rank writes it), in one run, alternating, as medians and ratios.

    .venv/bin/python benchmarks/checkpoint.py [--repeats 3] [--width 1024] [--cases deep_mlp default] [--nproc 2]

Cases (2 ranks of DDP unless --nproc says otherwise, Adam, 6 checkpoints):
- deep_mlp: deep_mlp at the given width (1024: ~8.4 M parameters, ~100 MB of model and Adam
  state across 2 ranks of DDP), a checkpoint every 10 of 60 steps;
- default: the default job (`python -m dtf`: the approximator, a few thousand parameters), a
  checkpoint every 50 of 300 steps (its steps take a few ms: saves every 10 would each wait for
  the one before to reach the disk).

`checkpoint_blocked_s` in summary.json is rank 0's median time per save spent outside training
steps (with async_save, and the wait, if any, for its background copy before the next optimizer
step). For each case it prints the blocking fraction (async blocked / sync blocked: the part of
a synchronous save the loop still waits for), the median step times of both modes, the time of
all the steps (`train_seconds`: where a background copy or the writer slows training), and the
smallest interval in steps that keeps the cost of saving under 2% of the step time
(interval >= cost per save / (0.02 * step time)), where an asynchronous save's cost is the time
it blocked plus what it added to the steps its writer overlapped (the difference of all the
steps' time from the synchronous runs', per save), and, for comparison, the time blocked alone.
The floors, timed here in one process on deep_mlp's state: the copy of the whole state into
memory already allocated (an asynchronous save copies each rank's share of it: about half on
each of 2 DDP ranks, which copy at the same time), and a plain torch.save of it with fsync (what
a synchronous one writes). It also times the integrity checksums (CRC32 of every file: taken
at each save from the bytes written, verified before a resume by reading the files) on one of
the checkpoints written.

    .venv/bin/python benchmarks/checkpoint.py --resume [--repeats 3] [--width 512] [--worlds 1 2 4 8]

--resume: checkpoints on an S3 endpoint (AWS_ENDPOINT_URL's, else moto's server on 127.0.0.1,
started here with scripts/local-s3.sh). The resume of one checkpoint (deep_mlp, FSDP, Adam,
saved by max(--worlds) ranks) at each world size, from local disk and from S3: summary.json's
resume_s (from choosing the checkpoint, its checksums checked by the ranks where they check them,
to its state loaded on every rank; not the start of the processes), medians, and each world
size's time over one rank's, printed as soon as they are done. Beside it, the first step's time
after each resume over a fresh run's at the same world size (first_step_s): above 1, the resume
would have moved work of its own into the first step; below 1, it still does some of what a
start does (a process's first use of an operation). Then the time a save blocks the loop with
checkpoint.dir on S3, synchronous against asynchronous (deep_mlp, a checkpoint every 200 of 1200
steps, on --nproc ranks: 1 leaves a core to the writer and the server), and their ratio. Targets:
async/sync <= 0.05; resume at 8 ranks <= 1.2 x at 1.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from common import REPO, dtf_summary

COMMON = [
    "optimizer=adam",
    "trainer.progress=off",
    "trainer.export_weights=false",
    "checkpoint.at_end=false",
]
CASES = {
    "deep_mlp": [
        "model=deep_mlp",
        "data.dataset.num_points=4000",
        "data.dataset.num_test=200",
        "trainer.max_steps=60",
        "checkpoint.every_n_steps=10",
    ],
    # Steps of a few ms: a save every 10 would start before the one before is on disk (and wait for it).
    "default": ["trainer.max_steps=300", "checkpoint.every_n_steps=50"],
}
COST_BUDGET = 0.02  # of the step time
# --resume's saves to S3: an upload takes the writer CPU (HTTP, the server's), which it gets only
# where the ranks leave a core idle; saves far enough apart for it to finish before the next one.
S3_SAVES = [
    *CASES["deep_mlp"],
    "data.dataset.num_points=8000",
    "trainer.max_steps=1200",
    "checkpoint.every_n_steps=200",
]


def run(run_dir: Path, case: list[str], async_save: bool) -> dict:
    return dtf_summary(run_dir, [*COMMON, *case, f"checkpoint.async_save={str(async_save).lower()}"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["deep_mlp", "default"])
    p.add_argument(
        "--nproc", type=int, default=2, help="ranks (2 fill this machine's cores; 1 leaves one to the writer)"
    )
    p.add_argument("--resume", action="store_true", help="resume and save times with checkpoints on S3")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8], help="--resume's world sizes")
    a = p.parse_args()
    if a.resume:
        resume_main(a.repeats, a.width, a.worlds, a.nproc)
        return
    cases = {
        name: [*CASES[name], f"launcher.nproc={a.nproc}", *([f"model.width={a.width}"] if name == "deep_mlp" else [])]
        for name in a.cases
    }
    blocked: dict[tuple[str, bool], list[float]] = {(c, m): [] for c in cases for m in (False, True)}
    steps: dict[tuple[str, bool], list[float]] = {(c, m): [] for c in cases for m in (False, True)}
    training: dict[tuple[str, bool], list[float]] = {(c, m): [] for c in cases for m in (False, True)}
    saves: dict[tuple[str, bool], list[int]] = {(c, m): [] for c in cases for m in (False, True)}
    print(f"load average at the start: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for name, case in cases.items():
                for async_save in (False, True):
                    s = run(Path(tmp) / f"{name}-{i}-{async_save}", case, async_save)
                    blocked[name, async_save].append(s["checkpoint_blocked_s"])
                    steps[name, async_save].append(s["step_time_s"])
                    training[name, async_save].append(s["train_seconds"])
                    saves[name, async_save].append(s["checkpoints_saved"])
                    print(
                        f"repeat {i} {name} async={async_save}: blocked {s['checkpoint_blocked_s'] * 1e3:.1f} ms per "
                        f"save, {s['checkpoints_saved']} saves, step {s['step_time_s'] * 1e3:.1f} ms",
                        flush=True,
                    )
        checksums = checksum_cost(Path(tmp) / f"{next(iter(cases))}-0-False" / "checkpoints")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min)\n")
    for name in cases:
        sync_ms, async_ms = (statistics.median(blocked[name, m]) * 1e3 for m in (False, True))
        sync_step, async_step = (statistics.median(steps[name, m]) * 1e3 for m in (False, True))
        print(f"{name}: median time the loop is blocked per save: sync {sync_ms:.1f} ms, async {async_ms:.1f} ms")
        print(f"  blocking fraction async/sync {async_ms / sync_ms:.3f} (of a synchronous save, what the loop waits)")
        ratio = async_step / sync_step
        print(f"  median step: sync {sync_step:.1f} ms, async {async_step:.1f} ms (async/sync {ratio:.3f})")
        sync_s, async_s = (statistics.median(training[name, m]) for m in (False, True))
        print(
            f"  all the steps (saves not counted): sync {sync_s:.2f} s, async {async_s:.2f} s (async/sync "
            f"{async_s / sync_s:.3f}: what the writer and the background copy take from training)"
        )
        # An asynchronous save also slows the steps its writer overlaps: its whole cost is the time
        # blocked plus the steps' extra time, per save.
        slowed_ms = max(0.0, (async_s - sync_s) * 1e3 / statistics.median(saves[name, True]))
        print(f"  async cost per save, blocked and the steps' extra time: {async_ms + slowed_ms:.1f} ms")
        for mode, ms in (("sync", sync_ms), ("async, blocked only", async_ms), ("async", async_ms + slowed_ms)):
            every = math.ceil(ms / (COST_BUDGET * sync_step))
            print(f"  saving costs under {COST_BUDGET:.0%} of the step time with {mode} saves every {every}+ steps")
    if "deep_mlp" in cases:
        copy_ms, save_ms, mb = floors(a.width)
        print(
            f"floors on deep_mlp's state ({mb:.0f} MB, one process): its copy into memory already allocated "
            f"{copy_ms:.1f} ms, torch.save with fsync {save_ms:.1f} ms"
        )
    size_mb, crc_ms, verify_ms = checksums
    print(
        f"integrity checksums on a {size_mb:.0f} MB checkpoint: CRC32 of all its files read back {crc_ms:.1f} ms in "
        f"one process (a save checksums the bytes as it writes them instead), verify before a resume {verify_ms:.1f} ms"
    )


def _median_ms(fn: Callable[[], object], times: int = 5) -> float:
    spent = []
    for _ in range(times):
        t0 = time.perf_counter()
        fn()
        spent.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(spent)


def floors(width: int) -> tuple[float, float, float]:
    """(ms to copy deep_mlp's model and Adam state into buffers already allocated, ms to torch.save
    it with fsync, MB): medians of 5, one thread, as a rank has."""
    import torch
    from common import REPO
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    torch.set_num_threads(1)
    cfg = OmegaConf.load(REPO / "conf" / "model" / "deep_mlp.yaml")
    cfg.width = width
    model = instantiate(cfg)
    optimizer = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    tensors = [*model.state_dict().values(), *(t for s in optimizer.state.values() for t in s.values())]
    buffers = [torch.empty_like(t) for t in tensors]
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.pt"

        def save() -> None:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        copy_ms = _median_ms(lambda: [b.copy_(t) for b, t in zip(buffers, tensors, strict=True)])
        save_ms = _median_ms(save)
    return copy_ms, save_ms, sum(t.nbytes for t in tensors) / 2**20


def checksum_cost(root: Path) -> tuple[float, float, float]:
    """(MB, ms to checksum every file, ms to verify the checkpoint): medians of 5, page cache warm."""
    from dtf.train.checkpoint import committed, file_crc32, verify

    path = committed(root)[0]
    files = [f for f in path.iterdir() if f.is_file()]
    size = sum(f.stat().st_size for f in files) / 2**20
    return size, _median_ms(lambda: [file_crc32(f) for f in files]), _median_ms(lambda: verify(path))


@contextlib.contextmanager
def s3_endpoint(tmp: Path) -> Iterator[None]:
    """The S3 endpoint the environment names (AWS_ENDPOINT_URL), else moto's server on 127.0.0.1
    for the block (scripts/local-s3.sh), its endpoint and key in this process's environment."""
    if os.environ.get("AWS_ENDPOINT_URL"):
        yield
        return
    script = REPO / "scripts" / "local-s3.sh"
    env = {**os.environ, "DTF_S3_DIR": str(tmp / "s3-server")}
    started = subprocess.run([script, "start"], env=env, check=True, capture_output=True, text=True).stdout
    exports = dict(line.removeprefix("export ").split("=", 1) for line in started.splitlines() if "=" in line)
    os.environ.update(exports)
    try:
        yield
    finally:
        subprocess.run([script, "stop"], env=env, check=False, capture_output=True)
        for key in exports:
            os.environ.pop(key, None)


def resume_main(repeats: int, width: int, worlds: list[int], nproc: int) -> None:
    import s3fs

    print(f"load average at the start: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores", flush=True)
    case = [
        *COMMON,
        "model=deep_mlp",
        f"model.width={width}",
        "strategy=fsdp",
        "data.dataset.num_points=4000",
        "data.dataset.num_test=200",
        "checkpoint.every_n_steps=null",
    ]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        with s3_endpoint(tmp):
            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            bucket = f"dtf-bench-{os.getpid()}"
            fs.mkdir(bucket)
            # One checkpoint, saved on disk by the most ranks, and the same files uploaded.
            saved = dtf_summary(
                tmp / "saved",
                [*case, f"launcher.nproc={max(worlds)}", "trainer.max_steps=10", "checkpoint.at_end=true"],
            )
            step = saved["global_step"]
            local = tmp / "saved" / "checkpoints" / f"step_{step:09d}"
            size_mb = sum(f.stat().st_size for f in local.iterdir()) / 2**20
            fs.put(f"{local}/", f"{bucket}/saved/{local.name}/", recursive=True)
            sources = {"local": str(local), "s3": f"s3://{bucket}/saved/{local.name}"}
            times: dict[tuple[str, int], list[float]] = {(s, w): [] for s in sources for w in worlds}
            # The first step's time after a resume and in a run started afresh: a process's first use
            # of each operation (DTensor's sharding propagation among them) falls in one or the other.
            first_steps: dict[tuple[str, int], list[float]] = {(s, w): [] for s in ("fresh", *sources) for w in worlds}
            for i in range(repeats):
                for world in worlds:
                    fresh = dtf_summary(
                        tmp / f"fresh-{world}-{i}",
                        [*case, f"launcher.nproc={world}", "trainer.max_steps=2", "checkpoint.at_end=false"],
                    )
                    first_steps["fresh", world].append(fresh["first_step_s"])
                    for name, path in sources.items():
                        resumed = dtf_summary(
                            tmp / f"resume-{name}-{world}-{i}",
                            [
                                *case,
                                f"launcher.nproc={world}",
                                f"trainer.max_steps={step + 2}",
                                "checkpoint.at_end=false",
                                f"checkpoint.resume={path}",
                            ],
                        )
                        times[name, world].append(resumed["resume_s"])
                        first_steps[name, world].append(resumed["first_step_s"])
                        print(
                            f"repeat {i} resume from {name} on {world} rank(s): {resumed['resume_s']:.3f} s, first "
                            f"step {resumed['first_step_s']:.3f} s (afresh {fresh['first_step_s']:.3f} s)",
                            flush=True,
                        )
            print(f"load average after the resumes: {os.getloadavg()[0]:.2f} (1 min)\n")
            report_resumes(times, first_steps, worlds, size_mb, width)
            # Saves with checkpoint.dir on S3: how long each blocks the loop, synchronous and asynchronous.
            blocked: dict[bool, list[float]] = {False: [], True: []}
            deep = [*S3_SAVES, f"model.width={width}", f"launcher.nproc={nproc}"]
            for i in range(repeats):
                for async_save in (False, True):
                    s = run(
                        tmp / f"save-{i}-{async_save}",
                        [*deep, f"checkpoint.dir=s3://{bucket}/save-{i}-{async_save}"],
                        async_save,
                    )
                    blocked[async_save].append(s["checkpoint_blocked_s"])
                    print(
                        f"repeat {i} save to s3 async={async_save}: blocked {s['checkpoint_blocked_s'] * 1e3:.1f} ms "
                        f"per save, {s['checkpoints_saved']} saves",
                        flush=True,
                    )
            fs.rm(bucket, recursive=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    sync_ms, async_ms = (statistics.median(blocked[m]) * 1e3 for m in (False, True))
    print(
        f"saves to s3 (deep_mlp width {width}, {nproc} ranks of DDP): median time the loop is blocked per save: sync "
        f"{sync_ms:.1f} ms, async {async_ms:.1f} ms, async/sync {async_ms / sync_ms:.3f}"
    )


def report_resumes(
    times: dict[tuple[str, int], list[float]],
    first_steps: dict[tuple[str, int], list[float]],
    worlds: list[int],
    size_mb: float,
    width: int,
) -> None:
    print(
        f"resume of one checkpoint ({size_mb:.0f} MB: deep_mlp width {width}, FSDP, Adam; saved by {max(worlds)} ranks)"
    )
    sources = ("local", "s3")
    for name in sources:
        one = statistics.median(times[name, worlds[0]])
        for world in worlds:
            median = statistics.median(times[name, world])
            print(f"  from {name} on {world} rank(s): median {median:.3f} s ({median / one:.2f} x {worlds[0]} rank(s))")
    for world in worlds:
        local_s, s3_s = (statistics.median(times[n, world]) for n in sources)
        print(f"  on {world} rank(s): s3/local {s3_s / local_s:.2f}")
    for world in worlds:
        fresh_s = statistics.median(first_steps["fresh", world])
        after = ", ".join(
            f"after a resume from {n} {statistics.median(first_steps[n, world]) / fresh_s:.2f}x" for n in sources
        )
        print(f"  first step on {world} rank(s): afresh median {fresh_s:.3f} s; {after}", flush=True)


if __name__ == "__main__":
    main()
