"""Small network helpers shared by the local stack, the benchmark and the tests."""

from __future__ import annotations

import random
import socket

LISTEN_PORTS_FLOOR = 20000  # free_port's choices start here: above the ports services usually claim


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now; the caller binds it soon after. It is taken below the kernel's ephemeral range, so
    neither an outgoing connection's local port nor another bind to port 0 can take it in between (the cause of
    a stack's rare "Address already in use" at start-up). The kernel's own choice is the fallback."""
    low = ephemeral_range()[0]
    for _ in range(64):
        port = random.randrange(LISTEN_PORTS_FLOOR, low) if low > LISTEN_PORTS_FLOOR else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections and binds to port 0 (Linux's default when the
    file cannot be read)."""
    try:
        with open(path) as f:
            low, high = (int(part) for part in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


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
