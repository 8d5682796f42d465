"""What this machine offers a run: cores for its ranks to share, Java for Spark. Standard library
only: the driver, the launchers, the sweeper and the ranks ask it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dtf.errors import UserError

# Set for the ranks where dtf, not the user, chose their threads.
THREADS_CHOSEN = "DTF_THREADS_CHOSEN"


def threads_per_rank(ranks_here: int) -> int:
    """Intra-op threads for each of ranks_here ranks sharing this machine's cores: its share of
    them, so the ranks' thread pools do not fight over the cores (as torchrun sizes them). A lone
    rank gets what one of two would: on the 2-core machines dtf is measured on (shared with other
    work), two intra-op threads made one rank's steps 1.2 to 6.8 times slower than one thread did
    (docs/performance.md), and results differ between 1 and 2 threads (reduction order)."""
    return max(1, (os.cpu_count() or 1) // max(2, ranks_here))


def lone_rank_threads_note() -> str | None:
    """What a lone rank's start line says about its threads, where dtf chose them."""
    cores = os.cpu_count() or 1
    if os.environ.get(THREADS_CHOSEN) != "1" or cores < 2:
        return None
    threads = threads_per_rank(1)
    return (
        f"one rank on {cores} cores uses {threads} intra-op thread(s), as one of two ranks would "
        f"(launcher.env.OMP_NUM_THREADS={cores} to use them all)"
    )


def require_java(what: str) -> None:
    """Spark runs on the JVM: without Java it fails deep inside pyspark; say so in one line first."""
    java_home = os.environ.get("JAVA_HOME")
    if (java_home and (Path(java_home) / "bin" / "java").is_file()) or shutil.which("java"):
        return
    raise UserError(
        f"{what} needs Java, which Spark runs on, and there is none (no java on PATH, no JAVA_HOME): install a "
        "JDK or JRE 17 (e.g. apt-get install -y openjdk-17-jre-headless) or set JAVA_HOME"
    )
