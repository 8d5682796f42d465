"""A config's `_target_`s: every node that has one, each importable and given only keys it takes
(the driver's pre-flight, dtf.preflight, and the ranks' check of their metrics, dtf.train.metrics)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from hydra._internal.utils import _locate
from omegaconf import DictConfig, ListConfig

from dtf.errors import UserError

# Keys Hydra's instantiate consumes itself; everything else is passed to the target.
HYDRA_KEYS = {"_target_", "_partial_", "_args_", "_recursive_", "_convert_"}


def targets(node: Any, path: str) -> Iterator[tuple[str, DictConfig]]:
    """Every config node with a _target_ below node, with its dotted path."""
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path, node
        for key in node:
            if key not in HYDRA_KEYS:
                yield from targets(node._get_node(key), f"{path}.{key!s}")
    elif isinstance(node, ListConfig) and not node._is_none():  # a list setting left null
        for i, item in enumerate(node):
            yield from targets(item, f"{path}[{i}]")


def check_target(path: str, node: DictConfig) -> None:
    target = str(node._target_)
    if target.startswith("__main__."):
        # The ranks are fresh processes that never run the script (dtf.launch.local.ranks_without_main).
        name = target.removeprefix("__main__.")
        raise UserError(
            f"{path}._target_={target} names {name} in the script that runs dtf, which the ranks do not run: put "
            f"{name} in a module of its own that they can import (a .py file next to the script, on PYTHONPATH) and "
            f"name it there, or pass it to dtf.run_function(module={name}), which ships it to the ranks"
        )
    try:
        obj = _locate(str(target))
    except Exception as e:  # _locate raises ImportError with the real cause chained
        cause = e.__cause__ or e
        raise UserError(
            f"{path}._target_={target} cannot be imported ({type(cause).__name__}: {cause}): "
            "check the dotted path, or make its module importable (install it or add it to PYTHONPATH)"
        ) from None
    if not callable(obj):
        raise UserError(f"{path}._target_={target} is not callable: point it at a class or function")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # builtins without a signature: let instantiate decide
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    for key in map(str, node):
        if key not in HYDRA_KEYS and key not in sig.parameters:
            accepted = ", ".join(n for n in sig.parameters if n != "self")
            raise UserError(
                f"{path}.{key} is not a parameter of {target} (it takes: {accepted}): "
                f"fix the name or remove it with ~{path}.{key}"
            )


def located(node: DictConfig) -> Any:
    try:
        return _locate(str(node._target_))
    except Exception:
        return None  # reported by check_target
