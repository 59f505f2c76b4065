"""Small network helpers shared by the local stack, the benchmark and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the kernel's choice); the caller binds it soon after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
