"""gRPC core's settings for the components, made before grpc is imported (core reads them once, when the module
loads).

grpcio's default EventEngine runs each connection's reads and writes on threads of its own, which then hand every
completion to the thread that polls grpc.aio's completion queue: two thread wake-ups per message. Without it
(the experiments below off), the polling thread does the I/O itself. Every component is a grpc.aio process that
streams many small messages, and this is most of the difference: the frontend spends about 15 % less CPU per
streamed token under a CPU quota, on grpcio and on pygrpc-native alike (its client channels to the nodes), and
the node less per result lane message (docs/benchmarks.md). An operator's own GRPC_EXPERIMENTS is kept as set
(an empty value: grpcio's defaults)."""

from __future__ import annotations

import os
import sys

COMPONENT_EXPERIMENTS = (
    "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints,-event_engine_callback_cq"
)


def configure_grpc_core(component: str) -> None:
    """Call before anything imports grpc; raises if something already did (the settings would be silently lost)."""
    if "grpc" in sys.modules:
        raise RuntimeError("configure_grpc_core() must run before grpc is imported")
    os.environ.setdefault("GRPC_EXPERIMENTS", COMPONENT_EXPERIMENTS)
    if component == "node":
        # The node starts its engine launcher with fork + exec (uvloop's subprocesses) while gRPC's threads run.
        # gRPC's fork handlers serve children that go on using gRPC, which an exec'd child never does: off, and
        # gRPC's core does not log "skipping fork() handlers" at every engine start.
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
