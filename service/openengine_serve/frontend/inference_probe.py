"""The inference probe of Control.Health: one real token through the whole path."""

from __future__ import annotations

import asyncio
import time

from ..api.openengine.v1 import generation_pb2, lifecycle_pb2
from .inference import Inference
from .refusal import Refusal
from .validation import RequestMetadata

PROBE_REQUEST_PREFIX = "inference-probe-"
PROBE_TEXT = "Hello"  # its last token is the probe's prompt


class InferenceProbe:
    def __init__(self, frontend_id: str, inference: Inference, timeout_s: float) -> None:
        self.frontend_id = frontend_id
        self.inference = inference
        self.timeout_s = timeout_s
        self._probe: asyncio.Future | None = None
        self._count = 0

    async def check(self) -> lifecycle_pb2.HealthCheck:
        """The probe's result; concurrent callers share one probe."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._probe)

    async def _run(self) -> lifecycle_pb2.HealthCheck:
        self._count += 1
        try:
            loaded = self.inference.loaded()
            plan = self.inference.plan(
                generation_pb2.GenerateRequest(
                    request_id=f"{PROBE_REQUEST_PREFIX}{self.frontend_id}-{self._count}",
                    model=loaded.name,
                    token_ids=generation_pb2.TokenIds(ids=loaded.tokenizer.encode(PROBE_TEXT)[-1:]),
                    stopping=generation_pb2.StoppingOptions(max_tokens=1, ignore_eos=True),
                ),
                RequestMetadata(),
            )
            errors: list[str] = []

            async def keep_errors(response) -> None:
                if type(response) is not bytes and response.HasField("error"):
                    errors.append(response.error.message)

            async with asyncio.timeout(self.timeout_s):
                async with self.inference.requests.open(plan) as accepted:
                    await self.inference.stream(plan, accepted, time.perf_counter(), keep_errors)
            if errors:
                raise RuntimeError(errors[0])
            return lifecycle_pb2.HealthCheck(
                name="inference_probe",
                state=lifecycle_pb2.HEALTH_STATE_READY,
                message="one token generated",  # a public answer: the node is not named
            )
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - any failure is the probe's answer
            detail = exc.message if isinstance(exc, Refusal) else repr(exc)
            return lifecycle_pb2.HealthCheck(
                name="inference_probe", state=lifecycle_pb2.HEALTH_STATE_DEGRADED, message=f"probe failed: {detail}"
            )
