"""`openengine-serve up`: the embedded default for a newcomer (the real model, SmolLM2-135M-Instruct)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from openengine_serve.client import Client, served_model

from . import processes
from .conftest import request

READY_LINE_TIMEOUT_S = 120.0


def generates(target: str, max_tokens: int) -> bool:
    """A generation of the model the stack serves (whatever its name) ends with its usage."""
    with Client(target) as client:
        model = served_model(client, timeout=10).served_model_name
        return list(client.generate(request(max_tokens=max_tokens, model=model), timeout=60))[-1].HasField("usage")


def first_line(proc: subprocess.Popen, timeout: float = READY_LINE_TIMEOUT_S) -> str:
    """The first line `up` prints (its address once ready), or a failure naming the wait: never a hang."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not line:
        proc.send_signal(signal.SIGTERM)  # `up` stops its children (killed, it would leave them running)
        raise AssertionError(f"`up` printed no line within {timeout:.0f} s (exit code {proc.poll()})")
    return line[0]


@pytest.mark.parametrize("server", ["grpcio", "pygrpc-native"])
def test_up_starts_serves_and_stops_leaving_nothing_behind(server, tmp_path):
    port, http_port = processes.free_port(), processes.free_port()
    log = (tmp_path / "up.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "openengine_serve", "up", "--port", str(port), "--nodes", "2", "--grpc-server", server]
        + ["--http-port", str(http_port)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        line = first_line(proc)
        assert f"ready on 127.0.0.1:{port}; OpenAI-compatible API on http://127.0.0.1:{http_port}/v1" in line, line
        children = processes.descendants(proc.pid)
        assert len([p for p in children if "openengine_serve" in processes.cmdline(p)]) >= 4
        assert generates(f"127.0.0.1:{port}", 8)
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
        model = sdk.models.list().data[0].id
        answer = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert answer.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        assert proc.wait(timeout=60) == 0
        # Nothing is open: every component stops at once (a node that hung in its stop was killed by `up`
        # after 40 s, and this still passed).
        assert time.monotonic() - stopping < 15
        processes.wait_for(
            lambda: not any(processes.alive(p) and processes.cmdline(p) for p in children),
            10,
            "every child of `up` to exit",
        )
        # What a newcomer reads: the components' log lines, no line of gRPC's core (the nodes' engine starts).
        assert "fork_posix" not in (tmp_path / "up.log").read_text()
    finally:
        if proc.poll() is None:  # `up` stops its children in order (killed, it would leave them running)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_two_stacks_side_by_side():
    ports = [processes.free_port(), processes.free_port()]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "openengine_serve", "up", "--port", str(p), "--http-port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for p in ports
    ]
    try:
        for proc, port in zip(procs, ports):
            assert f"ready on 127.0.0.1:{port}" in first_line(proc)
        for port in ports:
            assert generates(f"127.0.0.1:{port}", 4)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            assert proc.wait(timeout=60) == 0


def test_up_refuses_a_port_another_listener_holds_even_with_so_reuseport():
    """Our frontends bind with SO_REUSEPORT (workers share a port), so a second stack on the same port would
    silently split the first one's traffic: `up` checks its fixed ports first and names the busy one."""
    port = processes.free_port()
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a frontend worker of another stack
        holder.bind(("127.0.0.1", port))
        holder.listen()
        done = subprocess.run(
            [sys.executable, "-m", "openengine_serve", "up", "--port", str(port), "--engine", "simulated"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1 and not done.stdout, done.stdout
    assert f"port(s) already in use on 127.0.0.1: {port} (--port)" in done.stderr, done.stderr


def test_a_killed_up_leaves_no_component_running():
    port = processes.free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "openengine_serve",
            "up",
            "--port",
            str(port),
            "--engine",
            "simulated",
            "--http-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert f"ready on 127.0.0.1:{port}" in first_line(proc)
        children = [p for p in processes.descendants(proc.pid) if "openengine_serve" in processes.cmdline(p)]
        assert len(children) >= 3
    finally:
        proc.kill()  # no chance to stop its children itself
        proc.wait()
    processes.wait_for(
        lambda: not any(processes.alive(p) for p in children), 30, "every component of the killed `up` to exit"
    )
