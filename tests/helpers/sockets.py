"""The processes below a process, and the TCP sockets a set of processes listens on, from /proc
(Linux): each process's socket inodes (/proc/<pid>/fd) matched with the listening sockets of its
network namespace (/proc/<pid>/net/tcp, tcp6). Standard library only: a rank imports it too
(ListeningSockets in user_models)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def descendants(pid: int) -> list[int]:
    """Every process below pid (its children, theirs, ...)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket these processes listen on."""
    found = []
    for pid in pids:
        try:
            inodes = {os.readlink(fd)[len("socket:[") : -1] for fd in Path(f"/proc/{pid}/fd").iterdir()}
        except OSError:  # gone, or not ours to read
            continue
        for table in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    address, port = fields[1].split(":")
                    found.append((pid, _address(address), int(port, 16)))
    return sorted(set(found))


def _address(hex_address: str) -> str:
    """/proc/net/tcp's address: 32-bit words in host byte order (little-endian here)."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))
