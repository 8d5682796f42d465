"""benchmarks/topology.py refuses, in one line and before it touches a link, where it cannot run:
without root (namespaces and tc need it) and without tc. Its measurements: the smoke run in
tests/e2e/test_multinode.py."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers.run_command import run_command

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "topology.py"


def test_without_root_it_says_so_in_one_line() -> None:
    done = run_command(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, str(BENCH)], expect=1
    )
    assert done.stderr.strip() == "benchmarks/topology.py: needs root (network namespaces and tc): run it with sudo"


def test_without_tc_it_says_so_in_one_line(tmp_path: Path) -> None:
    done = run_command([sys.executable, str(BENCH), "--smoke"], expect=1, env={"PATH": str(tmp_path)})
    assert done.stderr.strip() == "benchmarks/topology.py: needs tc and ip (iproute2): apt-get install iproute2"
