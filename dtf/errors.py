"""Errors a user can cause; the CLI prints them as one line, without a traceback."""


class UserError(Exception):
    """A bad setting or input: the message names the key and the fix."""


class RankFailedError(UserError):
    """One or more ranks of a distributed run failed; the message names them."""
