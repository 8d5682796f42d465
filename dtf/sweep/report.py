"""`python -m dtf.sweep.report <multirun dir>`: a sweep's points in one page anyone can read without a
tracking server. Writes `report.md` and PNG plots into the sweep's directory, from what every point
leaves behind: `.hydra/overrides.yaml`, `summary.json` and, where a sweeper writes one, `trial.json`.

`SweepReport` is the Hydra callback that builds it when a sweep ends. Importing this module stays
light (the standard library, PyYAML and Hydra's callback base); matplotlib is imported only to draw.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback

from dtf.errors import UserError
from dtf.files import write_atomically
from dtf.results import EXIT_USER_ERROR

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from omegaconf import DictConfig

REPORT_FILE = "report.md"
CURVES_FILE = "curves.png"
SCALING_FILE = "scaling.png"
# Hydra's sweep.subdir may nest (e.g. ${hydra.job.override_dirname}/seed=0): how deep points are looked for.
MAX_DEPTH = 3
# A legend with more entries than this hides the plot: beyond it, the legend names the line styles only.
MAX_LEGEND = 20


@dataclass(eq=False)  # a point is itself: two with equal fields are still two jobs
class Point:
    """One job of the sweep, as its directory shows it."""

    job: str  # its directory, relative to the sweep's
    overrides: dict[str, str]  # key -> value as given on the command line, without the sweeper's trial.* keys
    summary: dict[str, Any] | None  # summary.json; None: failed, still running, or never started
    state: str | None = None  # trial.json's "state", where a sweeper wrote one
    problem: str | None = None  # why the summary could not be read

    @property
    def pruned(self) -> bool:
        return bool(self.summary and self.summary.get("pruned"))

    @property
    def objective(self) -> float | None:
        return _number(self.summary.get("objective")) if self.summary else None

    def curve(self, name: str) -> list[tuple[int, float]]:
        """(epoch, value of `name`) for each epoch that has it (test values only where an evaluation ran)."""
        rows = (self.summary or {}).get("metrics_per_epoch") or []
        pairs = [(row.get("epoch"), _number(row.get(name))) for row in rows if isinstance(row, dict)]
        return [(int(e), v) for e, v in pairs if isinstance(e, int) and v is not None]

    def get(self, key: str) -> Any:
        return self.summary.get(key) if self.summary else None


def _number(x: Any) -> float | None:
    """x as a finite float, or None (null, NaN, a string, a bool)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _natural(job: str) -> list[Any]:
    """Sort key: job 10 after job 9."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", job) if part]


def find_point_dirs(sweep_dir: Path) -> list[Path]:
    """The points' directories: those with .hydra/, summary.json or trial.json, at most MAX_DEPTH down."""
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        for child in folder.iterdir():
            if not child.is_dir() or child.name.startswith("."):
                continue
            if any((child / name).exists() for name in (".hydra", "summary.json", "trial.json")):
                found.append(child)
            elif depth < MAX_DEPTH:
                walk(child, depth + 1)

    walk(sweep_dir, 1)
    return sorted(found, key=lambda p: _natural(p.relative_to(sweep_dir).as_posix()))


def read_overrides(point_dir: Path) -> dict[str, str]:
    """`key=value` lines of .hydra/overrides.yaml as a dict, without the trial.* keys a sweeper adds."""
    import yaml

    path = point_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return {}
    overrides: dict[str, str] = {}
    for line in yaml.safe_load(path.read_text()) or []:
        key, _, value = str(line).partition("=")
        key = key.lstrip("+")  # +key=v adds a key, ++key=v adds or overrides: the same key for a reader
        if not key.startswith("trial."):
            overrides[key] = value
    return overrides


def load_point(sweep_dir: Path, point_dir: Path) -> Point:
    point = Point(point_dir.relative_to(sweep_dir).as_posix(), read_overrides(point_dir), None)
    summary = point_dir / "summary.json"
    if summary.exists():
        try:
            point.summary = json.loads(summary.read_text())
        except (OSError, ValueError) as e:
            point.problem = f"summary.json unreadable ({e})"
    trial = point_dir / "trial.json"
    if trial.exists():
        try:
            state = json.loads(trial.read_text()).get("state")
            point.state = str(state) if state is not None else None
        except (OSError, ValueError, AttributeError):
            point.state = None
    return point


def load(sweep_dir: Path) -> list[Point]:
    """Every point of the sweep in sweep_dir; UserError where sweep_dir is no sweep's directory."""
    if not sweep_dir.is_dir():
        raise UserError(f"{sweep_dir} is not a directory: give a sweep's directory (multirun/<date>/<time>)")
    if (sweep_dir / ".hydra").is_dir():
        raise UserError(
            f"{sweep_dir} is one run's directory, not a sweep's: give the directory that holds the points "
            "(multirun/<date>/<time>, or the hydra.sweep.dir of the sweep)"
        )
    dirs = find_point_dirs(sweep_dir)
    if not dirs:
        raise UserError(
            f"{sweep_dir} has no sweep points (no <job>/.hydra/ or <job>/summary.json in it): give a sweep's "
            "directory (multirun/<date>/<time>)"
        )
    return [load_point(sweep_dir, d) for d in dirs]


@dataclass
class Sweep:
    """The points and what they have in common: the parameters that vary, the objective, the best point."""

    points: list[Point]
    varying: list[str]  # override keys whose value differs between points, in the order first seen
    common: dict[str, str]  # override keys that every point has with the same value
    objective_name: str | None  # None: no summary, or points judged by different objectives
    objective_mode: str | None  # "min" or "max"
    objectives_seen: list[str]  # "name (mode)" of every objective the summaries name
    best: Point | None

    @classmethod
    def of(cls, points: list[Point]) -> Sweep:
        keys: list[str] = []
        for p in points:
            keys += [k for k in p.overrides if k not in keys]
        values = {k: {p.overrides.get(k) for p in points} for k in keys}
        varying = [k for k in keys if len(values[k]) > 1]
        common = {k: next(iter(values[k])) for k in keys if len(values[k]) == 1}
        judged = Counter(
            (str(p.summary["objective_name"]), str(p.summary.get("objective_mode")))
            for p in points
            if p.summary and p.summary.get("objective_name")
        )
        name = mode = None
        if len(judged) == 1:
            name, mode = next(iter(judged))
        best = None
        if mode in ("min", "max"):
            # a pruned point's objective is from where it was stopped, not a finished run's: never the best
            candidates = [p for p in points if p.objective is not None and not p.pruned]
            if candidates:
                pick = min if mode == "min" else max
                best = pick(candidates, key=lambda p: p.objective)  # type: ignore[arg-type,return-value]
        seen = [f"{n} ({m})" for n, m in judged]
        return cls(points, varying, {k: v for k, v in common.items() if v is not None}, name, mode, seen, best)

    def label(self, p: Point, width: int = 48) -> str:
        """The point in a legend: its job and its swept values."""
        swept = ", ".join(f"{k}={p.overrides.get(k, '-')}" for k in self.varying)
        text = f"{p.job}: {swept}" if swept else p.job
        return text if len(text) <= width else text[: width - 1] + "…"


# ---- the table ---------------------------------------------------------------------------------


def _fmt(x: Any, digits: int = 4) -> str:
    v = _number(x)
    if v is None:
        return "—"
    return f"{v:,.0f}" if abs(v) >= 10**digits else f"{v:.{digits}g}"  # 22,058 samples/s, not 2.206e+04


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def point_note(sweep: Sweep, p: Point) -> str:
    if p.summary is None:
        why = p.problem or "no summary.json: failed, still running or not started"
        return f"{why} (trial state {p.state})" if p.state else why
    notes = []
    if p is sweep.best:
        notes.append("**best**")
    if p.pruned:
        notes.append(f"pruned after epoch {p.get('epochs')}")
    if p.summary.get("objective") is not None and p.objective is None:
        notes.append("objective is not a number")
    if p.state and p.state not in ("COMPLETE", "PRUNED"):
        notes.append(f"trial state {p.state}")
    return ", ".join(notes)


def table(sweep: Sweep) -> list[str]:
    """The Markdown table of every point, one row each."""
    objective = f"objective: {sweep.objective_name} ({sweep.objective_mode})" if sweep.objective_name else "objective"
    with_wall = any(p.get("wall_seconds") is not None for p in sweep.points)
    header = ["job", *sweep.varying, objective, "epochs", "pruned", "train s"]
    header += ["wall s"] if with_wall else []
    header += ["samples/s", "note"]
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    for p in sweep.points:
        job = f"**{p.job}**" if p is sweep.best else p.job
        row = [job, *(p.overrides.get(k, "—") for k in sweep.varying)]
        if p.summary is None:
            row += ["—"] * (len(header) - len(row) - 1)
        else:
            epochs = p.get("epochs")
            row += [
                _fmt(p.get("objective"), 6),
                str(epochs) if epochs is not None else "—",
                "yes" if p.pruned else "no",
                _fmt(p.get("train_seconds"), 3),
            ]
            row += [_fmt(p.get("wall_seconds"), 3)] if with_wall else []
            row += [_fmt(p.get("samples_per_sec"), 4)]
        row.append(point_note(sweep, p))
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines


# ---- scaling -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScalingRow:
    """The points of one world size: medians, and throughput relative to linear scaling."""

    world_size: int
    num_points: int
    samples_per_sec: float | None  # median over the points
    efficiency: float | None  # samples/s at N / (samples/s at the smallest N0 × N / N0)
    objective: float | None  # median over the points not pruned


def scaling(sweep: Sweep) -> list[ScalingRow]:
    """One row per world size, where the summaries have more than one (a sweep over launcher.nproc)."""
    by_size: dict[int, list[Point]] = {}
    for p in sweep.points:
        size = p.get("world_size")
        if isinstance(size, int) and size > 0:
            by_size.setdefault(size, []).append(p)
    if len(by_size) < 2:
        return []

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    speed = {n: median([_number(p.get("samples_per_sec")) for p in ps]) for n, ps in by_size.items()}
    smallest = min(by_size)
    base = speed[smallest]
    rows = []
    for n in sorted(by_size):
        s = speed[n]
        efficiency = s / (base * n / smallest) if s is not None and base else None
        objective = median([p.objective for p in by_size[n] if not p.pruned])
        rows.append(ScalingRow(n, len(by_size[n]), s, efficiency, objective))
    return rows


def scaling_table(rows: list[ScalingRow], objective_name: str | None) -> list[str]:
    lines = [
        f"| world size | points | samples/s (median) | efficiency | {objective_name or 'objective'} (median) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        eff = "—" if r.efficiency is None else f"{r.efficiency:.0%}"
        lines.append(
            f"| {r.world_size} | {r.num_points} | {_fmt(r.samples_per_sec)} | {eff} | {_fmt(r.objective, 6)} |"
        )
    return lines


# ---- the plots (matplotlib, imported here only) ------------------------------------------------


def _figure(width: float = 8.0, height: float = 5.0) -> Figure:
    # A Figure of its own, not pyplot: no global backend or state, safe inside a sweeper's process.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _spans_decades(values: list[float], decades: float = 2.0) -> bool:
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) > 1 and math.log10(max(positive) / min(positive)) >= decades


def curves_figure(sweep: Sweep) -> Figure | None:
    """The objective per epoch of every point; pruned points dashed, ending in an x."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    name = sweep.objective_name
    if name is None:
        return None
    drawn = [(p, p.curve(name)) for p in sweep.points]
    drawn = [(p, c) for p, c in drawn if c]
    if not drawn:
        return None
    fig = _figure()
    ax = fig.subplots()
    for i, (p, curve) in enumerate(drawn):
        color = f"C{i % 10}"
        epochs, values = zip(*curve, strict=True)
        label = sweep.label(p) + (" (pruned)" if p.pruned else "") + (" (best)" if p is sweep.best else "")
        ax.plot(
            epochs,
            values,
            linestyle="--" if p.pruned else "-",
            marker=".",
            color=color,
            linewidth=2.5 if p is sweep.best else 1.2,
            label=label,
        )
        if p.pruned:
            ax.plot([epochs[-1]], [values[-1]], marker="x", markersize=10, markeredgewidth=2, color=color)
    ax.set_xlabel("epoch")
    ax.set_ylabel(name)
    ax.set_title(f"{name} per epoch ({sweep.objective_mode} is better)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    if _spans_decades([v for _, c in drawn for _, v in c]):
        ax.set_yscale("log")
    if len(drawn) <= MAX_LEGEND:
        ax.legend(fontsize="small")
    else:
        ax.legend(
            handles=[
                Line2D([], [], color="grey", linestyle="-", marker=".", label="finished"),
                Line2D([], [], color="grey", linestyle="--", marker="x", label="pruned"),
            ],
            fontsize="small",
        )
    return fig


def _numeric(values: list[str]) -> list[float] | None:
    try:
        numbers = [float(v) for v in values]
    except ValueError:
        return None
    return numbers if all(math.isfinite(n) for n in numbers) else None


def parameter_figure(sweep: Sweep, key: str) -> Figure | None:
    """The objective against one swept parameter: a numeric axis (log past 2 decades) or categories."""
    name = sweep.objective_name
    judged = [p for p in sweep.points if p.objective is not None]
    if name is None or not judged:
        return None
    fig = _figure(6.5, 4.5)
    ax = fig.subplots()
    raw = [p.overrides.get(key) for p in judged]
    numbers = _numeric([r for r in raw if r is not None])
    if numbers is not None:
        judged = [p for p, r in zip(judged, raw, strict=True) if r is not None]
        xs: list[float] = numbers
    else:
        categories = list(dict.fromkeys(r if r is not None else "(unset)" for r in raw))
        xs = [float(categories.index(r if r is not None else "(unset)")) for r in raw]
        ax.set_xticks(range(len(categories)), labels=categories, rotation=30 if len(categories) > 4 else 0)
        ax.set_xlim(-0.5, len(categories) - 0.5)
    done = [(x, p.objective) for x, p in zip(xs, judged, strict=True) if not p.pruned]
    cut = [(x, p.objective) for x, p in zip(xs, judged, strict=True) if p.pruned]
    if done:
        ax.scatter(*zip(*done, strict=True), color="C0", label="finished", zorder=2)
    if cut:
        label = "pruned (objective where it stopped)"
        ax.scatter(*zip(*cut, strict=True), color="grey", marker="x", label=label, zorder=2)
    best = sweep.best
    if best is not None and best in judged and best.objective is not None:
        x = xs[judged.index(best)]
        ax.scatter([x], [best.objective], s=200, marker="*", color="C3", label="best", zorder=3)
    if numbers is not None and _spans_decades(numbers):
        ax.set_xscale("log")
    ax.set_xlabel(key)
    ax.set_ylabel(name)
    ax.set_title(f"{name} against {key} ({sweep.objective_mode} is better)")
    ax.legend(fontsize="small")
    return fig


def scaling_figure(rows: list[ScalingRow], objective_name: str | None) -> Figure:
    """Three panels against world size: throughput (with ideal linear scaling), efficiency, objective."""
    fig = _figure(13, 4)
    speed_ax, eff_ax, obj_ax = fig.subplots(1, 3)
    sizes = [r.world_size for r in rows]
    measured = [(r.world_size, r.samples_per_sec) for r in rows if r.samples_per_sec is not None]
    if measured:
        speed_ax.plot(*zip(*measured, strict=True), marker="o", label="measured (median)")
        n0, s0 = measured[0]
        linear = [s0 * n / n0 for n in sizes]
        speed_ax.plot(sizes, linear, linestyle="--", color="grey", label="linear from the smallest")
        speed_ax.legend(fontsize="small")
    speed_ax.set_ylabel("samples/s")
    speed_ax.set_title("throughput")
    efficiency = [(r.world_size, r.efficiency) for r in rows if r.efficiency is not None]
    if efficiency:
        eff_ax.plot(*zip(*efficiency, strict=True), marker="o")
    eff_ax.axhline(1.0, linestyle="--", color="grey")
    eff_ax.set_ylim(0, max([1.1] + [e * 1.1 for _, e in efficiency]))
    eff_ax.set_ylabel("scaling efficiency")
    eff_ax.set_title("throughput / linear scaling")
    objective = [(r.world_size, r.objective) for r in rows if r.objective is not None]
    if objective:
        obj_ax.plot(*zip(*objective, strict=True), marker="o")
    obj_ax.set_ylabel(objective_name or "objective")
    obj_ax.set_title(f"final {objective_name or 'objective'} (median)")
    for ax in (speed_ax, eff_ax, obj_ax):
        ax.set_xlabel("world size (ranks)")
        if max(sizes) / min(sizes) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, labels=[str(n) for n in sizes])
    return fig


def _file_name(key: str) -> str:
    return "objective_vs_" + re.sub(r"[^A-Za-z0-9._-]+", "_", key) + ".png"


def draw(sweep: Sweep, sweep_dir: Path, rows: list[ScalingRow]) -> list[str]:
    """Every plot as PNG into sweep_dir; the report's sections about them, as Markdown lines."""
    import matplotlib  # noqa: F401  (ImportError here: the report says plots need it)

    lines: list[str] = []
    written: set[str] = set()
    name = sweep.objective_name

    def save(fig: Figure, file: str) -> None:
        fig.savefig(sweep_dir / file, dpi=100)
        written.add(file)

    fig = curves_figure(sweep)
    if fig is not None:
        save(fig, CURVES_FILE)
        lines += [
            "## Learning curves",
            "",
            f"![learning curves]({CURVES_FILE})",
            "",
            f"{name} after each epoch, one line per point; pruned points are dashed and end in an x where "
            "they were stopped.",
            "",
        ]
    parameter_lines: list[str] = []
    for key in sweep.varying:
        fig = parameter_figure(sweep, key)
        if fig is not None:
            file = _file_name(key)
            save(fig, file)
            parameter_lines += [
                f"### {key}",
                "",
                f"![{name} against {key}]({file})",
                "",
                f"Each point's final {name} against its {key}; pruned points are grey x's, the best is a star.",
                "",
            ]
    if parameter_lines:
        lines += ["## The objective against each swept parameter", "", *parameter_lines]
    if rows:
        save(scaling_figure(rows, name), SCALING_FILE)
        lines += [
            "## Scaling",
            "",
            *scaling_table(rows, name),
            "",
            f"![scaling]({SCALING_FILE})",
            "",
            "Against the world size (medians of the points of each size): samples/s with the dashed line of "
            "linear scaling from the smallest size; efficiency, samples/s over that line (100% is linear); "
            f"and the final {name}.",
            "",
        ]
    # plots of an earlier report that this one has no reason to draw (the sweep changed since) would mislead
    for old in [*sweep_dir.glob("objective_vs_*.png"), sweep_dir / CURVES_FILE, sweep_dir / SCALING_FILE]:
        if old.name not in written and old.exists():
            old.unlink()
    return lines


# ---- the report --------------------------------------------------------------------------------


def summary_line(sweep: Sweep) -> str:
    points = sweep.points
    finished = sum(1 for p in points if p.summary is not None and not p.pruned)
    pruned = sum(1 for p in points if p.pruned)
    missing = sum(1 for p in points if p.summary is None)
    text = f"{len(points)} point{'s' if len(points) != 1 else ''}: {finished} finished, {pruned} pruned, "
    text += f"{missing} without a summary."
    if sweep.objective_name is None and len(sweep.objectives_seen) > 1:
        return text + f" The points are judged by different objectives ({', '.join(sweep.objectives_seen)}): no best."
    if sweep.best is not None:
        best = sweep.best
        values = ", ".join(f"{k}={best.overrides.get(k, '—')}" for k in sweep.varying)
        text += f" Best ({sweep.objective_mode} {sweep.objective_name}): job {best.job}, {_fmt(best.objective, 6)}"
        text += f", with {values}." if values else "."
        text += " " + test_score_line(sweep)
    return text.rstrip()


def test_score_line(sweep: Sweep) -> str:
    """The best point's test score, the only one the report shows: a search that chose on the
    validation split shows it as the unbiased estimate; one that chose on the test set says so."""
    best = sweep.best
    if best is None or best.summary is None or sweep.objective_name is None:
        return ""
    if sweep.objective_name.startswith("test/"):
        return (
            f"It was chosen on the test set, so its {sweep.objective_name} is biased upward: give the data a "
            "validation split (data.val_fraction) and judge by val/loss."
        )
    finals = best.summary.get("final_metrics") or {}
    tests = {k: v for k, v in finals.items() if k.startswith("test/")}
    if not tests:
        return ""
    scores = ", ".join(f"{k} {_fmt(_number(v), 6)}" for k, v in sorted(tests.items()))
    return f"Its test score (evaluated once at its end, never used to choose; shown for the best point only): {scores}."


def render(sweep: Sweep, sweep_dir: Path) -> str:
    rows = scaling(sweep)
    lines = [f"# Sweep report: {sweep_dir}", "", summary_line(sweep), ""]
    if sweep.common:
        lines += ["Every point: " + " ".join(f"`{k}={v}`" for k, v in sweep.common.items()), ""]
    lines += ["## Points", "", *table(sweep), ""]
    try:
        lines += draw(sweep, sweep_dir, rows)
    except ImportError as e:
        lines += [f"No plots: {e.name or 'matplotlib'} is not installed (`pip install matplotlib`).", ""]
        if rows:
            lines += ["## Scaling", "", *scaling_table(rows, sweep.objective_name), ""]
    lines += [
        f"Made by `python -m dtf.sweep.report {sweep_dir}` from each point's `.hydra/overrides.yaml` and"
        " `summary.json`; the same command makes it again.",
    ]
    return "\n".join(lines) + "\n"


def build(sweep_dir: str | os.PathLike[str]) -> Path:
    """Write report.md and the plots into sweep_dir; return report.md's path. UserError: not a sweep."""
    path = Path(sweep_dir)
    sweep = Sweep.of(load(path))
    text = render(sweep, path)
    report = path / REPORT_FILE
    try:
        write_atomically(report, text)
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise UserError(f"cannot write {report} ({why}): give a sweep directory you can write to") from None
    return report


class SweepReport(Callback):
    """Hydra callback: when a sweep ends, build its report and say where it is. A report that cannot be
    built says why in one line and never fails the sweep."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = str(config.hydra.sweep.dir)
        try:
            report = build(sweep_dir)
        except Exception as e:  # whatever went wrong, the sweep's own outcome stands
            reason = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
            print(f"dtf: no sweep report for {sweep_dir}: {' '.join(reason.split())}", file=sys.stderr, flush=True)
            return
        print(f"dtf: sweep report: {report}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dtf.sweep.report",
        description="Write report.md and PNG plots of a sweep's points into its directory.",
    )
    parser.add_argument("sweep_dir", help="the sweep's directory (multirun/<date>/<time>, or its hydra.sweep.dir)")
    args = parser.parse_args(argv)
    try:
        report = build(args.sweep_dir)
    except UserError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    print(f"dtf: sweep report: {report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
