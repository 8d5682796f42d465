"""A real sweep ends with its report: `python -m dtf -m ...` prints where report.md is."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_dtf

TINY = ["trainer.max_epochs=2", "launcher.nproc=1", "data.dataset.num_points=1000", "data.dataset.num_test=200"]


@pytest.mark.slow  # ~30 s: two real runs
def test_a_sweep_prints_where_its_report_is(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run = run_dtf(["optimizer.lr=1e-3,2e-3", *TINY], sweep, multirun=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"dtf: sweep report: {sweep / 'report.md'}" in run.stdout.splitlines()
    text = (sweep / "report.md").read_text()
    assert "| optimizer.lr |" in text and text.count("**best**") == 1
    assert f"Made by `python -m dtf.sweep.report {sweep}`" in text  # the command that makes it again
    for job, lr in (("0", "0.001"), ("1", "0.002")):
        assert any(line.startswith((f"| {job} | {lr} |", f"| **{job}** | {lr} |")) for line in text.splitlines())
    assert (sweep / "curves.png").stat().st_size > 0 and (sweep / "objective_vs_optimizer.lr.png").stat().st_size > 0
