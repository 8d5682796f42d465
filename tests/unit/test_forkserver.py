"""The local launcher's forkserver (dtf.launch.local.preloaded_forkserver): the ranks fork from a
server that imported what they need, each run's server has that run's environment, the signals it
blocks reach the ranks, and it ends after its run."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from multiprocessing import forkserver
from multiprocessing import util as mp_util

import pytest
from omegaconf import OmegaConf

from dtf.launch.local import in_own_session, preloaded_forkserver, rank_imports, short_temp_dir

PRELOADED = "dtf_test_preloaded_module"  # written by the fixture below: nothing else imports it


@pytest.fixture(autouse=True)
def preloadable(tmp_path, monkeypatch):
    (tmp_path / f"{PRELOADED}.py").write_text("")
    # where the server finds it (multiprocessing's forkserver ignores the sys.path it is given)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))


def what_the_child_sees(conn, name: str) -> None:
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    conn.send((PRELOADED in sys.modules, os.environ.get(name), sorted(int(s) for s in mask)))


def start_and_ask(name: str, entry=what_the_child_sees) -> tuple[bool, str | None, list[int]]:
    ctx = multiprocessing.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=entry, args=(send, name))
    child.start()
    try:
        return receive.recv()
    finally:
        child.join(30)


def server_pid() -> int:
    pid = forkserver._forkserver._forkserver_pid
    assert pid is not None
    return pid


def blocked_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        (line,) = (line for line in status if line.startswith("SigBlk:"))
    return int(line.split()[1], 16)


def test_ranks_fork_from_a_server_that_imported_what_they_need_and_has_this_runs_environment(monkeypatch):
    assert PRELOADED not in sys.modules
    monkeypatch.setenv("DTF_TEST_RUN", "before")
    forkserver.ensure_running()  # one this process started before: not the run's
    seen = []
    for value in ("first", "second"):  # two runs in one process (a sweep): each server its own environment
        monkeypatch.setenv("DTF_TEST_RUN", value)
        with preloaded_forkserver("forkserver", [PRELOADED], []):
            seen.append(start_and_ask("DTF_TEST_RUN")[:2])
            seen.append(start_and_ask("DTF_FORKSERVER")[:2])  # the server's own mark, taken out
    assert seen == [(True, "first"), (True, None), (True, "second"), (True, None)]
    assert PRELOADED not in sys.modules  # imported by the server, not here


def test_the_server_blocks_the_signals_sent_to_every_process_and_a_rank_unblocks_them():
    with preloaded_forkserver("forkserver", [PRELOADED], ["SIGUSR2"]):
        blocked = blocked_signals(server_pid())
        # what a forked process inherits, and what a rank has once it runs (in_own_session)
        inherited = start_and_ask("-")[2]
        rank = start_and_ask("-", functools.partial(in_own_session, what_the_child_sees))[2]
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        assert blocked & (1 << (sig - 1)), sig.name
        assert sig in inherited
    assert rank == []


def register_an_atexit_function_and_start_a_thread(path, unused) -> None:
    import atexit
    import threading

    done = path.with_name("thread done")
    atexit.register(lambda: path.write_text("after the thread" if done.exists() else "before the thread ended"))
    threading.Thread(target=lambda: time.sleep(0.3) or done.touch()).start()  # not a daemon: waited for


def test_a_rank_runs_its_atexit_functions_as_a_spawned_one_does(tmp_path):
    # As the interpreter's exit and dtf.results.exit_now (a spawned rank's): the threads that are
    # not daemons are waited for, then the atexit functions run.
    ran = tmp_path / "ran"
    ctx = multiprocessing.get_context("forkserver")
    with preloaded_forkserver("forkserver", [PRELOADED], []):
        rank = ctx.Process(
            target=functools.partial(in_own_session, register_an_atexit_function_and_start_a_thread), args=(ran, None)
        )
        rank.start()
        rank.join(30)
    assert rank.exitcode == 0 and ran.read_text() == "after the thread"


def test_the_server_ends_after_its_run_and_nothing_is_left_behind():
    with preloaded_forkserver("forkserver", [PRELOADED], []):
        pid = server_pid()
        address = forkserver._forkserver._forkserver_address
        start_and_ask("-")
    assert forkserver._forkserver._forkserver_pid is None  # the next run starts its own
    assert not os.path.exists(address)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:  # reaped: not even a zombie
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")


def test_a_temp_dir_too_long_for_a_socket_is_not_used_for_the_servers_nor_a_ranks(tmp_path, monkeypatch):
    # A cluster's per-job TMPDIR can be long: the socket's path would pass the 107 bytes a Unix
    # socket's may have ("AF_UNIX path too long", a traceback, no run).
    long = tmp_path / ("d" * 80)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    monkeypatch.setenv("TMPDIR", str(long))  # the server's, the ranks
    monkeypatch.setitem(multiprocessing.current_process()._config, "tempdir", None)  # this process's made afresh
    short_temp_dir()
    assert os.path.dirname(mp_util.get_temp_dir()) == "/tmp" and tempfile.gettempdir() == str(long)
    with preloaded_forkserver("forkserver", [PRELOADED], []):
        # and a rank's own, where it passes tensors to its checkpoint writer (resource_sharer's socket)
        rank_temp = start_and_ask("-", functools.partial(in_own_session, the_temp_dir_the_rank_uses))[1]
    assert rank_temp is not None and os.path.dirname(rank_temp) == "/tmp"


def the_temp_dir_the_rank_uses(conn, unused) -> None:
    conn.send((True, mp_util.get_temp_dir(), []))


def test_other_start_methods_start_no_server():
    with preloaded_forkserver("spawn", [PRELOADED], []):
        assert forkserver._forkserver._forkserver_pid is None


@pytest.mark.parametrize(
    ("urls", "modules"),
    [
        ({"checkpoint": {"dir": "s3://bucket/run1", "resume": "auto"}}, ["s3fs"]),
        ({"checkpoint": {"dir": "checkpoints", "resume": "gs://bucket/run1/step_000000010"}}, ["gcsfs"]),
        ({"data": {"path": "s3://bucket/train", "test_path": "hf://datasets/owner/name"}}, ["huggingface_hub", "s3fs"]),
        ({"checkpoint": {"dir": "checkpoints"}, "data": {"path": "/data/train", "val_path": "file:///data/val"}}, []),
        ({"data": {"path": "???"}}, []),  # unset: the pre-flight check names it
    ],
)
def test_the_server_imports_the_file_system_of_each_remote_url_the_run_names(urls, modules):
    """s3fs costs 0.4 s of CPU to import: once in the server, not once a rank."""
    imported = rank_imports(OmegaConf.create(urls))
    assert [m for m in imported if m in ("s3fs", "gcsfs", "huggingface_hub")] == modules


@pytest.mark.parametrize(("metrics", "imports_torchmetrics"), [({"rmse": {}}, True), ({}, False)])
def test_the_server_imports_torchmetrics_only_for_a_run_with_metrics(metrics, imports_torchmetrics):
    cfg = OmegaConf.create({"metrics": metrics})
    assert ("torchmetrics" in rank_imports(cfg)) is imports_torchmetrics
    assert {"dtf.rank", "dtf.train.loop"} <= set(rank_imports(cfg))
