"""`python -m dtf.horovod -np 2 python train_hvd.py [args]`: horovodrun's command, on dtf's local
launcher. Each rank runs the script as its __main__ with those args; hvd.init() in it finds its
place (dtf.horovod.world). dtf's overrides for the run go before the command:
`python -m dtf.horovod -np 2 launcher.tee_all_ranks=true python train_hvd.py`. A rank that fails
ends the others, and the command with exit status 1 (2 for bad input), as `python -m dtf` does.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from dtf.errors import RankFailedError, UserError
from dtf.results import EXIT_FAILED, EXIT_USER_ERROR


def run_script(path: str, argv: list[str]) -> None:
    """What every rank runs: the script as __main__, with its own command line."""
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dtf.horovod",
        description="Run a Horovod-style script on N local ranks (as horovodrun -np N python script.py).",
    )
    parser.add_argument("-np", "--num-proc", type=int, required=True, dest="np", help="the number of ranks")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="[dtf overrides] python script.py [args]")
    args = parser.parse_args(argv)
    pythons = [i for i, a in enumerate(args.rest) if os.path.basename(a).startswith("python")]
    if args.np < 1 or not pythons or len(args.rest) <= pythons[0] + 1:
        parser.error("give the ranks and the command: -np 2 python train_hvd.py [its arguments]")
    at = pythons[0]
    overrides, script, script_args = args.rest[:at], args.rest[at + 1], args.rest[at + 2 :]
    if not os.path.isfile(script):
        print(f"dtf: error: {script} is not a file: give the Python script to run", file=sys.stderr)
        return EXIT_USER_ERROR
    from dtf.horovod.runner import HorovodRunner

    runner = HorovodRunner(np=-args.np, overrides=overrides)
    try:
        runner.run(run_script, path=os.path.abspath(script), argv=script_args)
    except RankFailedError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except UserError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
