"""Ports on this machine: one to listen on, and whether one is taken."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nobody holds now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """True when nothing on this machine listens on (or holds) ``port``."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True
