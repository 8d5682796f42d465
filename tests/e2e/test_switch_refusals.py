"""`python -m dtf` refuses a performance switch that cannot work as it refuses any bad input: one
line naming the key, exit status 2, no traceback, no rank started."""

from __future__ import annotations

import pytest

from tests.helpers.run_command import DtfRun


def _one_line(run: DtfRun, start: str) -> None:
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dtf: error: {start}"), run.stderr
    assert "Traceback" not in run.stderr and not (run.run_dir / "logs").exists()


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["trainer.precision=fp8"], "trainer.precision=fp8 is invalid"),
        (["strategy=fsdp", "strategy.param_dtype=bf16"], "strategy.param_dtype=bf16 is now trainer.precision"),
    ],
)
def test_a_bad_switch_is_one_line(dtf, args: list[str], start: str) -> None:  # type: ignore[no-untyped-def]
    _one_line(dtf(*args, expect=2), start)


def test_compile_where_inductor_cannot_build_is_one_line(dtf, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    _one_line(dtf("trainer.compile=blocks", expect=2), "trainer.compile=blocks needs a C++ compiler")
