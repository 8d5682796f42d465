"""benchmarks/topology.py refuses, in one line and before it touches a link, where it cannot run:
without root (namespaces and tc need it) and without tc. Its measurements: the smoke run in
tests/e2e/test_multinode.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers.run_command import run_command

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "topology.py"


def test_without_root_it_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # In process, as a user that is not root: an interpreter outside the system's (pyenv's, under
    # /root) cannot even start as another user (setpriv --reuid), whatever the benchmark does.
    spec = importlib.util.spec_from_file_location("topology", BENCH)
    assert spec is not None and spec.loader is not None
    topology = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(BENCH.parent))  # its own imports (common)
    monkeypatch.setitem(sys.modules, "topology", topology)  # where its dataclasses look themselves up
    spec.loader.exec_module(topology)
    monkeypatch.setattr(topology.os, "geteuid", lambda: 65534)
    monkeypatch.setattr(sys, "argv", [str(BENCH)])
    with pytest.raises(SystemExit) as refused:
        topology.main()
    # sys.exit with a message: printed on stderr, exit status 1
    assert refused.value.code == "benchmarks/topology.py: needs root (network namespaces and tc): run it with sudo"


def test_without_tc_it_says_so_in_one_line(tmp_path: Path) -> None:
    done = run_command([sys.executable, str(BENCH), "--smoke"], expect=1, env={"PATH": str(tmp_path)})
    assert done.stderr.strip() == "benchmarks/topology.py: needs tc and ip (iproute2): apt-get install iproute2"
