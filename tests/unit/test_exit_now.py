"""dtf.results.exit_now: what a normal exit does first still happens (threads, atexit, flushes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from dtf.results import exit_now

out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.3)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()
pool = ThreadPoolExecutor(1)  # its worker waits for threading's exit hook, as joblib's and loky's do
pool.submit(lambda: None).result()
print("buffered", end="")
exit_now(3)
"""


def test_exit_now_keeps_the_exit_status_waits_for_threads_and_runs_atexit(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
