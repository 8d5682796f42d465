"""The sweep report (dtf/sweep/report.py) of multirun directories made by hand, as Hydra, dtf and a sweeper
leave them: overrides.yaml, summary.json (one pruned), a failed point with only trial.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from dtf.sweep import report
from tests.conftest import REPO, dtf_env
from tests.helpers.run_command import dtf_command, run_command


def summary(
    curve: list[float],
    *,
    name: str = "test/loss",
    mode: str = "min",
    world_size: int = 1,
    samples_per_sec: float = 1000.0,
    **extra: Any,
) -> dict[str, Any]:
    """A summary.json as dtf writes it, for a run whose objective took these values epoch by epoch."""
    per_epoch = [
        {"epoch": e, "train/loss": 1.5 * v, name: v, **({} if name == "test/loss" else {"test/loss": 2 * v})}
        for e, v in enumerate(curve, start=1)
    ]
    return {
        "world_size": world_size,
        "epochs": len(curve),
        "final_metrics": {k: v for k, v in per_epoch[-1].items() if k != "epoch"},
        "metrics_per_epoch": per_epoch,
        "samples_per_sec": samples_per_sec,
        "train_seconds": 16000 / samples_per_sec,
        "objective": curve[-1],
        "objective_name": name,
        "objective_mode": mode,
        "strategy": "ddp",
        **extra,
    }


def point(sweep: Path, job: str, overrides: list[str], summary: dict[str, Any] | None, trial: Any = None) -> None:
    d = sweep / job
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary, indent=2))
    if trial is not None:
        (d / "trial.json").write_text(json.dumps(trial))


@pytest.fixture
def hpo_sweep(tmp_path: Path) -> Path:
    """An HPO-like sweep over a log-spread LR and a strategy: job 1 is the best finished point; job 2
    was pruned after 2 of 4 epochs with an objective lower than job 1's; job 3 failed; job 10 sorts last."""
    sweep = tmp_path / "multirun"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    common = ["trainer.max_epochs=4"]
    point(sweep, "0", ["trial.number=0", "optimizer.lr=0.0001", "strategy=ddp", *common], summary([0.9, 0.7, 0.5, 0.3]))
    point(
        sweep,
        "1",
        ["trial.number=1", "optimizer.lr=0.001", "strategy=fsdp", *common],
        summary([0.5, 0.2, 0.1, 0.05], wall_seconds=30.5),
    )
    point(
        sweep,
        "2",
        ["trial.number=2", "optimizer.lr=0.01", "strategy=ddp", *common],
        summary([0.1, 0.02], pruned=True),
        trial={"number": 2, "state": "PRUNED"},
    )
    point(sweep, "3", ["trial.number=3", "optimizer.lr=0.1", "strategy=fsdp", *common], None, trial={"state": "FAIL"})
    last = ["trial.number=10", "optimizer.lr=0.003", "strategy=ddp", *common]
    point(sweep, "10", last, summary([0.6, 0.4, 0.3, 0.2]))
    return sweep


@pytest.fixture
def nproc_sweep(tmp_path: Path) -> Path:
    """launcher.nproc=1,2,4 x trainer.seed=0,1: throughput as measured, objective a little worse with size."""
    sweep = tmp_path / "nproc"
    speeds = {1: [1000.0, 1100.0], 2: [1800.0, 2000.0], 4: [3000.0, 3400.0]}
    objectives = {1: [0.10, 0.12], 2: [0.11, 0.13], 4: [0.14, 0.16]}
    job = 0
    for n in (1, 2, 4):
        for seed in (0, 1):
            curve = [0.5, objectives[n][seed]]
            s = summary(curve, world_size=n, samples_per_sec=speeds[n][seed])
            point(sweep, str(job), [f"launcher.nproc={n}", f"trainer.seed={seed}"], s)
            job += 1
    return sweep


def table_rows(report_md: Path) -> dict[str, dict[str, str]]:
    """The points table of report.md: job -> {column: cell}."""
    lines = report_md.read_text().splitlines()
    start = lines.index("## Points") + 2
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        row = dict(zip(header, cells, strict=True))
        rows[row["job"].strip("*")] = row
    return rows


def test_the_table_has_one_row_per_point_with_its_values(hpo_sweep: Path) -> None:
    path = report.build(hpo_sweep)
    assert path == hpo_sweep / "report.md"
    rows = table_rows(path)
    assert list(rows) == ["0", "1", "2", "3", "10"]  # job 10 after job 3
    header = list(rows["0"])
    assert header == [
        "job",
        "optimizer.lr",
        "strategy",
        "objective: test/loss (min)",
        "epochs",
        "pruned",
        "train s",
        "wall s",
        "samples/s",
        "note",
    ]
    assert "trial." not in path.read_text()  # the sweeper's own keys are not parameters
    assert "`trainer.max_epochs=4`" in path.read_text()  # what every point shares, said once
    assert rows["0"]["optimizer.lr"] == "0.0001" and rows["0"]["strategy"] == "ddp"
    assert float(rows["0"]["objective: test/loss (min)"]) == 0.3
    assert (rows["0"]["epochs"], rows["0"]["pruned"], rows["0"]["wall s"]) == ("4", "no", "—")
    assert float(rows["0"]["train s"]) == 16.0 and rows["0"]["samples/s"] == "1000"
    assert float(rows["1"]["wall s"]) == 30.5
    assert (rows["2"]["epochs"], rows["2"]["pruned"]) == ("2", "yes")
    assert "pruned after epoch 2" in rows["2"]["note"]
    failed = rows["3"]
    assert failed["optimizer.lr"] == "0.1" and failed["objective: test/loss (min)"] == "—"
    assert "no summary.json" in failed["note"] and "FAIL" in failed["note"]


def test_the_best_point_is_the_best_finished_one(hpo_sweep: Path) -> None:
    rows = table_rows(report.build(hpo_sweep))
    # job 2's 0.02 is lower, but it was pruned: its objective is from epoch 2 of 4, not a result
    assert [job for job, row in rows.items() if "**best**" in row["note"]] == ["1"]
    assert rows["1"]["job"] == "**1**"
    assert (
        "Best (min test/loss): job 1, 0.05, with optimizer.lr=0.001, strategy=fsdp."
        in (hpo_sweep / "report.md").read_text()
    )


def test_the_best_point_follows_the_objective_mode(tmp_path: Path) -> None:
    sweep = tmp_path / "max"
    for job, curve in enumerate([[0.5, 0.8], [0.6, 0.9], [0.4, 0.7]]):
        point(sweep, str(job), [f"optimizer.lr={job + 1}e-3"], summary(curve, name="test/accuracy", mode="max"))
    rows = table_rows(report.build(sweep))
    assert [job for job, row in rows.items() if "**best**" in row["note"]] == ["1"]
    assert "objective: test/accuracy (max)" in rows["1"]


def test_a_search_on_the_validation_split_shows_the_test_score_of_the_best_point_only(tmp_path: Path) -> None:
    sweep = tmp_path / "val"
    for job, curve in enumerate([[0.5, 0.3], [0.6, 0.2], [0.4, 0.35]]):  # test/loss: twice val/loss
        point(sweep, str(job), [f"optimizer.lr={job + 1}e-3"], summary(curve, name="val/loss"))
    text = report.build(sweep).read_text()
    assert "Best (min val/loss): job 1, 0.2, with optimizer.lr=2e-3." in text
    assert "Its test score (evaluated once at its end, never used to choose; shown for the best point only): " in text
    assert "test/loss 0.4." in text and "0.6" not in text.split("## Points")[1]  # no other point's test score


def test_a_search_on_the_test_set_is_said_to_be_biased(hpo_sweep: Path) -> None:
    assert "It was chosen on the test set, so its test/loss is biased upward" in report.build(hpo_sweep).read_text()


def test_points_judged_by_different_objectives_have_no_best(tmp_path: Path) -> None:
    sweep = tmp_path / "mixed"
    point(sweep, "0", ["trainer.objective=test/loss"], summary([0.5]))
    point(sweep, "1", ["trainer.objective=test/accuracy"], summary([0.9], name="test/accuracy", mode="max"))
    text = report.build(sweep).read_text()
    assert "**best**" not in text and "different objectives" in text


def test_every_plot_is_a_png_linked_from_the_report(hpo_sweep: Path) -> None:
    from PIL import Image

    text = report.build(hpo_sweep).read_text()
    pngs = {"curves.png", "objective_vs_optimizer.lr.png", "objective_vs_strategy.png"}
    assert {p.name for p in hpo_sweep.glob("*.png")} == pngs  # no scaling plot: one world size
    for name in pngs:
        assert f"]({name})" in text  # relative: the report moves with its directory
        with Image.open(hpo_sweep / name) as image:
            image.verify()
            assert image.format == "PNG" and min(image.size) > 100


def test_pruned_curves_are_dashed_and_end_early_in_an_x(hpo_sweep: Path) -> None:
    sweep = report.Sweep.of(report.load(hpo_sweep))
    fig = report.curves_figure(sweep)
    assert fig is not None
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    curves = {label.split(":")[0]: line for label, line in lines.items() if not label.startswith("_")}
    assert set(curves) == {"0", "1", "2", "10"}  # the failed point has no curve
    assert list(curves["2"].get_xdata()) == [1, 2] and list(curves["2"].get_ydata()) == [0.1, 0.02]
    assert curves["2"].get_linestyle() == "--" and "(pruned)" in curves["2"].get_label()
    assert list(curves["0"].get_xdata()) == [1, 2, 3, 4] and curves["0"].get_linestyle() == "-"
    ends = [line for label, line in lines.items() if label.startswith("_") and line.get_marker() == "x"]
    assert [(list(e.get_xdata()), list(e.get_ydata())) for e in ends] == [([2], [0.02])]
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "2: optimizer.lr=0.01, strategy=ddp (pruned)" in legend


def test_numeric_parameters_get_a_numeric_axis_and_categories_stay_categories(hpo_sweep: Path) -> None:
    sweep = report.Sweep.of(report.load(hpo_sweep))
    lr = report.parameter_figure(sweep, "optimizer.lr")
    assert lr is not None and lr.axes[0].get_xscale() == "log"  # 1e-4 .. 1e-2: two decades
    strategy = report.parameter_figure(sweep, "strategy")
    assert strategy is not None and strategy.axes[0].get_xscale() == "linear"
    assert [t.get_text() for t in strategy.axes[0].get_xticklabels()] == ["ddp", "fsdp"]


def test_a_narrow_numeric_range_stays_linear(nproc_sweep: Path) -> None:
    sweep = report.Sweep.of(report.load(nproc_sweep))
    assert sweep.varying == ["launcher.nproc", "trainer.seed"]
    fig = report.parameter_figure(sweep, "launcher.nproc")
    assert fig is not None and fig.axes[0].get_xscale() == "linear"


def test_scaling_is_measured_against_linear_scaling_from_the_smallest_world_size(nproc_sweep: Path) -> None:
    rows = report.scaling(report.Sweep.of(report.load(nproc_sweep)))
    # medians per size: 1050, 1900, 3200 samples/s; linear from 1 rank: 1050 x N
    assert [(r.world_size, r.num_points) for r in rows] == [(1, 2), (2, 2), (4, 2)]
    assert [r.samples_per_sec for r in rows] == [1050.0, 1900.0, 3200.0]
    assert [r.efficiency for r in rows] == pytest.approx([1.0, 1900 / 2100, 3200 / 4200])
    assert [r.objective for r in rows] == pytest.approx([0.11, 0.12, 0.15])
    text = report.build(nproc_sweep).read_text()
    assert "| 2 | 2 | 1900 | 90% | 0.12 |" in text and "](scaling.png)" in text
    from PIL import Image

    with Image.open(nproc_sweep / "scaling.png") as image:
        assert image.format == "PNG"


def test_a_sweep_of_one_world_size_has_no_scaling_section(hpo_sweep: Path) -> None:
    assert report.scaling(report.Sweep.of(report.load(hpo_sweep))) == []
    assert "## Scaling" not in report.build(hpo_sweep).read_text()


def test_plots_of_an_earlier_report_that_no_longer_apply_are_removed(hpo_sweep: Path) -> None:
    (hpo_sweep / "objective_vs_gone.png").write_bytes(b"old")
    (hpo_sweep / "scaling.png").write_bytes(b"old")
    report.build(hpo_sweep)
    assert not (hpo_sweep / "objective_vs_gone.png").exists() and not (hpo_sweep / "scaling.png").exists()


def test_without_matplotlib_the_table_is_still_written(hpo_sweep: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    text = report.build(hpo_sweep).read_text()
    assert "No plots: matplotlib is not installed" in text and "**best**" in text
    assert not list(hpo_sweep.glob("*.png"))


def test_the_command_writes_the_report_and_says_where(hpo_sweep: Path) -> None:
    proc = run_command(dtf_command("multirun", module="dtf.sweep.report"), cwd=hpo_sweep.parent, timeout=120)
    assert proc.stdout == "dtf: sweep report: multirun/report.md\n"
    assert (hpo_sweep / "report.md").exists()


@pytest.mark.parametrize("case", ["missing", "a file", "a run dir", "empty"])
def test_a_bad_dir_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    target = tmp_path / "target"
    if case == "a file":
        target.write_text("")
    elif case == "a run dir":
        (target / ".hydra").mkdir(parents=True)
        (target / "summary.json").write_text("{}")
    elif case == "empty":
        target.mkdir()
    proc = run_command(dtf_command(target, module="dtf.sweep.report"), cwd=tmp_path, timeout=120, expect=2)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dtf: error: {target} "), proc.stderr
    assert "Traceback" not in proc.stderr and not (target / "report.md").exists()


def sweep_config(sweep_dir: Path) -> Any:
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}})


def test_the_callback_prints_where_the_report_is(hpo_sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report.SweepReport().on_multirun_end(sweep_config(hpo_sweep))
    out, err = capsys.readouterr()
    assert out == f"dtf: sweep report: {hpo_sweep / 'report.md'}\n" and err == ""


@pytest.mark.parametrize("broken", ["no points", "unreadable overrides"])
def test_a_report_that_cannot_be_built_never_fails_the_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], broken: str
) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    if broken == "unreadable overrides":  # a bug's exception, not a user's mistake: still one line
        (sweep / "0" / ".hydra").mkdir(parents=True)
        (sweep / "0" / ".hydra" / "overrides.yaml").write_text("- [unclosed\n")
    report.SweepReport().on_multirun_end(sweep_config(sweep))
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"dtf: no sweep report for {sweep}: "), err


def test_the_report_is_built_after_slurm_jobs_are_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra notifies on_multirun_end in the reverse order of hydra.callbacks (hydra/_internal/callbacks.py)."""
    from hydra._internal.callbacks import Callbacks

    from dtf.launch.slurm import SweepJobs

    called: list[str] = []
    monkeypatch.setattr(SweepJobs, "on_multirun_end", lambda self, config, **kw: called.append("slurm"))
    monkeypatch.setattr(report.SweepReport, "on_multirun_end", lambda self, config, **kw: called.append("report"))
    config = OmegaConf.load(REPO / "conf" / "config.yaml")
    Callbacks(config).on_multirun_end(config=config)
    assert called == ["slurm", "report"]


def test_importing_the_report_or_the_command_line_loads_no_matplotlib() -> None:
    code = "import sys, dtf.cli, dtf.sweep.report; print(sorted(m for m in sys.modules if m.startswith('matplotlib')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=dtf_env())
    assert out.stdout.strip() == "[]"


def test_dtf_report_is_the_training_functions_value_not_this_module() -> None:
    # python -m dtf.sweep.report makes a sweep's report; dtf.report(name, total, count) is a function's exact value.
    import dtf
    from dtf.train.function import report as function_report

    assert dtf.report is function_report and "report" in dtf.__all__
