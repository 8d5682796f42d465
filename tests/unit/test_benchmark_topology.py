"""benchmarks/topology.py's bookkeeping, in-process, its runs replaced: the "= DDP" column is the
worst difference over every repeat, not the last repeat's (and the reference's weights are not
removed before the others are compared with them)."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "topology.py"


def _bench_module() -> Any:
    spec = importlib.util.spec_from_file_location("topology_bench", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_difference_from_ddp_is_the_worst_over_repeats(tmp_path: Path) -> None:
    topology = _bench_module()
    args = argparse.Namespace(
        smoke=False,
        rates="none",
        models="deep_mlp",
        plans="ddp,fsdp",
        repeats=2,
        steps=4,
        max_run_s=60.0,
        skip="",
        auto=False,
        json=None,
    )
    bench = topology.Bench(["h1", "h2"], args)
    # fsdp's weights differ from ddp's by 1.0 in the first repeat (either order), by 0 in the second
    runs = itertools.count()
    offsets = {(0, "strategy=fsdp"): 1.0}

    def fake_dtf(model: str, overrides: list[str], steps: int) -> tuple[dict[str, Any], float, Path]:
        n = next(runs)
        run_dir = tmp_path / f"run{n}"
        run_dir.mkdir()
        torch.save({"w": torch.zeros(3) + offsets.get((n // 2, overrides[0]), 0.0)}, run_dir / "model.pt")
        return {"step_time_s": 0.1}, 0.0, run_dir

    bench._dtf = fake_dtf
    bench._times("deep_mlp", "none")
    by_name = {c.name: c for c in bench.cells}
    assert by_name["ddp"].max_diff == 0.0 and by_name["ddp"].equal
    assert by_name["fsdp"].max_diff == 1.0 and not by_name["fsdp"].equal
