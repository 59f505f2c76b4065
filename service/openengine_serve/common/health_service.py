"""`grpc.health.v1` for every component: `liveness` and `readiness` services.

liveness is SERVING while the process and its event loop answer; readiness
(plus any extra service names, e.g. the frontend's openengine.v1 services) is
SERVING only while the component can do its job end to end, and turns
NOT_SERVING at the first moment of a drain. Watch streams every change.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

LIVENESS = "liveness"
READINESS = "readiness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    def __init__(self, readiness_aliases: tuple[str, ...] = ()) -> None:
        self.servicer = health.aio.HealthServicer()
        # The overall health (the empty service name) is readiness, as load balancers expect.
        self._readiness_names = (READINESS, health.OVERALL_HEALTH, *readiness_aliases)
        self._ready = False
        self._draining = False

    def register(self, server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        await self.servicer.set(LIVENESS, SERVING)
        await self._publish()

    @property
    def ready(self) -> bool:
        return self._ready and not self._draining

    @property
    def draining(self) -> bool:
        return self._draining

    async def set_ready(self, ready: bool) -> None:
        if ready != self._ready:
            self._ready = ready
            await self._publish()

    async def start_drain(self) -> None:
        """Readiness turns NOT_SERVING for good; liveness stays SERVING until the process ends."""
        self._draining = True
        await self._publish()

    async def _publish(self) -> None:
        status = SERVING if self.ready else NOT_SERVING
        for name in self._readiness_names:
            await self.servicer.set(name, status)
