"""Evaluate a run's checkpoint on its validation and/or test split, on any world size and strategy:
`python -m dtf.eval <run dir | checkpoint> [--split val|test|all] [overrides...]` and
`dtf.evaluate(...)`. The run's config is composed again from its recorded overrides (its
.hydra/overrides.yaml) and yours (strategy=ddp launcher.nproc=1, ...); the ranks build the model
and the data as the run did, load the model's weights from the checkpoint (DCP reshards them onto
this world size and strategy), and evaluate exactly as training does: every sample counted once,
(sum, count) reduced over the ranks. Rank 0 writes eval.json into the checkpoint's folder.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtf.errors import UserError
from dtf.train.evaluate import SPLITS, EvalRequest


@dataclass(frozen=True)
class Target:
    """A checkpoint and the run directory whose config made it."""

    checkpoint: Path
    run_dir: Path


def locate(target: str | Path) -> Target:
    """A run directory (its newest committed checkpoint) or a checkpoint folder (the run directory
    is the nearest parent with a .hydra/ record). UserError when there is none."""
    from dtf.train.checkpoint import committed, is_complete

    path = Path(target).resolve()
    if not path.exists():
        raise UserError(f"{target} does not exist: give a run directory or one of its checkpoints (step_*)")
    if (path / ".hydra" / "overrides.yaml").is_file():
        run_dir = path
        found = [c for d in sorted(path.iterdir()) if d.is_dir() for c in committed(d)]
        if not found:
            raise UserError(f"{target} has no committed checkpoint: evaluate a run that saved one (checkpoint.at_end)")
        return Target(_undamaged(max(found, key=lambda c: c.name)), run_dir)
    complete, why = is_complete(path)
    if not complete:
        raise UserError(f"{target} is not a committed checkpoint ({why}): give a run directory or a step_* folder")
    for parent in path.parents:
        if (parent / ".hydra" / "overrides.yaml").is_file():
            return Target(_undamaged(path), parent)
    raise UserError(f"no run directory (with .hydra/overrides.yaml) holds {target}: evaluate a checkpoint of a dtf run")


def _undamaged(checkpoint: Path) -> Path:
    """The checkpoint, once every file's checksum is the one its commit recorded (as a resume and
    an export check it): damaged weights are never evaluated."""
    from dtf.train.checkpoint import verify

    ok, why = verify(checkpoint)
    if not ok:
        raise UserError(f"{checkpoint} cannot be evaluated: {why}; evaluate another of the run's checkpoints (step_*)")
    return checkpoint


def config_of(target: Target, overrides: list[str], config_dir: str | None = None) -> Any:
    """The run's config composed again: its recorded overrides, then these. Checkpoints are
    neither resumed nor written, and nothing is exported."""
    import yaml

    from dtf.api import _compose

    recorded = yaml.safe_load((target.run_dir / ".hydra" / "overrides.yaml").read_text()) or []
    cfg, _, _ = _compose([*map(str, recorded), *overrides], config_dir, "run")
    return cfg


def evaluate(
    target: str | Path,
    split: str = "all",
    overrides: list[str] | None = None,
    *,
    config_dir: str | None = None,
) -> dict[str, Any]:
    """Evaluate a run directory (its newest checkpoint) or a checkpoint on split (val, test or all:
    those the data has), with the run's config and these overrides; returns eval.json's record
    ({"metrics": {"val/loss": ...}, ...}). Raises dtf.UserError for bad input."""
    from dtf.cli import freeze, launch_frozen
    from dtf.files import make_dir
    from dtf.rank import rank_main
    from dtf.results import Finished

    if split not in ("all", *SPLITS):
        raise UserError(f"split={split}: choose val, test or all")
    found = locate(target)
    frozen = freeze(config_of(found, list(overrides or []), config_dir))
    # The launcher's own files (logs, failures) go to a directory of this evaluation, not the run's.
    stamp = time.strftime("%Y%m%d-%H%M%S")
    eval_dir = make_dir(found.run_dir / "evaluations" / f"{found.checkpoint.name}-{stamp}", "the run directory")
    request = EvalRequest(str(found.checkpoint), ("all",) if split == "all" else (split,))
    rank_fn = functools.update_wrapper(functools.partial(rank_main, evaluate=request), rank_main)
    result = launch_frozen(frozen, str(eval_dir), rank_fn)
    if not isinstance(result, Finished):
        raise UserError(f"the evaluation of {found.checkpoint} did not finish ({result!r})")
    return result.summary


# ---- python -m dtf.eval ----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from dtf.results import EXIT_USER_ERROR

    parser = argparse.ArgumentParser(
        prog="python -m dtf.eval",
        description=(
            "Evaluate a run's checkpoint on its validation and/or test split, with the run's config and your "
            "overrides (e.g. strategy=ddp launcher.nproc=1); writes eval.json into the checkpoint's folder."
        ),
    )
    parser.add_argument("target", help="a run directory (its newest checkpoint) or a checkpoint folder (step_*)")
    parser.add_argument("--split", default="all", choices=["val", "test", "all"], help="default: all the data has")
    parser.add_argument("overrides", nargs="*", help="config overrides, as after python -m dtf")
    args = parser.parse_intermixed_args(argv)  # --split anywhere among the overrides
    try:
        evaluate(args.target, args.split, args.overrides)
    except UserError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    # Through the module's own name: its classes travel to the ranks as dtf.eval's, not __main__'s.
    from dtf.eval import main as _main

    sys.exit(_main())
