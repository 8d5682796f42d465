"""The one way tests run dtf's command lines (`python -m dtf`, `python -m dtf.eval`, ...), as a user
types them: with dtf's test environment (dtf_env), always under a timeout, and failing the test with
the command, its exit status and the tails of its output when it runs past that timeout or exits with
a status other than the one expected (expect: 0 unless said; a set of them; None: any, the test
looks itself).

    run_dtf(args, run_dir)            `python -m dtf <TEST_DEFAULTS> <args> hydra.run.dir=<run_dir>`
    run_command(dtf_command(...))     any such command line, to its end
    start_command(dtf_command(...))   one in the background, for tests that signal or kill it mid-run
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.sockets import descendants

HELPERS = Path(__file__).resolve().parent

# Short collectives in tests: a hang fails in seconds, not in 30 minutes.
TEST_DEFAULTS = ["trainer.dist_timeout_s=60", "trainer.progress=lines"]

TAIL = 3000  # characters of each output a failure shows

Expect = int | Collection[int] | None


def dtf_env(extra_pythonpath: Sequence[Path] = (), env: dict[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment with tests/helpers (and extra_pythonpath) on PYTHONPATH, no RANK
    inherited from an outer launcher, and env's variables set on top (None: unset)."""
    full = dict(os.environ)
    paths = [str(p) for p in extra_pythonpath] + [str(HELPERS)]
    if full.get("PYTHONPATH"):
        paths.append(full["PYTHONPATH"])
    full["PYTHONPATH"] = os.pathsep.join(paths)
    full.pop("RANK", None)  # never inherit a rank from an outer launcher
    return {k: v for k, v in {**full, **(env or {})}.items() if v is not None}


def dtf_command(
    *args: str | Path,
    module: str = "dtf",
    python: str | Path | Sequence[str] = sys.executable,
    prefix: Sequence[str] = (),
) -> list[str]:
    """`<prefix> <python> -m <module> <args>`. python: another interpreter (a side venv's), or what
    takes `-m` as it does (torchrun); prefix: what runs it (salloc, a host of local-hosts.sh)."""
    head = [str(python)] if isinstance(python, str | Path) else list(python)
    return [*prefix, *head, "-m", module, *map(str, args)]


def _fails(cmd: Sequence[str], what: str, stdout: str, stderr: str) -> AssertionError:
    return AssertionError(
        f"{what}: {shlex.join(map(str, cmd))}\n"
        f"--- stdout (last {TAIL} characters) ---\n{stdout[-TAIL:]}\n"
        f"--- stderr (last {TAIL} characters) ---\n{stderr[-TAIL:]}"
    )


def check_exit(cmd: Sequence[str], code: int, expect: Expect, stdout: str, stderr: str) -> None:
    if expect is not None and code not in ({expect} if isinstance(expect, int) else set(expect)):
        raise _fails(cmd, f"exit status {code}, expected {expect}", stdout, stderr)


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def run_command(
    cmd: Sequence[str],
    *,
    expect: Expect = 0,
    timeout: float = 240,
    cwd: Path | None = None,
    env: dict[str, str | None] | None = None,
    extra_pythonpath: Sequence[Path] = (),
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs cmd to its end (env: variables set on top of dtf_env) and returns its exit status and output."""
    try:
        done = subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            input=input,
            env=dtf_env(extra_pythonpath, env),
        )
    except subprocess.TimeoutExpired as e:
        raise _fails(cmd, f"ran past its timeout of {timeout} s", _text(e.stdout), _text(e.stderr)) from None
    check_exit(cmd, done.returncode, expect, done.stdout, done.stderr)
    return done


class Started(subprocess.Popen[bytes]):
    """A command start_command started: its stdout goes to log, its stderr too or to err. Leaving
    its `with` block kills what of it still runs (its whole session, if it has one of its own)."""

    def __init__(self, cmd: Sequence[str], log: Path, err: Path | None, new_session: bool, **kw: Any) -> None:
        self.cmd, self.log, self.err, self.new_session = list(cmd), log, err, new_session
        with open(log, "w") as out, open(err or os.devnull, "w") as errors:
            stderr = errors if err else subprocess.STDOUT
            super().__init__(self.cmd, stdout=out, stderr=stderr, start_new_session=new_session, **kw)

    def output(self) -> str:
        return self.log.read_text()

    def error_output(self) -> str:
        """What it wrote to stderr (to log, without an err of its own)."""
        return (self.err or self.log).read_text()

    def finish(self, expect: Expect = 0, timeout: float = 240) -> int:
        """Waits for its end and returns its exit status (expect as run_command's)."""
        try:
            code = self.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise _fails(self.cmd, f"ran past its timeout of {timeout} s", self.output(), self.error_output()) from None
        check_exit(self.cmd, code, expect, self.output(), self.error_output() if self.err else "")
        return code

    def stop(self) -> None:
        """Kills what of it still runs (with SIGKILL) and waits for it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.new_session:
                self.kill_everything()
            elif self.poll() is None:
                self.kill()
        self.wait()

    def kill_everything(self) -> None:
        """SIGKILL to it and to every process it started, at once, as a lost host: its ranks too,
        which run in sessions of their own (dtf.launch.local.in_own_session), so that a kill of its
        process group alone leaves them to end on their own a moment later (torch sends them SIGINT
        when their parent dies), and a save already under way may still land. Returns once all
        are gone. Each is stopped first, so that none starts another while the tree is walked."""
        stopped: set[int] = set()
        while fresh := [p for p in {self.pid, *descendants(self.pid)} if p not in stopped]:
            for pid in fresh:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            stopped.update(fresh)
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(is_running(pid) for pid in stopped - {self.pid}) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.wait()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        super().__exit__(*exc)


def is_running(pid: int) -> bool:
    """Whether pid is alive (a zombie is not: it has ended, its parent has not collected it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def start_command(
    cmd: Sequence[str],
    log: Path,
    *,
    err: Path | None = None,
    new_session: bool = False,
    cwd: Path | None = None,
    env: dict[str, str | None] | None = None,
) -> Started:
    """Starts cmd in the background (in a session of its own with new_session, so that a kill of its
    process group takes all it started), with run_command's environment; use it in a `with` block."""
    return Started(cmd, log, err, new_session, cwd=cwd, env=dtf_env(env=env))


@dataclass
class DtfRun:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())


def run_dtf(
    args: Sequence[str],
    run_dir: Path,
    *,
    multirun: bool = False,
    options: Sequence[str] = (),
    expect: Expect = 0,
    timeout: float = 240,
    python: str | Path | Sequence[str] = sys.executable,
    prefix: Sequence[str] = (),
    env: dict[str, str | None] | None = None,
    extra_pythonpath: Sequence[Path] = (),
) -> DtfRun:
    """`python -m dtf <options> [-m] <TEST_DEFAULTS> <args>` into run_dir (hydra.sweep.dir with multirun),
    from run_dir's parent. options: Hydra's (--config-dir=...), which go before any override; python
    and prefix: as dtf_command's."""
    where = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    argv = [*options, *(["-m"] if multirun else []), *TEST_DEFAULTS, *args, where]
    cmd = dtf_command(*argv, python=python, prefix=prefix)
    done = run_command(
        cmd, expect=expect, timeout=timeout, cwd=run_dir.parent, env=env, extra_pythonpath=extra_pythonpath
    )
    return DtfRun(done.returncode, done.stdout, done.stderr, run_dir)


def require_unshare(for_what: str) -> None:
    """Fails the test where `unshare -rm` (user and mount namespaces: a tmpfs of a test's own, no
    root) does not work; skips it instead, saying why, only outside CI with DTF_SKIP_UNSHARE=1."""
    import shutil

    from tests.helpers.clusters import skip_if_asked

    if shutil.which("unshare") is not None and subprocess.run(["unshare", "-rm", "true"]).returncode == 0:
        return
    skip_if_asked(f"needs unshare -rm (user and mount namespaces) to {for_what}", "DTF_SKIP_UNSHARE", "these tests")
