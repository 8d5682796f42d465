"""Errors a user can cause; the CLI prints them as one line, without a traceback."""


class UserError(Exception):
    """A bad setting or input: the message names the key and the fix."""

    # Raised alike by every rank at the same point (a checkpoint that does not fit the model, a full
    # disk): the driver names no rank, which would only be whichever happened to record first.
    every_rank = False


class EveryRankUserError(UserError):
    """Bad input that every rank finds at once."""

    every_rank = True


class TrainingFailed(Exception):
    """The run cannot go on, and it is neither bad input nor a bug (training diverged): one line
    without a traceback, exit status 1. Every rank raises it at the same step."""

    every_rank = True


class RankFault(Exception):
    """A rank cannot go on, for a cause outside the run's settings and code (a process it reads its
    data with was killed): one line naming the cause, without a traceback, exit status 1; the
    driver names the rank."""


def require(ok: bool, key: str, value: object, rule: str) -> None:
    """The one-line refusal of a bad setting: `key=value is invalid: rule` (rule says the fix)."""
    if not ok:
        raise UserError(f"{key}={value} is invalid: {rule}")


class RankFailedError(UserError):
    """One or more ranks of a distributed run failed; the message names them."""


class TooFewNodes(RankFailedError):
    """An elastic run's nodes could not meet its MIN (at the start, or after losing some)."""


def user_error_in(e: BaseException) -> UserError | None:
    """The UserError behind e, if any: Hydra's instantiate wraps what a _target_ raises."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, UserError):
            return seen
        seen = seen.__cause__
    return None


class Interrupted(Exception):
    """A signal that is not a stop request (Ctrl-C, SIGHUP, ...) ended the run: the ranks were
    stopped where they were. checkpoint: the newest complete one on disk, if any."""

    def __init__(self, signal_name: str, checkpoint: str | None = None, step: int | None = None) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.checkpoint = checkpoint
        self.step = step
