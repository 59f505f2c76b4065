"""uvicorn in the frontend worker's own event loop, on a socket every worker binds with SO_REUSEPORT (as the gRPC
port is shared); its signals stay the worker's (the frontend drains, then stops it)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import uvicorn

from ...common.config import FrontendConfig

HTTP_STOP_GRACE_S = 1  # after the drain: what keep-alive connections get to close


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the worker's handlers decide when to stop (frontend/supervisor.py)
        yield


def reuseport_socket(host: str, port: int) -> socket.socket:
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


class HttpServer:
    def __init__(self, app, config: FrontendConfig) -> None:
        self.socket = reuseport_socket(config.host, config.http_port)
        # The public port's certificate (and client CA) serve HTTPS too; read at start.
        self.server = _Server(
            uvicorn.Config(
                app,
                lifespan="off",
                access_log=False,
                log_config=None,
                timeout_graceful_shutdown=HTTP_STOP_GRACE_S,
                ssl_certfile=config.tls_cert_file or None,
                ssl_keyfile=config.tls_key_file or None,
                ssl_ca_certs=config.tls_client_ca_file or None,
                ssl_cert_reqs=ssl.CERT_REQUIRED if config.tls_client_ca_file else ssl.CERT_NONE,
            )
        )
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self._task.done():
                await self._task  # raises what failed
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
