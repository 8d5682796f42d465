"""What this machine offers a run: cores for its ranks to share, Java for Spark. Standard library
only: the driver, the launchers, the sweeper and the ranks ask it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dtf.errors import UserError


def threads_per_rank(ranks_here: int) -> int:
    """Intra-op threads for each of ranks_here ranks sharing this machine's cores: its share of
    them, so the ranks' thread pools do not fight over the cores (as torchrun sizes them)."""
    return max(1, (os.cpu_count() or 1) // ranks_here)


def require_java(what: str) -> None:
    """Spark runs on the JVM: without Java it fails deep inside pyspark; say so in one line first."""
    java_home = os.environ.get("JAVA_HOME")
    if (java_home and (Path(java_home) / "bin" / "java").is_file()) or shutil.which("java"):
        return
    raise UserError(
        f"{what} needs Java, which Spark runs on, and there is none (no java on PATH, no JAVA_HOME): install a "
        "JDK or JRE 17 (e.g. apt-get install -y openjdk-17-jre-headless) or set JAVA_HOME"
    )
