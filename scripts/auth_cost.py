"""The API key interceptor's cost per request, on both gRPC servers.

Starts one frontend per (server, keys on/off) on loopback (no coordinator is
needed for GetServerInfo), sends N sequential unary calls from one channel, and
reports the client-side latency and the frontend process's CPU time per call.
Usage: python scripts/auth_cost.py [N]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from openengine_serve.api.openengine.v1 import server_pb2
from openengine_serve.client import Client, Credentials
from openengine_serve.common.net import free_port

KEY = "bench-key-0123456789"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(server: str, keys_file: str | None, calls: int) -> tuple[float, float]:
    port = free_port()
    env = dict(os.environ)
    env.pop("OPENENGINE_API_KEYS_FILE", None)
    if keys_file:
        env["OPENENGINE_API_KEYS_FILE"] = keys_file
        env["OPENENGINE_ALLOW_PLAINTEXT_KEYS"] = "1"  # loopback, no TLS
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "openengine_serve",
            "frontend",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--grpc-server",
            server,
            "--log-level",
            "warning",
            "--coordinator-address",
            f"127.0.0.1:{free_port()}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        credentials = Credentials(api_key=KEY if keys_file else "")
        with Client(f"127.0.0.1:{port}", credentials=credentials, retries=False) as client:
            request = server_pb2.GetServerInfoRequest()
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.control.GetServerInfo(request, timeout=1)
                    break
                except Exception:  # noqa: BLE001 - still starting
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            for _ in range(200):  # warm-up
                client.control.GetServerInfo(request, timeout=5)
            latencies = []
            cpu_before = cpu_seconds(proc.pid)
            for _ in range(calls):
                started = time.perf_counter()
                client.control.GetServerInfo(request, timeout=5)
                latencies.append(time.perf_counter() - started)
            cpu = cpu_seconds(proc.pid) - cpu_before
        return statistics.median(latencies) * 1e6, cpu / calls * 1e6
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as f:
        f.write("".join(f"user other-{i} other-secret-{i}\n" for i in range(9)) + f"user bench {KEY}\n")
    print(f"{calls} sequential GetServerInfo calls, one channel; key file of 10 keys")
    print("| server | keys | median latency µs | frontend CPU µs/call |")
    print("|---|---|---|---|")
    for server in ("grpcio", "pygrpc-native"):
        for keys_file in (None, f.name):
            latency, cpu = measure(server, keys_file, calls)
            print(f"| {server} | {'on' if keys_file else 'off'} | {latency:.0f} | {cpu:.0f} |", flush=True)
    os.unlink(f.name)


if __name__ == "__main__":
    main()
