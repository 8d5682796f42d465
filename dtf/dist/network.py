"""This machine's network, as the ranks and the driver use it: which interface reaches a peer,
an interface's address, the loopback interface, a socket that listens on one address only.
Standard library only: the driver, the launchers and the ranks ask it."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct


def route_source(address: str, port: int) -> str:
    """This node's address on the route to address (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, port))
        return str(s.getsockname()[0])


def interface_address(name: str) -> str | None:
    """The IPv4 address of a network interface (Linux's SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def listen_on(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host's (IPv4) address only. OSError when it cannot be had (the
    port is taken, the address is not this machine's)."""
    address = socket.gethostbyname(host)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own server does
        listener.bind((address, port))
        listener.listen(2048)
    except BaseException:
        listener.close()
        raise
    return listener


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def loopback_interface() -> str:
    """The name of this machine's loopback network interface (lo on Linux)."""
    for _, name in socket.if_nameindex():
        address = interface_address(name)
        if address is not None and ipaddress.ip_address(address).is_loopback:
            return name
    return "lo"
