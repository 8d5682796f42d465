"""The suite's only skips are asked for by the user, on their own machine: never under CI."""

from __future__ import annotations

import pytest

from tests.helpers.clusters import skip_if_asked


def test_a_skip_the_user_asked_for_is_a_failure_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("DTF_SKIP_CLUSTER_TESTS", raising=False)
    with pytest.raises(pytest.fail.Exception, match=r"set DTF_SKIP_CLUSTER_TESTS=1 to skip"):
        skip_if_asked("no cluster", "DTF_SKIP_CLUSTER_TESTS", "them")
    monkeypatch.setenv("DTF_SKIP_CLUSTER_TESTS", "1")
    with pytest.raises(pytest.skip.Exception, match=r"no cluster; skipped because DTF_SKIP_CLUSTER_TESTS=1"):
        skip_if_asked("no cluster", "DTF_SKIP_CLUSTER_TESTS", "them")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"DTF_SKIP_CLUSTER_TESTS=1 is not heeded under CI"):
        skip_if_asked("no cluster", "DTF_SKIP_CLUSTER_TESTS", "them")
