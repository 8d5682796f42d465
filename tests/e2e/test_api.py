"""dtf from Python (dtf.run, dtf.sweep), as a user's script calls it: the same run as the command
line, twice in one process, bad input raised as one UserError with nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import SHORT_RUN
from tests.helpers.run_command import run_command

QUIET = ["trainer.progress=off", "trainer.dist_timeout_s=60"]


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Runs body in a fresh Python process (a user's script), in tmp_path; it prints JSON last."""
    return run_command([sys.executable, "-c", f"import json, dtf\n{body}"], cwd=tmp_path, timeout=300)


def test_run_from_python_is_the_command_lines_run_and_can_be_called_twice(short_local_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    overrides = [*SHORT_RUN, *QUIET]  # QUIET changes what is printed and a timeout, not what is trained
    cli = short_local_run  # SHORT_RUN from the command line, shared with other tests
    done = _script(
        tmp_path,
        f"a = dtf.run({overrides!r})\nb = dtf.run({overrides!r}, run_dir='second')\nprint(json.dumps([a, b]))",
    )
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    # the default run directory, as on the command line: outputs/<date>/<time> under the working directory
    assert Path(first["run_dir"]).parent.parent == tmp_path / "outputs"
    assert second["run_dir"] == str(tmp_path / "second")
    for summary in (first, second):
        assert (Path(summary["run_dir"]) / "summary.json").is_file()
        assert (Path(summary["run_dir"]) / ".hydra" / "overrides.yaml").is_file()
        assert summary["params_sha256"] == cli.summary["params_sha256"]  # bit for bit the command line's
        assert summary["final_test_loss"] == cli.summary["final_test_loss"]


def test_bad_input_from_python_is_one_user_error_and_writes_nothing(tmp_path: Path) -> None:
    done = _script(
        tmp_path,
        "out = []\n"
        "for overrides in (['optimizer.lr=-1'], ['model=nope'], ['nokey=1'], ['trainer.seed=1', 'launcher.env=[a']):\n"
        "    try:\n"
        "        dtf.run(overrides, run_dir='never')\n"
        "    except dtf.UserError as e:\n"
        "        out.append(str(e))\n"
        "print(json.dumps(out))",
    )
    lr, model, key, grammar = json.loads(done.stdout.strip().splitlines()[-1])
    assert lr.startswith("optimizer.lr=-1 is invalid: give a positive learning rate")
    assert "Could not find 'model/nope'" in model and "approximator" in model  # the options to pick from
    assert "nokey" in key
    assert grammar.startswith("launcher.env=[a: ")  # which override Hydra's grammar refused
    assert not (tmp_path / "never").exists() and not (tmp_path / "outputs").exists()


def test_sweep_from_python_runs_every_point_and_writes_the_report(tmp_path: Path) -> None:
    overrides = [*SHORT_RUN, *QUIET, "optimizer.lr=1e-3,3e-3"]
    done = _script(
        tmp_path,
        f"points = dtf.sweep({overrides!r}, sweep_dir='sweep')\n"
        f"alone = dtf.run({[*SHORT_RUN, *QUIET, 'optimizer.lr=3e-3']!r}, run_dir='alone')\n"
        "print(json.dumps([points, alone]))",
    )
    points, alone = json.loads(done.stdout.strip().splitlines()[-1])
    assert [p["run_dir"] for p in points] == [str(tmp_path / "sweep" / n) for n in ("0", "1")]
    lrs = [(Path(p["run_dir"]) / ".hydra" / "overrides.yaml").read_text().splitlines()[-1] for p in points]
    assert lrs == ["- optimizer.lr=0.001", "- optimizer.lr=0.003"], lrs
    assert points[1]["params_sha256"] == alone["params_sha256"]  # a point is the run with its values
    assert (tmp_path / "sweep" / "report.md").is_file()


def test_run_with_a_config_dir_of_ones_own_from_inside_a_hydra_app(tmp_path: Path) -> None:
    # A user's own option of dtf's model group (config_dir, as Hydra's --config-dir), called from the
    # user's own @hydra.main app: the app's Hydra instance is there, unchanged, after the run.
    (tmp_path / "mine" / "model").mkdir(parents=True)
    (tmp_path / "mine" / "model" / "narrow.yaml").write_text(
        "_target_: dtf.models.approximator.Approximator\nhidden: 7\n"
    )
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "app.yaml").write_text("greeting: hello\n")
    app = tmp_path / "app.py"
    app.write_text(
        "import json, hydra, dtf\n"
        "from hydra import compose\n"
        "@hydra.main(version_base='1.3', config_path='app', config_name='app')\n"
        "def main(cfg):\n"
        f"    s = dtf.run({[*SHORT_RUN, *QUIET, 'model=narrow']!r}, config_dir='{tmp_path / 'mine'}', run_dir='r')\n"
        "    print(json.dumps([s['model_state_bytes'], compose('app').greeting]))\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    done = run_command([sys.executable, str(app), f"hydra.run.dir={tmp_path / 'apprun'}"], cwd=tmp_path, timeout=300)
    state_bytes, greeting = json.loads(done.stdout.strip().splitlines()[-1])
    # Approximator(hidden=7): Linear(2,7), Linear(7,7), Linear(7,1); fp32 parameters, gradients and
    # Adam's two moments are 16 bytes a parameter, plus Adam's 4-byte step count per tensor
    assert state_bytes[0] == 16 * ((2 * 7 + 7) + (7 * 7 + 7) + (7 + 1)) + 6 * 4 and greeting == "hello"
