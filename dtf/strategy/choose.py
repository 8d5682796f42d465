"""The choice behind strategy=auto and strategy.partition_group_size=auto: of the plans whose model
state fits, the one whose collectives the measured links carry fastest.

A pure function of what the probe measured (dtf.dist.probe), where the ranks run, the model's
bytes and the memory check's verdict on each plan, so that it is tested in process with any links.
The predicted time of a plan is its communication per step (dtf.strategy.traffic's bytes over each
link's bandwidth, plus the latency of each ring hop), taken as not overlapped with compute: the
compute is the same under every plan, so it does not change which is fastest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtf.dist.topology import Layout, Links
from dtf.strategy.traffic import Plan, per_step


@dataclass(frozen=True)
class Model:
    """The model's bytes as the collectives move them, and its sharded units (FSDP's blocks + root)."""

    param_bytes: float
    grad_bytes: float
    units: int = 1


@dataclass(frozen=True)
class Choice:
    plan: Plan
    predicted_s: dict[str, float]  # each plan that fits: its communication per step
    refused: dict[str, str] = field(default_factory=dict)  # each plan that does not fit: the memory check's why

    def describe(self) -> str:
        """Why: the chosen plan's figure beside the next best ones, and what did not fit."""
        ranked = sorted(self.predicted_s.items(), key=lambda kv: kv[1])
        best = self.predicted_s[str(self.plan)]
        others = [f"{name} {t * 1e3:.3g} ms" for name, t in ranked if name != str(self.plan)][:3]
        why = f"{best * 1e3:.3g} ms of communication per step predicted"
        if others:
            why += f" (next: {', '.join(others)})"
        if self.refused:
            why += f"; not fitting in memory: {', '.join(self.refused)}"
        return why


class NothingFits(Exception):
    """No plan's model state fits: the memory check's line for the most sharded one is the message."""


def predicted_seconds(plan: Plan, layout: Layout, links: Links, model: Model, backend: str = "gloo") -> float:
    t = per_step(plan, layout, model.param_bytes, model.grad_bytes, model.units, backend)
    seconds = 0.0
    if t.across_per_host and links.across_bytes_per_s:
        seconds += t.across_per_host / links.across_bytes_per_s + t.hops_across * links.across_latency_s
    if t.inside_per_rank and links.inside_bytes_per_s:
        seconds += t.inside_per_rank / links.inside_bytes_per_s + t.hops_inside * links.inside_latency_s
    return seconds


def choose(
    candidates: list[Plan],
    layout: Layout,
    links: Links,
    model: Model,
    verdicts: dict[str, str | None],
    backend: str = "gloo",
) -> Choice:
    """The candidate (in the order given, the first of equals) with the least predicted time among
    those the memory check lets through: verdicts maps str(plan) to None (fits) or why it does not
    (a plan missing from it fits). Raises NothingFits, with the why of the last candidate (list the
    most sharded last) when none does."""
    fitting = [p for p in candidates if verdicts.get(str(p)) is None]
    refused = {str(p): why for p in candidates if (why := verdicts.get(str(p))) is not None}
    if not fitting:
        raise NothingFits(refused[str(candidates[-1])])
    predicted = {str(p): predicted_seconds(p, layout, links, model, backend) for p in fitting}
    best = min(fitting, key=lambda p: predicted[str(p)])  # min keeps the first of equals
    return Choice(best, predicted, refused)
