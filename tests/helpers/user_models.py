"""Stand-ins for a user's own module outside dtf: models, datasets and step functions that
tests plug in by _target_ (this folder is put on PYTHONPATH by the tests)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset


class FailingModel(nn.Module):
    """Fails on one rank at its n-th forward (training and evaluation calls both count; with at_eval,
    its n-th evaluation call): how = "raise", "user_error" (raises dtf's UserError), "kill" (dies of
    SIGKILL), "oom" (takes memory until the OOM killer ends it), "hang" (never returns; writes the time
    it hung to fill_path, if given), "remove"
    (deletes the file fill_path), "fill_disk"
    (fills the file system of fill_path with a file there, then goes on), "SIG<NAME>" (sends
    itself that signal) or "agent:SIG<NAME>" (sends it to its parent, the launcher's agent).
    eval_delay_s: every evaluation forward sleeps that long.
    With raise_after_signal, a rank that sent a signal raises at its next forward (a crash after a
    stop request). With abort_at_exit, a rank that raised a user error dies of SIGABRT on its way
    out. With first_attempt_only, only the first attempt fails (a restarted run goes through).
    Every forward sleeps delay_s (after a signal at least 50 ms), so that outside events
    can land in the middle of a run; with slow_while, only while that file exists (the test
    removes it to let the run finish at full speed)."""

    def __init__(
        self,
        fail_rank: int = 1,
        fail_at_call: int = 3,
        how: str = "raise",
        first_attempt_only: bool = False,
        delay_s: float = 0.0,
        raise_after_signal: bool = False,
        abort_at_exit: bool = False,
        at_eval: bool = False,
        eval_delay_s: float = 0.0,
        fill_path: str | None = None,
        slow_while: str | None = None,
        **unused: object,
    ) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.fail_rank, self.fail_at_call, self.how = fail_rank, fail_at_call, how
        self.first_attempt_only = first_attempt_only
        self.delay_s = delay_s
        self.raise_after_signal = raise_after_signal
        self.abort_at_exit = abort_at_exit
        self.at_eval, self.eval_delay_s, self.fill_path = at_eval, eval_delay_s, fill_path
        self.slow_while = slow_while
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and self.eval_delay_s:
            time.sleep(self.eval_delay_s)
        if not (self.at_eval and self.training):  # with at_eval, only evaluation calls count
            self.calls += 1
            self._inject()
        if self.delay_s and (self.slow_while is None or os.path.exists(self.slow_while)):
            time.sleep(self.delay_s)
        return self.lin(x)

    def _inject(self) -> None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        armed = not self.first_attempt_only or attempt == 0
        mine = armed and int(os.environ.get("RANK", "0")) == self.fail_rank
        if mine and self.raise_after_signal and self.calls == self.fail_at_call + 1:
            raise RuntimeError(f"injected failure on rank {self.fail_rank} after a stop signal")
        if mine and self.calls == self.fail_at_call:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.how == "oom":  # takes memory until the kernel's OOM killer ends it
                hog = []
                while True:
                    hog.append(b"\x01" * (64 << 20))  # written, so resident
            elif self.how == "hang":
                if self.fill_path is not None:  # when it hung, for the test to time what follows
                    Path(self.fill_path).write_text(str(time.time()))
                threading.Event().wait()
            elif self.how == "remove":  # a file of the run's data, say, gone from under it
                assert self.fill_path is not None, "how=remove needs fill_path"
                os.remove(self.fill_path)
            elif self.how == "fill_disk":
                assert self.fill_path is not None, "how=fill_disk needs fill_path"
                fill(self.fill_path)
            elif self.how.startswith(("SIG", "agent:SIG")):
                target = agent_pid() if self.how.startswith("agent:") else os.getpid()
                os.kill(target, signal.Signals[self.how.split(":")[-1]])
                self.delay_s = max(self.delay_s, 0.05)  # the run must not end before the signal is acted on
            elif self.how == "user_error":
                from dtf.errors import UserError

                if self.abort_at_exit:  # as a process group torn down with a collective in flight does
                    from multiprocessing.util import Finalize

                    Finalize(None, os.abort, exitpriority=0)

                raise UserError(f"model.fail_rank={self.fail_rank}: injected bad input; fix model.fail_rank")
            else:
                raise RuntimeError(f"injected failure on rank {self.fail_rank}")


def agent_pid() -> int:
    """The process that started this rank: torch's agent, the rank's multiprocessing parent (not its
    OS parent when it was forked from the run's forkserver); a rank of srun or torchrun: its parent."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getppid()


def fill(path: str) -> None:
    """Writes zeros to path until its file system has no space left."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 20))
                f.flush()
        except OSError:
            pass


def one_sample(**unused: object) -> TensorDataset:
    return TensorDataset(torch.zeros(1, 2), torch.zeros(1, 1))


def encoder_head_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], loss_fn):  # type: ignore[no-untyped-def]
    """A step function over several modules (a ModuleDict): what a loss alone cannot express."""
    x, y = batch
    return loss_fn(model["head"](model["encoder"](x)), y)


class ThreadsReport(nn.Linear):
    """A linear model that, when a rank builds it, writes what the rank runs its ops with:
    <report_dir>/threads_<rank>.json = {"OMP_NUM_THREADS": ..., "torch_threads": ..., "own_session": ...}."""

    def __init__(self, report_dir: str, in_features: int = 2, out_features: int = 1, **unused: object) -> None:
        super().__init__(in_features, out_features)
        import json
        from pathlib import Path

        seen = {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(),
            "own_session": os.getsid(0) == os.getpid(),
        }
        (Path(report_dir) / f"threads_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))


class ListeningSockets(nn.Linear):
    """A linear model whose ranks, at their at_call-th forward (every store and process group is
    listening by then), write the TCP sockets their run listens on, seen from the rank's network
    namespace: its parent (the launcher's agent, the driver) and every process below that, to
    <report_dir>/sockets_<rank>.json as [[pid, address, port], ...]."""

    def __init__(
        self, report_dir: str, at_call: int = 5, in_features: int = 2, out_features: int = 1, **unused: object
    ):
        super().__init__(in_features, out_features)
        self.report_dir, self.at_call, self.calls = report_dir, at_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at_call:
            import json
            from pathlib import Path

            from sockets import descendants, listening

            driver = agent_pid()
            found = listening([driver, *descendants(driver)])
            (Path(self.report_dir) / f"sockets_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(found))
        return super().forward(x)


class NonFiniteModel(nn.Linear):
    """A linear model (2 -> 1) that, at its at_call-th training forward (or each of a list of
    them) on the ranks named (all: every rank), makes the step non-finite: how = "nan_loss" (its
    outputs, hence the loss, NaN), "inf_loss" (outputs so large that the loss overflows to inf
    while its gradients stay finite), "nan_grad" (a finite loss whose gradients are NaN) or
    "zero_grad" (gradients 0: a step that changes nothing under plain SGD, the reference a
    skipped step must equal)."""

    def __init__(
        self, at_call: int | list[int], how: str = "nan_loss", ranks: list[int] | None = None, **unused: object
    ):
        super().__init__(2, 1)
        self.at_calls = [at_call] if isinstance(at_call, int) else list(at_call)
        self.how, self.ranks, self.calls = how, ranks, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not self.training:
            return out
        self.calls += 1
        if self.calls not in self.at_calls or (
            self.ranks is not None and int(os.environ.get("RANK", "0")) not in self.ranks
        ):
            return out
        if self.how == "nan_loss":
            return out * float("nan")
        if self.how == "inf_loss":
            return out.detach() * 0 + 1e30 + out * 0  # (1e30 - y)^2 overflows; the gradient 2(1e30 - y)/n does not
        if out.requires_grad:
            fill = float("nan") if self.how == "nan_grad" else 0.0
            out.register_hook(lambda grad: torch.full_like(grad, fill))
        return out


class RandomInEvaluation(nn.Linear):
    """A linear model (2 -> 1) with dropout on its inputs in training, which draws a random number
    at every evaluation forward (as test-time augmentation would): what training does after an
    evaluation depends on the random streams the evaluation drew from."""

    def __init__(self, **unused: object) -> None:
        super().__init__(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            torch.rand(1)
        return super().forward(nn.functional.dropout(x, 0.5, self.training))
