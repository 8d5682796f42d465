"""The search space, written in Hydra's override syntax, as Optuna distributions: parsed as
hydra-optuna-sweeper parses it (its _impl.create_optuna_distribution_from_override), so that a
search written for it means the same here.

- `choice(a, b, c)`, `shuffle(range(...))`: categorical.
- `range(start, stop[, step])`: an int distribution from start to stop, stop INCLUDED (unlike
  Hydra's basic sweeper, as in Hydra's Optuna sweeper); a float one if any of the three is a float.
- `interval(low, high)`: a float in [low, high]; `int(interval(low, high))` an int;
  `tag(log, ...)` samples either on a log scale.
- Anything else is a fixed override, passed to every trial as written (`~key` deletions too).

hydra.sweeper.search_space (hydra-optuna-sweeper 1.2's former form: key -> {type, low, high, log,
step, choices}) is read as that plugin read it, and only where params is not given.
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
        """A trial's command-line overrides: the fixed ones, then its sampled values (those of
        hydra.sweeper.custom_search_space among them)."""
        return [*self.fixed, *(f"{key}={_as_override_value(value)}" for key, value in params.items())]

    def grid(self) -> dict[str, list[Any]]:
        """Every value of each key, for Optuna's GridSampler (discrete distributions only)."""
        grid: dict[str, list[Any]] = {}
        for key, d in self.distributions.items():
            if isinstance(d, CategoricalDistribution):
                grid[key] = list(d.choices)
            elif isinstance(d, IntDistribution | FloatDistribution) and d.step is not None and not d.log:
                count = round((d.high - d.low) / d.step) + 1
                grid[key] = [d.low + i * d.step for i in range(count)]
            else:
                raise UserError(
                    f"hydra/sweeper/sampler=grid: {key} is a continuous interval; give it a choice(...) or a "
                    "range(...) with a step"
                )
        return grid


def search_space(params: dict[str, str], arguments: list[str], legacy: dict[str, Any] | None = None) -> SearchSpace:
    """hydra.sweeper.params (key -> override value) and the command line's overrides, the latter
    taking precedence for a key in both; legacy: hydra.sweeper.search_space, under them both."""
    written = {key: f"{key}={value}" for key, value in params.items()}
    for arg in arguments:
        written[key_of(arg)] = arg
    fixed: list[str] = []
    distributions = {key: distribution_of_config(key, spec) for key, spec in (legacy or {}).items()}
    for override in _parse(list(written.values())):
        key = override.get_key_element()
        if override.is_delete():
            fixed.append(override.input_line or f"~{key}")
        elif override.is_sweep_override():
            distributions[key] = distribution_of(override)
        else:
            distributions.pop(key, None)
            fixed.append(override.input_line or f"{key}={override.get_value_element_as_str()}")
    return SearchSpace(fixed, distributions)


def distribution_of(override: Override) -> BaseDistribution:
    key, value = override.get_key_element(), override.value()
    if override.is_choice_sweep() or (isinstance(value, RangeSweep) and value.shuffle):
        return _categorical(override)
    if isinstance(value, RangeSweep):
        start, stop, step = value.start, value.stop, value.step
        if start is None or stop is None or not start <= stop:
            raise UserError(f"{key}: {override.input_line} is an empty range: give stop at or beyond start")
        if any(isinstance(v, float) for v in (start, stop, step)):
            return FloatDistribution(float(start), float(stop), step=float(step) if step else None)
        return IntDistribution(int(start), int(stop), step=int(step))
    if isinstance(value, IntervalSweep):
        low, high, log = value.start, value.end, "log" in value.tags
        if low is None or high is None or not low < high:
            raise UserError(f"{key}: {override.input_line} needs interval(low, high) with low < high")
        if log and low <= 0:
            raise UserError(f"{key}: tag(log, ...) needs a positive low end, not {low}")
        # int(interval(a, b)) casts both ends: Hydra's int() of an interval
        if isinstance(low, int) and isinstance(high, int):
            return IntDistribution(low, high, log=log)
        return FloatDistribution(float(low), float(high), log=log)
    if isinstance(value, ChoiceSweep):  # a choice with a tag, e.g. tag(x, choice(...))
        return _categorical(override)
    raise UserError(
        f"{key}: {override.input_line} is not a sweep hydra/sweeper=dtf can search: use choice, range or interval"
    )


def distribution_of_config(key: str, spec: Any) -> BaseDistribution:
    """One entry of hydra.sweeper.search_space ({type: int|float|categorical, low, high, log, step,
    choices}), as hydra-optuna-sweeper 1.2 read it."""
    spec = dict(spec)
    kind = str(spec.get("type", ""))
    low, high, log, step = spec.get("low"), spec.get("high"), bool(spec.get("log", False)), spec.get("step")
    try:
        if kind == "categorical":
            return CategoricalDistribution(list(spec["choices"]))
        if kind == "int":
            return IntDistribution(int(low), int(high), log=log, step=1 if log or step is None else int(step))
        if kind == "float":
            return FloatDistribution(float(low), float(high), log=log, step=None if step is None else float(step))
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"hydra.sweeper.search_space.{key}: {e}: give type and low/high (or choices)") from None
    raise UserError(f"hydra.sweeper.search_space.{key}.type={kind or None}: use int, float or categorical")


def _categorical(override: Override) -> CategoricalDistribution:
    choices: list[Any] = list(override.sweep_iterator(transformer=Transformer.encode))
    if not all(isinstance(c, str | int | float | bool | type(None)) for c in choices):
        key = override.get_key_element()
        raise UserError(f"{key}: {override.input_line}: a choice of values, not of lists or dicts")
    return CategoricalDistribution(choices)


def key_of(line: str) -> str:
    override = _parse([line])[0]
    return f"~{override.get_key_element()}" if override.is_delete() else override.get_key_element()


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
