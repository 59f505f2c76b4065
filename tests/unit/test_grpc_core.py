"""The components' gRPC core settings (common/grpc_core.py), each in a fresh interpreter: core reads them when
grpc is first imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from openengine_serve.common.grpc_core import COMPONENT_EXPERIMENTS

# Real calls on a real port, then the CPU time (clock ticks) of the event_engine threads and of the others.
CALLS = textwrap.dedent(
    """
    import asyncio, os, sys
    from openengine_serve.common.grpc_core import configure_grpc_core
    if sys.argv[1] == "configured":
        configure_grpc_core("frontend")
    import grpc
    from openengine_bench.stack import CLK_TCK, thread_seconds  # imports grpc: after the configuration
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(2000):
                await stub.Check(health_pb2.HealthCheckRequest())
            seconds = thread_seconds(os.getpid())  # while the threads live: an ended thread's time leaves /proc
        await server.stop(None)
        event_engine = seconds.pop("event_engine", 0.0)
        print(round(event_engine * CLK_TCK), round(sum(seconds.values()) * CLK_TCK))

    asyncio.run(main())
    """
)


def _python(code: str, *args: str, experiments: str | None = None) -> str:
    """Runs `code` in a fresh interpreter, GRPC_EXPERIMENTS unset unless `experiments`; its output."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if experiments is not None:
        env["GRPC_EXPERIMENTS"] = experiments
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env, check=True
    )
    return done.stdout.strip()


def test_configured_the_polling_thread_does_the_io_not_the_event_engine_threads():
    event_engine, other = map(int, _python(CALLS, "configured").split())
    assert other > 20, "the 2,000 calls took too little CPU to tell"
    # Unconfigured, grpcio's EventEngine threads take about a fifth of the process's CPU on these calls.
    assert event_engine <= max(2, other // 50), f"event_engine threads: {event_engine} ticks, the rest {other}"


def test_an_operators_own_setting_is_kept():
    code = (
        "import os; from openengine_serve.common.grpc_core import configure_grpc_core; "
        "configure_grpc_core('coordinator'); print(repr(os.environ['GRPC_EXPERIMENTS']))"
    )
    assert _python(code, experiments="") == "''"


def test_configuring_after_grpc_was_imported_fails_loudly():
    code = (
        "import grpc; from openengine_serve.common.grpc_core import configure_grpc_core\n"
        "try:\n    configure_grpc_core('node')\nexcept RuntimeError as exc:\n    print(exc)"
    )
    assert "before grpc is imported" in _python(code)


def test_every_component_command_configures_grpc_before_importing_it():
    code = textwrap.dedent(
        """
        import contextlib, io, os, sys
        from openengine_serve import cli
        component = sys.argv[1]
        with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
            cli.main([component, "--help"])
        print(os.environ.get("GRPC_EXPERIMENTS"), os.environ.get("GRPC_ENABLE_FORK_SUPPORT"))
        """
    )
    for component in ("frontend", "coordinator", "node"):
        experiments, fork_support = _python(code, component).split()
        assert experiments == COMPONENT_EXPERIMENTS, component
        assert fork_support == ("0" if component == "node" else "None"), component
