"""Small network helpers shared by the local stack, the benchmark and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the kernel's choice); the caller binds it soon after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on host:port. The probe binds without SO_REUSEPORT, so a listener that set it
    (our frontends do, to share a port between workers) still counts: two stacks never share a port unawares."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False  # an unknown host: the component's own bind reports it
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
            try:
                s.bind(address)
            except OSError:
                return True
    return False
