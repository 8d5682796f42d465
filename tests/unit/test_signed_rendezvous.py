"""dtf.launch.signed_rendezvous in process: the rendezvous state signed with the run's secret
behaves as torch's C10dRendezvousBackend for the run's own nodes, and refuses, unread, what anyone
else writes to the store (the runs themselves: tests/e2e/test_multinode.py, a stranger's host)."""

from __future__ import annotations

import base64
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from dtf.errors import UserError
from dtf.launch.signed_rendezvous import SECRET_FILE, ForeignStateError, SignedC10dBackend, shared_secret, sign, verify

SECRET = bytes(range(32))
KEY = "torch.rendezvous.run"


class _CreatesFile:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def test_a_signed_state_is_read_back_and_any_change_to_it_is_refused() -> None:
    signed = sign(SECRET, KEY, b"state")
    assert verify(SECRET, KEY, signed) == b"state"
    form, mac, body = signed.split(b":")
    forged = [
        b":".join((form, mac, base64.b64encode(b"other"))),  # another state under the run's HMAC
        b":".join((form, b"0" * len(mac), body)),  # a made-up HMAC
        sign(b"x" * 32, KEY, b"state"),  # another secret (another run)
        base64.b64encode(b"state"),  # torch's own format: unsigned
        b"",
    ]
    for value in forged:
        with pytest.raises(ForeignStateError, match=f"under {KEY} a value that no node of this run wrote"):
            verify(SECRET, KEY, value)
    with pytest.raises(ForeignStateError):  # a state copied from another key
        verify(SECRET, "torch.rendezvous.other", signed)


def test_the_nodes_compare_and_set_as_with_torchs_backend() -> None:
    # The same sequence of writes and reads (two nodes, one of them with a stale token) on torch's
    # backend and on the signed one, each on a store of its own: the same states, tokens' roles and
    # outcomes.
    def sequence(make: type | None) -> list[object]:
        store = dist.HashStore()
        a = SignedC10dBackend(store, "run", SECRET, "n") if make is None else C10dRendezvousBackend(store, "run")
        b = SignedC10dBackend(store, "run", SECRET, "n") if make is None else C10dRendezvousBackend(store, "run")
        seen: list[object] = [a.get_state()]
        first = a.set_state(b"one")
        assert first is not None
        seen.append((first[0], first[2]))
        read = b.get_state()
        assert read is not None
        seen.append(read[0])
        second = b.set_state(b"two", read[1])  # b's token is current
        assert second is not None
        seen.append((second[0], second[2]))
        stale = a.set_state(b"three", first[1])  # a's token is stale: b wrote since
        assert stale is not None
        seen.append((stale[0], stale[2]))
        refused = a.set_state(b"x", None)  # no token while a state exists: refused, the state returned
        assert refused is not None
        seen.append((refused[0], refused[2]))
        return seen

    assert sequence(None) == sequence(C10dRendezvousBackend)


def test_a_strangers_pickle_in_the_store_is_refused_unread(tmp_path: Path) -> None:
    store = dist.HashStore()
    refusals: list[ForeignStateError] = []
    backend = SignedC10dBackend(store, "run", SECRET, "n", refusals.append)  # (the launcher kills the ranks)
    marker = tmp_path / "ran"
    store.set(KEY, base64.b64encode(pickle.dumps(_CreatesFile(marker))).decode())  # what torch's backend reads
    with pytest.raises(ForeignStateError):
        backend.get_state()
    with pytest.raises(ForeignStateError):
        backend.set_state(b"mine")
    assert not marker.exists() and [e.key for e in refusals] == [KEY, KEY]
    # torch's own backend hands it to dynamic_rendezvous, which unpickles it: the stranger's code runs
    state = C10dRendezvousBackend(store, "run").get_state()
    assert state is not None
    pickle.loads(state[0])
    assert marker.exists()


def test_the_nodes_share_one_secret_readable_by_the_user_alone(tmp_path: Path) -> None:
    first, second = shared_secret(tmp_path), shared_secret(tmp_path)
    assert first == second and len(first) == 32
    path = tmp_path / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and [p.name for p in tmp_path.iterdir()] == [SECRET_FILE]
    os.chmod(path, 0o644)
    with pytest.raises(UserError, match=rf"{SECRET_FILE}: .* readable by you alone \(it is mode 0644"):
        shared_secret(tmp_path)
    path.write_bytes(b"short")
    os.chmod(path, 0o600)
    with pytest.raises(UserError, match="is not a rendezvous secret"):
        shared_secret(tmp_path)
