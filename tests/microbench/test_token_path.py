"""The per-token path micro-benchmark: it runs the frontend's own code, on pygrpc-native's real call context."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from openengine_serve.common.grpc_server import nonblocking_send

from . import token_path


@pytest.mark.parametrize("server", ["pygrpc-native", "none"])
def test_every_token_reaches_the_transport_one_message_each(server):
    args = argparse.Namespace(streams=4, requests=12, tokens=16, server=server, count_calls=False)
    result = asyncio.run(token_path.run(args))
    assert result["tokens"] == 12 * 16
    assert result["messages"] == 12 * 16 + 12, "one delta per token and one finished per request"
    assert result["non_blocking_send"] is (server == "pygrpc-native")
    assert result["cpu_us_per_token"] > 0
    assert "python_calls_per_token" not in result
    # the lane's messages were acknowledged on the Lane call, a window (or more) at a time
    window = token_path.frontend_lane_settings()["lane_window"]
    assert 1 <= result["credit_writes"] <= result["lane_messages"] // window


def test_count_calls_reports_the_python_calls_per_token():
    args = argparse.Namespace(streams=2, requests=4, tokens=8, server="pygrpc-native", count_calls=True)
    result = asyncio.run(token_path.run(args))
    assert 1 < result["python_calls_per_token"] < 1000


def test_the_non_blocking_send_exists_on_pygrpc_native_only():
    sent = token_path.Sent()
    send = nonblocking_send(token_path.native_context(1, sent))
    assert send is not None, "pygrpc-native's call context changed: the frontend lost its non-blocking send"
    assert send(b"delta") is True and sent.messages == 1
    assert nonblocking_send(object()) is None  # grpc.aio's context: every write is awaited
