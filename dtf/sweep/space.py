"""The search space, written in Hydra's override syntax, as Optuna distributions.

- `choice(a, b, c)`: categorical.
- `range(start, stop[, step])`: the values Hydra's range gives (stop excluded), as an int or
  float distribution with that step; `shuffle(range(...))` is categorical.
- `interval(low, high)`: a float in [low, high] (Hydra's interval is always float; integers
  come from a range); `tag(log, interval(...))` samples on a log scale.
- Anything else is a fixed override, passed to every trial as written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from hydra.errors import HydraException
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from dtf.errors import UserError


@dataclass(frozen=True)
class SearchSpace:
    fixed: list[str]  # overrides every trial gets, as written
    distributions: dict[str, BaseDistribution]  # key (as written, e.g. optimizer.lr or +x) -> distribution

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """A trial's command-line overrides: the fixed ones, then its sampled values."""
        return [*self.fixed, *(f"{key}={_as_override_value(params[key])}" for key in self.distributions)]


def search_space(params: dict[str, str], arguments: list[str]) -> SearchSpace:
    """hydra.sweeper.params (key -> override value) and the command line's overrides, the latter
    taking precedence for a key in both."""
    written = {key: f"{key}={value}" for key, value in params.items()}
    for arg in arguments:
        written[_parse([arg])[0].get_key_element()] = arg
    fixed: list[str] = []
    distributions: dict[str, BaseDistribution] = {}
    for override in _parse(list(written.values())):
        key = override.get_key_element()
        if override.is_sweep_override():
            distributions[key] = distribution_of(override)
        else:
            fixed.append(override.input_line or f"{key}={override.get_value_element_as_str()}")
    return SearchSpace(fixed, distributions)


def distribution_of(override: Override) -> BaseDistribution:
    key, value = override.get_key_element(), override.value()
    if override.is_choice_sweep() or (isinstance(value, RangeSweep) and value.shuffle):
        return _categorical(override)
    if isinstance(value, RangeSweep):
        start, stop, step = value.start, value.stop, value.step
        values: list[Any] = list(override.sweep_iterator())
        if not values:
            raise UserError(f"{key}: {override.input_line} is an empty range: give stop beyond start")
        if all(isinstance(v, int) for v in (start, stop, step)):
            return IntDistribution(int(values[0]), int(values[-1]), step=int(step))
        return FloatDistribution(float(values[0]), float(values[-1]), step=float(step))
    if isinstance(value, IntervalSweep):
        low, high, log = value.start, value.end, "log" in value.tags
        if low is None or high is None or not low < high:
            raise UserError(f"{key}: {override.input_line} needs interval(low, high) with low < high")
        if log and low <= 0:
            raise UserError(f"{key}: tag(log, ...) needs a positive low end, not {low}")
        return FloatDistribution(float(low), float(high), log=log)
    if isinstance(value, ChoiceSweep):  # a choice with a tag, e.g. tag(x, choice(...))
        return _categorical(override)
    raise UserError(
        f"{key}: {override.input_line} is not a sweep hydra/sweeper=dtf can search: use choice, range or interval"
    )


def _categorical(override: Override) -> CategoricalDistribution:
    choices: list[Any] = list(override.sweep_iterator(transformer=Transformer.encode))
    return CategoricalDistribution(choices)


def _parse(lines: list[str]) -> list[Override]:
    try:
        return OverridesParser.create().parse_overrides(lines)
    except HydraException as e:
        raise UserError(f"hydra.sweeper.params: {e}".splitlines()[0]) from None


def _as_override_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)  # numbers; strings are already encoded for the command line by Transformer.encode
