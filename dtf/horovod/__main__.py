"""`python -m dtf.horovod -np 2 python train_hvd.py [args]`: horovodrun's command, on dtf's local
launcher. Each rank runs the script as its __main__ with those args; hvd.init() in it finds its
place (dtf.horovod.world). `python -m module [args]` runs a module the same way, as python
does (the working directory first on sys.path): `python -m dtf.horovod -np 2 python -m pytest
test_x.py` runs a user's Horovod tests on 2 ranks, as horovodrun does. A rank whose script or
module exits non-zero (sys.exit, pytest's failures) fails the command. dtf's overrides for the
run go before the command:
`python -m dtf.horovod -np 2 launcher.tee_all_ranks=true python train_hvd.py`. A rank that
fails ends the others, and the command with exit status 1 (2 for bad input), as `python -m dtf`
does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
from collections.abc import Iterator
from typing import Any

from dtf.errors import RankFailedError, UserError
from dtf.results import EXIT_FAILED, EXIT_USER_ERROR


def run_script(path: str, argv: list[str]) -> None:
    """What every rank runs: the script as __main__, with its own command line."""
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    with _exit_status(f"python {path}"):
        runpy.run_path(path, run_name="__main__")


def run_module(module: str, argv: list[str], cwd: str) -> None:
    """What every rank runs for `python -m module args`: the module as __main__, as python runs
    it (sys.argv[0] its file, the working directory first on sys.path)."""
    os.chdir(cwd)
    sys.argv = ["-m", *argv]  # run_module puts the module's file in sys.argv[0]
    sys.path.insert(0, cwd)
    with _exit_status(f"python -m {module}"):
        runpy.run_module(module, run_name="__main__", alter_sys=True)


@contextlib.contextmanager
def _exit_status(command: str) -> Iterator[None]:
    """sys.exit(0) (or None) ends the rank as done; another status fails it, with that status."""
    try:
        yield
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"{command} exited with status {e.code}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dtf.horovod",
        description="Run a Horovod-style script on N local ranks (as horovodrun -np N python script.py).",
    )
    parser.add_argument("-np", "--num-proc", type=int, required=True, dest="np", help="the number of ranks")
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER, help="[dtf overrides] python script.py [args] (or python -m module [args])"
    )
    args = parser.parse_args(argv)
    pythons = [i for i, a in enumerate(args.rest) if os.path.basename(a).startswith("python")]
    if args.np < 1 or not pythons or len(args.rest) <= pythons[0] + 1:
        parser.error("give the ranks and the command: -np 2 python train_hvd.py [its arguments]")
    at = pythons[0]
    overrides, script, script_args = args.rest[:at], args.rest[at + 1], args.rest[at + 2 :]
    if script == "-m":
        if not script_args:
            parser.error("give the module to run: -np 2 python -m pytest [its arguments]")
        target: Any = run_module
        kwargs: dict[str, Any] = dict(module=script_args[0], argv=script_args[1:], cwd=os.getcwd())
    elif not os.path.isfile(script):
        print(
            f"dtf: error: {script} is not a file: give the Python script to run (or -m and a module)",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    else:
        target, kwargs = run_script, dict(path=os.path.abspath(script), argv=script_args)
    from dtf.horovod.runner import HorovodRunner

    runner = HorovodRunner(np=-args.np, overrides=overrides)
    try:
        runner.run(target, **kwargs)
    except RankFailedError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except UserError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
