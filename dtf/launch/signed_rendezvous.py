"""The c10d rendezvous' state, signed with a secret that only the run's nodes hold.

torch elastic's c10d rendezvous keeps its state in a TCPStore, pickled, and every node's agent
unpickles what it reads there. The store takes no credential: anyone who reaches its port can
write that key, and an unpickled value can run any code. Here each value is written with an
HMAC-SHA256 over the key and the state, under the run's secret, and a value whose HMAC does not
match is refused before anything unpickles it (ForeignStateError). Without the secret nobody can
write a state the nodes accept; what remains is that the store is plain TCP, so a stranger who
reaches it can still disturb a run (stop it), though not run anything in it: the network must be
the cluster's (docs/launchers.md).

The secret: one node's run makes a fresh one in memory (its agent is the only reader); the nodes of
a multi-node run share one through the run directory, which they share anyway (a file readable by
the user alone, made by whichever node comes first).
"""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import stat
from base64 import b64decode, b64encode
from collections.abc import Callable, Iterator
from pathlib import Path

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import Token

from dtf.errors import UserError

SECRET_FILE = ".dtf-rendezvous.key"  # in the run directory
REFUSED_FILE = Path("logs") / "rendezvous_refused.txt"  # a node's refusal, for the run's other nodes
_SECRET_BYTES = 32
_FORMAT = b"dtf1"  # <format>:<hex HMAC>:<base64 state>
_NULL_STATE = b""  # what the store holds before the first node writes a state
# The running rendezvous' secrets and what a refusal does, by run id (the agent runs in this process).
_secrets: dict[str, tuple[bytes, Callable[[ForeignStateError], None]]] = {}


class ForeignStateError(RendezvousStateError):
    """The store holds a value that no node of this run wrote: refused, never unpickled."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"the rendezvous store holds under {key} a value that no node of this run wrote (its HMAC does not "
            "match the run's secret): someone outside the run wrote to the store"
        )
        self.key = key


def sign(secret: bytes, key: str, state: bytes) -> bytes:
    """What the store holds for state under key (ASCII)."""
    mac = hmac.new(secret, key.encode() + b"\0" + state, hashlib.sha256).hexdigest().encode()
    return b":".join((_FORMAT, mac, b64encode(state)))


def verify(secret: bytes, key: str, stored: bytes) -> bytes:
    """The state in a value the store holds under key, once its HMAC matches; ForeignStateError if not."""
    try:
        form, _, encoded = stored.split(b":")
        state = b64decode(encoded, validate=True)
    except (ValueError, binascii.Error):
        raise ForeignStateError(key) from None
    if form != _FORMAT or not hmac.compare_digest(sign(secret, key, state), stored):
        raise ForeignStateError(key)
    return state


class SignedC10dBackend(C10dRendezvousBackend):
    """torch's C10dRendezvousBackend (same store, same key, same compare-and-set protocol), with
    every value signed on the way in and verified on the way out, before dynamic_rendezvous
    unpickles it. The token (what a node last read, for compare_set) is the signed value."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        secret: bytes,
        name: str,
        on_refused: Callable[[ForeignStateError], None] | None = None,
    ) -> None:
        # Not C10dRendezvousBackend.__init__: it writes an unsigned "no state yet" sentinel.
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._store = store
        self._key = "torch.rendezvous." + run_id
        self._secret = secret
        self._name = name
        self._on_refused = on_refused
        self._null = sign(secret, self._key, _NULL_STATE)
        self._call_store("compare_set", self._key, "", self._null.decode())

    @property
    def name(self) -> str:
        return self._name  # elastic checks that its handler is the backend it asked for

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._decode_state(self._call_store("get", self._key))

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token and not isinstance(token, bytes):  # not one of ours: certainly stale (as torch's)
            result = self.get_state()
            return (*result, False) if result is not None else None
        expected = token.decode() if token else self._null.decode()
        signed = sign(self._secret, self._key, state).decode()
        stored: bytes = self._call_store("compare_set", self._key, expected, signed)
        pair = self._decode_state(stored)
        if pair is None:
            return None
        new_state, new_token = pair
        return new_state, new_token, new_state == state

    def _decode_state(self, base64_state: bytes) -> tuple[bytes, Token] | None:
        try:
            state = verify(self._secret, self._key, base64_state)
        except ForeignStateError as e:
            # Read by the agent's loop, or by its keep-alive thread (which only logs what it raises).
            if self._on_refused is not None:
                self._on_refused(e)
            raise
        return None if state == _NULL_STATE else (state, base64_state)


@contextlib.contextmanager
def secret_for(
    run_id: str, run_dir: str | None, on_refused: Callable[[ForeignStateError], None] = lambda e: None
) -> Iterator[None]:
    """The run's secret, for the rendezvous handler of run_id while the agent runs: shared through
    run_dir (several nodes), or made here (run_dir None: one node, whose agent is the only reader).
    on_refused: called when this node refuses a value, in whichever thread of the agent read it."""
    secret = shared_secret(Path(run_dir)) if run_dir is not None else secrets.token_bytes(_SECRET_BYTES)
    _secrets[run_id] = (secret, on_refused)
    try:
        yield
    finally:
        _secrets.pop(run_id, None)


def backend_for(store: Store, run_id: str, name: str) -> SignedC10dBackend:
    """The signed backend of a rendezvous started inside secret_for."""
    try:
        secret, on_refused = _secrets[run_id]
    except KeyError:
        raise RuntimeError(f"no secret for the rendezvous {run_id}: start it inside secret_for") from None
    return SignedC10dBackend(store, run_id, secret, name, on_refused)


def record_refusal(run_dir: str, e: ForeignStateError) -> None:
    """For the run's other nodes, whose ranks then fail for the loss of this node's: what it refused."""
    path = Path(run_dir) / REFUSED_FILE
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{e}\n")


def recorded_refusal(run_dir: str) -> str | None:
    """What a node of this run refused (record_refusal), if one did."""
    try:
        return (Path(run_dir) / REFUSED_FILE).read_text().strip() or None
    except OSError:
        return None


def clear_refusal(run_dir: str) -> None:
    (Path(run_dir) / REFUSED_FILE).unlink(missing_ok=True)


def shared_secret(run_dir: Path) -> bytes:
    """<run_dir>/.dtf-rendezvous.key: made, readable by the user alone, by the first node to get
    there (written whole to a file of its own, then linked into place, which fails if another node
    was first: a reader never sees half a key), and read by the others. The run directory is shared
    by the nodes (NFS, Lustre); it stays there for the runs that continue this one."""
    path = run_dir / SECRET_FILE
    if not path.exists():
        mine = run_dir / f"{SECRET_FILE}.{socket.gethostname()}.{os.getpid()}"
        fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(_SECRET_BYTES))
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(mine, path)
        finally:
            mine.unlink(missing_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise UserError(
            f"{path}: the run's rendezvous secret must belong to you and be readable by you alone (it is mode "
            f"{stat.S_IMODE(info.st_mode):04o}, owner uid {info.st_uid}): remove it, and the next run makes a new one"
        )
    secret = path.read_bytes()
    if len(secret) != _SECRET_BYTES:
        raise UserError(
            f"{path} is not a rendezvous secret ({len(secret)} bytes, not {_SECRET_BYTES}): remove it, and the "
            "next run makes a new one"
        )
    return secret
