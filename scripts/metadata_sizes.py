"""What a client sees for request metadata of growing size, on each gRPC server (docs/robustness.md).

Starts each server in-process on a loopback port with the frontend's limits (its interceptor and transport
options, `frontend/limits.py`) and one trivial method, then calls it with one padding header per size.

Usage: python scripts/metadata_sizes.py [LIMIT_BYTES] [SIZE,SIZE,...]
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from types import SimpleNamespace

import grpc

from openengine_serve.common.grpc_server import GRPCIO, NATIVE, create_server, resolve_implementation
from openengine_serve.frontend import limits

DEFAULT_SIZES = (1000, 2500, 4096, 8192, 16384, 65536, 524288, 1046528, 1049600, 1100000, 1400000, 4000000)


def serve(name: str, limit: int, port: list[int], ready: threading.Event) -> None:
    async def main() -> None:
        config = SimpleNamespace(max_request_bytes=1 << 20, max_metadata_bytes=limit, max_concurrent_streams=100)
        server = create_server(
            resolve_implementation(name),
            interceptors=limits.interceptors(config),
            options=limits.transport_options(config),
        )

        async def echo(request, context):
            return b"ok"

        handlers = {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.Probe", handlers),))
        server.add_registered_method_handlers("probe.Probe", handlers)
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def main() -> None:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    sizes = [int(s) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else DEFAULT_SIZES
    for name in (GRPCIO, NATIVE):
        port: list[int] = []
        ready = threading.Event()
        threading.Thread(target=serve, args=(name, limit, port, ready), daemon=True).start()
        if not ready.wait(30):
            raise SystemExit(f"{name} did not start")
        for size in sizes:
            with grpc.insecure_channel(f"127.0.0.1:{port[0]}") as channel:  # a fresh connection: a GOAWAY ends one
                started = time.monotonic()
                try:
                    channel.unary_unary("/probe.Probe/Echo")(b"", timeout=10, metadata=(("x-padding", "p" * size),))
                    answer = "OK"
                except grpc.RpcError as exc:
                    answer = f"{exc.code().name} {exc.details()[:100]!r}"
            print(
                f"{name:14} limit {limit} padding {size:>8} B  {time.monotonic() - started:5.2f} s  {answer}",
                flush=True,
            )


if __name__ == "__main__":
    main()
