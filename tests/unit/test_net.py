"""free_port: ports for the stack's components come from below the kernel's ephemeral range."""

from __future__ import annotations

import socket

from openengine_serve.common import net


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low, _high = net.ephemeral_range()
    for _ in range(20):
        port = net.free_port("127.0.0.1")
        assert net.LISTEN_PORTS_FLOOR <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_chosen(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(net, "LISTEN_PORTS_FLOOR", taken)
        monkeypatch.setattr(net, "ephemeral_range", lambda: (taken + 1, 60999))  # the held port is the only choice
        chosen = {net.free_port("127.0.0.1") for _ in range(5)}
    assert taken not in chosen  # the kernel's choice after it


def test_the_range_file_is_read_and_a_missing_one_is_linux_default(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert net.ephemeral_range(str(path)) == (40000, 50000)
    assert net.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
