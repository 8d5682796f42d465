"""How many intra-op threads a rank gets (dtf.machine): its share of the machine's cores, a lone
rank what one of two would (two threads made a lone rank's steps slower on the 2-core machines dtf
is measured on: docs/performance.md), and the start line says so where dtf chose them."""

from __future__ import annotations

import pytest

from dtf import machine


@pytest.mark.parametrize(
    ("cores", "ranks", "threads"), [(2, 1, 1), (2, 2, 1), (2, 4, 1), (8, 1, 4), (8, 2, 4), (8, 4, 2)]
)
def test_each_rank_gets_its_share_and_a_lone_rank_half(
    monkeypatch: pytest.MonkeyPatch, cores: int, ranks: int, threads: int
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert machine.threads_per_rank(ranks) == threads


def test_a_lone_rank_says_how_many_threads_it_uses_when_dtf_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.delenv(machine.THREADS_CHOSEN, raising=False)
    assert machine.lone_rank_threads_note() is None  # the user's own OMP_NUM_THREADS: nothing to say
    monkeypatch.setenv(machine.THREADS_CHOSEN, "1")
    assert machine.lone_rank_threads_note() == (
        "one rank on 2 cores uses 1 intra-op thread(s), as one of two ranks would "
        "(launcher.env.OMP_NUM_THREADS=2 to use them all)"
    )
