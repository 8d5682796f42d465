"""A memory cgroup of a test's own, below the test's, with a limit: what a container or a SLURM job's
cgroup is to the processes in it, and where the kernel's OOM killer acts when they use too much."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from dtf.launch.oom import CGROUP_ROOT


def _own_memory_cgroup() -> tuple[Path, str] | None:
    """This process's memory cgroup directory and its version ("v1", "v2"), where its children get
    the memory controller."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if "memory" in controllers.split(","):
            here = CGROUP_ROOT / "memory" / relative
            if (here / "memory.limit_in_bytes").is_file():
                return here, "v1"
        elif controllers == "":
            for here in (CGROUP_ROOT / relative, CGROUP_ROOT / "unified" / relative):
                with contextlib.suppress(OSError):
                    if "memory" in (here / "cgroup.subtree_control").read_text().split():
                        return here, "v2"
    return None


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[Path]:
    """A new cgroup with a memory limit (and no swap): a process joins it by writing its pid to its
    cgroup.procs (see joining). Removed once its processes are gone."""
    from tests.helpers.clusters import skip_if_asked

    own = _own_memory_cgroup()
    if own is None or not os.access(own[0], os.W_OK):
        why = "needs a memory cgroup of its own (cgroup v1's memory controller, or v2's delegated to it)"
        skip_if_asked(why, "DTF_SKIP_UNSHARE", "these tests")
    parent, version = own
    cgroup = parent / f"dtf-test-{os.getpid()}-{time.monotonic_ns()}"
    cgroup.mkdir()
    try:
        if version == "v1":
            (cgroup / "memory.limit_in_bytes").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):  # no swap accounting: the limit above is all there is
                (cgroup / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        else:
            (cgroup / "memory.max").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):
                (cgroup / "memory.swap.max").write_text("0")
        yield cgroup
    finally:
        deadline = time.monotonic() + 30
        while (cgroup / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)  # its last processes are still exiting
        cgroup.rmdir()


def joining(cgroup: Path) -> list[str]:
    """A command prefix: the command runs in that cgroup (and so do the processes it starts)."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup)]
