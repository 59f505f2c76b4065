"""Process lifecycle shared by the components: logging, signals, the metrics port."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from prometheus_client import start_http_server

try:
    import uvloop

    _new_uvloop: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
except ImportError:  # not built for this platform (Windows)
    _new_uvloop = None

from .config import CommonConfig
from .logging_setup import log_event, setup_logging
from .tracing import setup_tracing, shutdown_tracing

logger = logging.getLogger("openengine_serve")


def event_loop_name() -> str:
    return "uvloop" if _new_uvloop is not None else "asyncio"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it exists (every component, the benchmark's bare server and its load generator): its
    loop spends less CPU per callback and I/O event than asyncio's, and every component is an event loop; asyncio's
    own loop otherwise."""
    return _new_uvloop() if _new_uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, int | None]) -> int:
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main) or 0


def run_component(config: CommonConfig, main: Callable[[asyncio.Event], Awaitable[int | None]]) -> int:
    """Runs `main(stop)` on a fresh event loop; SIGTERM/SIGINT set `stop` (the component then drains)."""
    setup_logging(config.component(), config.log_level)
    setup_tracing(config.component())

    async def runner() -> int | None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    try:
        return run(runner())
    finally:
        shutdown_tracing()  # the spans of the last requests


# Every request or heartbeat allocates tracked objects (coroutines, futures, frames, dicts) that mostly die young; at
# CPython's default of 700 allocations the youngest-generation collections scan the live ones again and again. A
# larger threshold lets most of them go by reference counting first.
GC_THRESHOLDS = (10_000, 20, 20)


def freeze_startup_objects() -> None:
    """Once a server has started: what startup built is never scanned by the cyclic GC again (a full collection of
    a process's modules and descriptors took milliseconds, a pause for every call waiting), and young collections
    come less often (GC_THRESHOLDS)."""
    gc.collect()  # startup's garbage goes first: nothing frozen is ever collected
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def start_metrics(port: int, registry=None, host: str = "0.0.0.0") -> None:
    """Serves Prometheus text on its own HTTP port (0 disables), bound to `host` (OPENENGINE_METRICS_HOST)."""
    if port:
        kwargs = {"registry": registry} if registry is not None else {}
        start_http_server(port, addr=host.strip("[]"), **kwargs)  # an IPv6 host as in bind_address
        log_event(logger, "metrics listening", host=host, port=port)


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
