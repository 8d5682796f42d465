"""`python -m dtf model=hf` refuses a folder it cannot build a model from as it refuses any bad
input: one line naming the key, exit status 2, no traceback, nothing written, no rank started.
(Every refusal's line: tests/unit/test_hf_model.py.)"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.run_command import DtfRun


def test_a_folder_without_config_json_is_one_line(dtf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "weights_only").mkdir()
    run: DtfRun = dtf("model=hf", f"model.name_or_path={tmp_path / 'weights_only'}", expect=2)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    key = f"model.name_or_path={tmp_path / 'weights_only'}"
    assert lines[0].startswith(f"dtf: error: {key}: the folder has no config.json"), lines[0]
    assert "Traceback" not in run.stderr
    assert not (run.run_dir / "logs").exists() and not (run.run_dir / "hf").exists()
