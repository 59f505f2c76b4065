"""The one function that builds a component's command line (`up`, the bench and the tests use it)."""

from __future__ import annotations

import sys

from openengine_serve.local import component_command


def test_options_become_flags_and_none_leaves_one_out():
    command = component_command(
        "frontend", "127.0.0.2", 5005, "--tls-cert-file", "c.pem", metrics_port=0, drain_timeout_s=2.0, workers=None
    )
    assert command == [
        sys.executable,
        "-m",
        "openengine_serve",
        "frontend",
        "--host",
        "127.0.0.2",
        "--port",
        "5005",
        "--metrics-port",
        "0",
        "--drain-timeout-s",
        "2.0",
        "--tls-cert-file",
        "c.pem",
    ]


def test_every_flag_it_writes_is_one_the_component_accepts():
    from openengine_serve.cli import build_parser

    command = component_command(
        "node", "127.0.0.1", 1, node_rank=0, coordinator_address="127.0.0.1:2", metrics_port=0, engine="simulated"
    )
    args = build_parser().parse_args(command[3:])
    # the parser keeps values as given (the component's config converts and checks them)
    assert [str(v) for v in (args.host, args.port, args.node_rank, args.coordinator_address, args.engine)] == [
        "127.0.0.1",
        "1",
        "0",
        "127.0.0.1:2",
        "simulated",
    ]
