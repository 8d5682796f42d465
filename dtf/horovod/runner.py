"""sparkdl's HorovodRunner on dtf's launchers: `HorovodRunner(np=2).run(train_hvd, lr=0.1)`.

np > 0: a Spark barrier stage of np tasks on this process's SparkSession (dtf's Spark launcher; a
local[2] session when there is none); np < 0: -np processes on this machine (dtf's local
launcher); np = 0: as many tasks as the Spark cluster has slots. The function runs as it is on
every rank: its hvd.init() finds the rank's place (dtf.horovod.world), and rank 0's output is
streamed here. run() returns rank 0's return value, as sparkdl's does. A function that imports
`horovod.torch` inside itself gets dtf.horovod there when install() was called here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dtf.errors import UserError


class HorovodRunner:
    """np: the number of ranks (see the module doc). driver_log_verbosity: "all" also streams the
    other ranks' output (local ranks only; Spark streams rank 0's). overrides: dtf's, for the
    run (a strategy does not apply: the function wraps its own optimizer); run_dir: where the run
    writes its logs and summary.json (default outputs/<date>/<time>)."""

    def __init__(
        self,
        *,
        np: int,
        driver_log_verbosity: str = "log_callback_only",
        overrides: list[str] | None = None,
        run_dir: str | None = None,
    ) -> None:
        if driver_log_verbosity not in ("log_callback_only", "all"):
            raise UserError(
                f"HorovodRunner: driver_log_verbosity={driver_log_verbosity!r}: use 'log_callback_only' or 'all'"
            )
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity
        self.overrides = list(overrides or [])
        self.run_dir = run_dir

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """main(**kwargs) on every rank; returns rank 0's return value."""
        from dtf.api import run_function
        from dtf.horovod import installed

        return run_function(
            _Rank(main, installed()),
            mode="torchrun",
            kwargs=kwargs,
            overrides=[*self._launcher(), "trainer.progress=off", *self.overrides],
            run_dir=self.run_dir,
        )

    def _launcher(self) -> list[str]:
        np = self.num_processor
        if np < 0:
            tee = ["launcher.tee_all_ranks=true"] if self.driver_log_verbosity == "all" else []
            return ["launcher=local", f"launcher.nproc={-np}", *tee]
        return ["launcher=spark", f"launcher.nproc={np or _spark_slots()}"]


class _Rank:
    """What each rank runs: main, with `import horovod.torch` resolving to dtf.horovod where the
    driver had it so."""

    def __init__(self, main: Callable[..., Any], alias: bool) -> None:
        self.main, self.alias = main, alias

    def __call__(self, **kwargs: Any) -> Any:
        if self.alias:
            from dtf.horovod import install

            install()
        return self.main(**kwargs)


def _spark_slots() -> int:
    """np=0: every task slot of the active SparkSession's cluster."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        raise UserError("HorovodRunner(np=0) takes every slot of the active SparkSession, and there is none: give np")
    return int(spark.sparkContext.defaultParallelism)
