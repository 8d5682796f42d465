"""The SageMaker seed's table, rerunnable: every strategy on hosts whose links are slower between them
than inside them, against the formula's bytes and DDP's parameters.

    sudo .venv/bin/python benchmarks/topology.py [--rates none,1gbit,100mbit,10mbit] [--models deep_mlp,vit]
        [--repeats 3] [--auto] [--json PATH]
    sudo .venv/bin/python benchmarks/topology.py --smoke        # a few steps at 100mbit: what the suite runs

Hosts: 2 network namespaces x 2 ranks (scripts/local-hosts.sh: started here unless they run already,
and then left running), each host's link to the bridge shaped both ways with tc's tbf
(`local-hosts.sh shape RATE`); inside a host the ranks talk over its loopback, unshaped, so the
ratio between the two is real (loopback measures about 5 Gbit/s per rank on this 2-core machine).
This kernel has no netem, so latency is not shaped. Every qdisc is removed at the end, also on
Ctrl-C or SIGTERM.

Models: model=deep_mlp (0.53 M parameters, 2.11 MB) and the seed's ViT scaled down to these
cores: transformers' ViTForImageClassification from a ViTConfig (model=vit_tiny with hidden size
256, 6 layers, MLP 1024, 4 heads: 4.76 M parameters, 19.0 MB) on scikit-learn's digits.

Each cell (rate, model, plan) measures:
- the median step time (summary.json's, without its warm-up steps) over --repeats runs, paired and
  alternating: within a (rate, model) every repeat runs all plans, in an order rotated by one each
  repeat, so that load hits all alike;
- the bytes one host sent across its link per step, from its veth's counters: (bytes of a long run
  - bytes of a short one) / the steps between them, the most of the two hosts, on unshaped links
  (bytes do not depend on the rate);
- the bytes dtf's formula predicts (dtf/strategy/traffic.py) and the ratio;
- the floor: the larger of the plan's unshaped step (its compute) and the formula's bytes at the
  shaped rate, and the step's ratio to it;
- the final parameters against DDP's at the same rate: the largest |difference| over the repeats,
  and whether every repeat is within the strategy tests' tolerance (rtol = atol = 1e-5; for
  mics G=2 bf16, whose gradients cross between the groups in bf16, the whole model within
  dtf.strategy.mics.BF16_ACROSS_TOLERANCE of DDP's in relative L2 distance).
With --auto, strategy=auto and strategy=mics (partition_group_size=auto) run too, and the table
says what each chose, its probe's time and figures, and how the chosen plan's step compares with the
fastest measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HOSTS_SCRIPT = ROOT / "scripts" / "local-hosts.sh"

MODELS = {
    "deep_mlp": ["model=deep_mlp"],
    "vit": [
        "model=vit_tiny",
        "model.hidden_size=256",
        "model.num_hidden_layers=6",
        "model.intermediate_size=1024",
        "model.num_attention_heads=4",
        "data=digits",
        "loss=cross_entropy",
        "metrics=accuracy",
    ],
}
RATES_BITS = {"none": None, "1gbit": 1e9, "10gbit": 1e10, "100mbit": 1e8, "10mbit": 1e7}
TOLERANCE = 1e-5  # tests/dist/test_strategies.py's rtol and atol
COMMON = [
    "launcher.nproc=2",
    "launcher.nnodes=2",
    "+launcher.env.OMP_NUM_THREADS=1",  # 4 ranks share 2 cores: one thread each
    "trainer.progress=off",
    "checkpoint.at_end=false",
    "checkpoint.every_n_steps=null",
    "trainer.num_warmup_timing_steps=1",
    # SGD, as the strategy tests compare strategies: Adam divides by the root of a near-zero second
    # moment, which turns the last bit of a gradient summed in another order into a visible step
    "optimizer=sgd",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="none,1gbit,100mbit,10mbit", help="tc rates, or none (unshaped)")
    p.add_argument("--models", default="deep_mlp,vit")
    p.add_argument("--plans", default="", help="str(Plan)s to run (default: every plan of 4 ranks, and mics G=2 bf16)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps of a timing run (the first is warm-up)")
    p.add_argument("--max-run-s", type=float, default=60, help="fewer steps (at least 4) where a run would be longer")
    p.add_argument("--skip", default="vit@10mbit", help="model@rate pairs not to run (too slow here)")
    p.add_argument("--auto", action="store_true", help="also strategy=auto and strategy=mics (G auto)")
    p.add_argument(
        "--smoke", action="store_true", help="a few steps at 100mbit: deep_mlp, ddp, fsdp, mics G=2 (and bf16)"
    )
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("benchmarks/topology.py: needs root (network namespaces and tc): run it with sudo")
    if shutil.which("tc") is None or shutil.which("ip") is None:
        sys.exit("benchmarks/topology.py: needs tc and ip (iproute2): apt-get install iproute2")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below restores the links
    with hosts() as names:
        bench = Bench(names, args)
        bench.run()
    bench.report()


@contextlib.contextmanager
def hosts() -> Iterator[list[str]]:
    """Two namespace hosts (started here unless they run), their links unshaped at the end."""
    started = subprocess.run(["bash", str(HOSTS_SCRIPT), "start", "2"], capture_output=True, text=True)
    if started.returncode != 0:
        sys.exit(f"benchmarks/topology.py: scripts/local-hosts.sh start failed: {started.stderr.strip()}")
    ours = "already running" not in started.stderr
    try:
        yield started.stdout.strip().split("=", 1)[1].strip('"').split()[:2]
    finally:
        shape("off")
        if ours:
            subprocess.run(["bash", str(HOSTS_SCRIPT), "stop"], capture_output=True)


def shape(rate: str) -> None:
    subprocess.run(["bash", str(HOSTS_SCRIPT), "shape", rate], check=True, capture_output=True)


@dataclass
class Cell:
    rate: str
    model: str
    name: str  # str(Plan), or auto / mics auto
    overrides: list[str]
    steps: list[float] = field(default_factory=list)
    max_diff: float | None = None
    equal: bool = True  # every repeat's parameters within the tolerance of DDP's
    choices: list[dict[str, Any]] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.steps)


class Bench:
    def __init__(self, names: list[str], args: argparse.Namespace) -> None:
        from dtf.strategy.traffic import Plan, plans

        self.hosts = names
        self.args = args
        self.rates = ["100mbit"] if args.smoke else args.rates.split(",")
        self.models = ["deep_mlp"] if args.smoke else args.models.split(",")
        wanted = (
            {"ddp", "fsdp", "mics G=2", "mics G=2 bf16"} if args.smoke else set(filter(None, args.plans.split(",")))
        )
        # and MiCS with the gradients crossing in bf16 (strategy.cross_group_dtype), at G = a host's ranks
        every = [*plans(4), Plan("mics", 2, "bfloat16")]
        self.plans = [plan for plan in every if not wanted or str(plan) in wanted]
        self.skip = set(filter(None, args.skip.split(",")))
        self.cells: list[Cell] = []
        self.bytes: dict[tuple[str, str], float] = {}  # (model, plan): measured per step
        self.formula: dict[tuple[str, str], float] = {}
        self.load = [os.getloadavg()[0]]
        self.tmp = Path(tempfile.mkdtemp(prefix="dtf-topology-"))

    # -- running -------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            for model in self.models:
                self._formula(model)
                if not self.args.smoke:
                    shape("off")
                    self._bytes(model)
                for rate in self.rates:
                    if f"{model}@{rate}" in self.skip:
                        continue
                    shape(rate if rate != "none" else "off")
                    self._times(model, rate)
        finally:
            self.load.append(os.getloadavg()[0])
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _formula(self, model: str) -> None:
        from hydra import compose, initialize_config_module

        from dtf.models import build_model
        from dtf.models.blocks import find_blocks
        from dtf.strategy.traffic import Layout, per_step

        with initialize_config_module("dtf.conf", version_base=None):
            cfg = compose("config", overrides=MODELS[model])
        built = build_model(cfg.model)
        param_bytes = sum(p.numel() * p.element_size() for p in built.parameters())
        units = len(find_blocks(built, None)) + 1
        for plan in self.plans:
            t = per_step(plan, Layout(2, 2), param_bytes, param_bytes, units)
            self.formula[(model, str(plan))] = t.across_per_host

    def _bytes(self, model: str) -> None:
        """Each plan's bytes across per step, unshaped: a long run's counters less a short one's."""
        short, long = 2, 2 + self.args.steps
        for plan in self.plans:
            sent = [self._dtf(model, plan.overrides(), steps)[1] for steps in (short, long)]
            self.bytes[(model, str(plan))] = (sent[1] - sent[0]) / (long - short)
            print(f"bytes {model} {plan}: {self.bytes[(model, str(plan))] / 1e6:.3f} MB/step", flush=True)

    def _times(self, model: str, rate: str) -> None:
        cells = [Cell(rate, model, str(plan), plan.overrides()) for plan in self.plans]
        if self.args.auto:
            cells += [
                Cell(rate, model, "auto", ["strategy=auto"]),
                Cell(rate, model, "mics auto", ["strategy=mics"]),
            ]
        steps = self._steps_for(model, rate)
        weights: dict[str, Path] = {}
        for repeat in range(1 if self.args.smoke else self.args.repeats):
            order = cells[repeat % len(cells) :] + cells[: repeat % len(cells)]
            for cell in order:
                summary, sent, run_dir = self._dtf(model, cell.overrides, steps)
                if self.args.smoke and cell.name in {str(p) for p in self.plans}:
                    short = self._dtf(model, cell.overrides, 2)[1]
                    self.bytes[(model, cell.name)] = (sent - short) / (steps - 2)
                cell.steps.append(summary["step_time_s"])
                if summary.get("strategy_choice"):
                    cell.choices.append(summary["strategy_choice"])
                weights[cell.name] = run_dir / "model.pt"
                print(
                    f"{rate} {model} {cell.name} repeat {repeat + 1}: {summary['step_time_s']:.4f} s/step", flush=True
                )
            for cell in cells:  # the worst of the repeats
                diff, close = _difference(weights[cell.name], weights["ddp"], bf16=cell.name.endswith(" bf16"))
                cell.max_diff = diff if cell.max_diff is None else max(cell.max_diff, diff)
                cell.equal = cell.equal and close
            for path in weights.values():
                path.unlink()
        self.cells += cells

    def _steps_for(self, model: str, rate: str) -> int:
        """--steps, or fewer (at least 4) where the slowest plan's formula bytes at this rate would
        make a run longer than --max-run-s."""
        if self.args.smoke:
            return 4
        bits = RATES_BITS[rate]
        if bits is None:
            return self.args.steps
        slowest = max(self.formula[(model, str(p))] for p in self.plans) * 8 / bits
        return max(4, min(self.args.steps, int(self.args.max_run_s / slowest)))

    def _dtf(self, model: str, overrides: list[str], steps: int) -> tuple[dict[str, Any], float, Path]:
        """One run on both hosts: its summary, the most bytes a host sent across, its run dir."""
        run_dir = self.tmp / f"run{time.monotonic_ns()}"
        args = [
            *MODELS[model],
            *COMMON,
            *overrides,
            f"trainer.max_steps={steps}",
            f"launcher.rdzv_endpoint={self.hosts[0]}:29500",
            f"hydra.run.dir={run_dir}",
        ]
        before = _sent(self.hosts)
        procs = []
        try:
            for node, host in reversed(list(enumerate(self.hosts))):
                cmd = ["bash", str(HOSTS_SCRIPT), "run", host, sys.executable, "-m", "dtf", *args]
                procs.append(
                    subprocess.Popen(
                        [*cmd, f"launcher.node_rank={node}"],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        text=True,
                        cwd=self.tmp,
                    )
                )
            for proc in procs:
                _, err = proc.communicate(timeout=1800)
                if proc.returncode != 0:
                    raise SystemExit(f"benchmarks/topology.py: a run failed ({' '.join(overrides)}):\n{err[-3000:]}")
        finally:  # (interrupted) a driver ends its ranks on SIGTERM, as on Ctrl-C
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        after = _sent(self.hosts)
        sent = max(after[h] - before[h] for h in self.hosts)
        return json.loads((run_dir / "summary.json").read_text()), sent, run_dir

    # -- reporting -----------------------------------------------------------------------------

    def report(self) -> None:
        rows = []
        unshaped = {(c.model, c.name): c.median for c in self.cells if c.rate == "none"}
        print()
        print(
            "| link across hosts | model | plan | step, median (min-max) | fsdp / plan | MB across per step, "
            "measured | formula | measured / formula | floor | step / floor | max abs diff vs DDP |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for c in self.cells:
            fsdp = next((x for x in self.cells if (x.rate, x.model, x.name) == (c.rate, c.model, "fsdp")), c)
            measured = self.bytes.get((c.model, c.name))
            formula = self.formula.get((c.model, c.name))
            bits = RATES_BITS[c.rate]
            floor = None
            if formula is not None and bits is not None and (c.model, c.name) in unshaped:
                floor = max(unshaped[(c.model, c.name)], formula * 8 / bits)
            name = c.name
            if c.choices:
                name += " -> " + ", ".join(sorted({ch["plan"] for ch in c.choices}))
            row = {
                "rate": c.rate,
                "model": c.model,
                "plan": c.name,
                "chose": sorted({ch["plan"] for ch in c.choices}),
                "steps_s": c.steps,
                "median_s": c.median,
                "fsdp_over_plan": fsdp.median / c.median,
                "bytes_measured": measured,
                "bytes_formula": formula,
                "floor_s": floor,
                "max_diff_vs_ddp": c.max_diff,
                "equal_to_ddp": c.equal,
                "choices": c.choices,
            }
            rows.append(row)
            print(
                f"| {c.rate} | {c.model} | {name} | {c.median:.4f} s ({min(c.steps):.4f}-{max(c.steps):.4f}) "
                f"| {fsdp.median / c.median:.2f}x | {_mb(measured)} | {_mb(formula)} "
                f"| {measured / formula if measured and formula else float('nan'):.3f} "
                f"| {floor if floor is not None else float('nan'):.4f} "
                f"| {c.median / floor if floor else float('nan'):.2f} "
                f"| {c.max_diff:.2e}{'' if c.equal else ' NOT EQUAL'} |"
            )
        print()
        print(
            f"command: {' '.join(sys.argv)}; 2 namespace hosts x 2 ranks on this machine ({os.cpu_count()} cores); "
            f"load average {self.load[0]:.2f} at the start, {self.load[-1]:.2f} at the end; "
            f"{time.strftime('%Y-%m-%d %H:%M')}"
        )
        for line in self.verdicts():
            print(line)
        if self.args.json:
            self.args.json.write_text(json.dumps({"rows": rows, "load": self.load, "argv": sys.argv}, indent=1))

    def verdicts(self) -> list[str]:
        from dtf.strategy.mics import BF16_ACROSS_TOLERANCE

        lines = []
        by = {(c.rate, c.model, c.name): c for c in self.cells}
        for c in self.cells:
            if c.name not in ("mics G=2", "mics G=2 bf16") or (c.rate, c.model, "fsdp") not in by:
                continue
            speedup = by[(c.rate, c.model, "fsdp")].median / c.median
            if c.rate == "none":
                lines.append(f"unshaped, {c.model}: {c.name} at {1 / speedup:.3f}x fsdp's step (target <= 1.05)")
            else:
                # 10:1 or wider against loopback's ~5 Gbit/s per rank: 100mbit and slower
                bits = RATES_BITS[c.rate] or 0.0
                target = 2.2 if c.rate == "100mbit" else 1.4 if bits <= 5e8 else None
                goal = f" (target >= {target})" if target else " (no target: under 10:1 against loopback)"
                lines.append(f"{c.rate}, {c.model}: {c.name} {speedup:.2f}x faster than fsdp{goal}")
        floors = self._floors()
        over = [(rate, model, name, round(r, 2)) for rate, model, name, r in floors if r > 1.25]
        lines.append(
            f"step <= 1.25x its floor at the shaped rates: {len(floors) - len(over)} of {len(floors)}; over: {over}"
        )
        off = [
            (k, self.bytes[k] / f)
            for k, f in self.formula.items()
            if k in self.bytes and abs(self.bytes[k] / f - 1) > 0.1
        ]
        lines.append(f"bytes within 10% of the formula: {len(self.bytes) - len(off)} of {len(self.bytes)}; off: {off}")
        unequal = [(c.rate, c.model, c.name, c.max_diff) for c in self.cells if not c.equal]
        lines.append(
            f"parameters equal to DDP's within {TOLERANCE} (bf16 across: {BF16_ACROSS_TOLERANCE} relative L2): "
            f"{len(self.cells) - len(unequal)} of {len(self.cells)}; "
            f"not: {unequal}"
        )
        for c in self.cells:
            if not c.choices:
                continue
            pool = [
                x
                for x in self.cells
                if (x.rate, x.model) == (c.rate, c.model)
                and x.name in {str(p) for p in self.plans}
                and not x.name.endswith(" bf16")  # auto keeps the gradients' dtype: it is the user's to narrow
            ]
            if c.name == "mics auto":
                pool = [x for x in pool if x.name.startswith("mics")]
            fastest = min(pool, key=lambda x: x.median)
            chose = {ch["plan"] for ch in c.choices}
            picked = [by[(c.rate, c.model, name)] for name in chose if (c.rate, c.model, name) in by]
            worst = max((x.median for x in picked), default=float("nan"))
            probes = [ch.get("probe_s") or 0 for ch in c.choices]
            lines.append(
                f"{c.rate}, {c.model}, {c.name}: chose {', '.join(sorted(chose))} ({worst / fastest.median:.3f}x the "
                f"fastest measured, {fastest.name}); probe {max(probes):.2f} s at most"
            )
        return lines

    def _floors(self) -> list[tuple[str, str, str, float]]:
        """(rate, model, plan, step / floor) of every shaped cell of a plan also run unshaped."""
        unshaped = {(c.model, c.name): c.median for c in self.cells if c.rate == "none"}
        found = []
        for c in self.cells:
            bits, formula = RATES_BITS[c.rate], self.formula.get((c.model, c.name))
            if bits is None or formula is None or (c.model, c.name) not in unshaped:
                continue
            found.append((c.rate, c.model, c.name, c.median / max(unshaped[(c.model, c.name)], formula * 8 / bits)))
        return found


def _sent(names: list[str]) -> dict[str, int]:
    """What each host has sent across its link: its veth's end on the bridge receives it."""
    return {h: int(Path(f"/sys/class/net/{h}v/statistics/rx_bytes").read_text()) for h in names}


def _difference(a: Path, b: Path, bf16: bool = False) -> tuple[float, bool]:
    """The largest |a - b| over all parameters, and whether every one is within the strategy tests'
    torch.testing.assert_close(rtol=1e-5, atol=1e-5), or (bf16: gradients crossing between the
    groups in bf16) within dtf.strategy.mics.BF16_ACROSS_TOLERANCE of it (the whole model's relative
    L2 distance)."""
    import torch

    from dtf.strategy.mics import BF16_ACROSS_TOLERANCE, relative_distance

    pa, pb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    if pa.keys() != pb.keys():
        raise SystemExit(f"benchmarks/topology.py: {a} and {b} hold different parameters")
    largest = max(float((pa[k].float() - pb[k].float()).abs().max()) for k in pa)
    if bf16:
        close = relative_distance(pa, pb) < BF16_ACROSS_TOLERANCE
    else:
        close = all(torch.allclose(pa[k].float(), pb[k].float(), rtol=TOLERANCE, atol=TOLERANCE) for k in pa)
    return largest, close


def _mb(n: float | None) -> str:
    return f"{n / 1e6:.3f}" if n is not None else "-"


if __name__ == "__main__":
    main()
