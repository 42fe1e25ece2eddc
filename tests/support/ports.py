"""Loopback ports for the servers the tests start."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port nothing on the loopback listens on now (the kernel's pick; the caller binds it next)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]
