"""The floor: a trivial streaming servicer on each gRPC server, with the frontend's server options.

    python -m openengine_bench.baseline --server grpcio|pygrpc-native --port P [--step-ms 2]

`Inference.Generate` answers every request with `stopping.max_tokens` token
messages and one `finished` message carrying usage, shaped like the
frontend's (request id, one TokenInfo with id and text, the text delta). It
is paced like the engine: a shared ticker wakes every waiting stream once per
step, so each message is written on its own, as on the real per-token path.
No validation, routing, detokenization or metrics: what remains is the
server's own cost per streamed message plus one asyncio wake-up, i.e. the
lowest CPU per token the frontend could reach on that server. The server is
built by `openengine_serve.common.grpc_server.create_server`, so the options
(SERVER_OPTIONS, and grpc.aio's extra ones) are the frontend's.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import grpc

from openengine_serve.api.openengine.v1 import generation_pb2, openengine_pb2_grpc
from openengine_serve.common.grpc_server import create_server, resolve_implementation
from openengine_serve.common.lifecycle import bind_address, run

TOKEN_ID = 9707
TOKEN_TEXT = "Hello"


class Ticker:
    """Sets-and-clears one asyncio.Event every step: one wake-up per waiting stream per step, like a lane."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.event = asyncio.Event()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.step_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            if loop.time() - next_at > self.step_s:
                next_at = loop.time()  # fell behind (saturated): do not burst to catch up
            self.event.set()
            self.event.clear()


class BareInference(openengine_pb2_grpc.InferenceServicer):
    def __init__(self, ticker: Ticker) -> None:
        self.ticker = ticker

    async def Generate(self, request: generation_pb2.GenerateRequest, context):
        count = request.stopping.max_tokens or 16
        token = generation_pb2.GenerateResponse(
            request_id=request.request_id,
            token=generation_pb2.TokenOutput(
                output_index=0, text=TOKEN_TEXT, tokens=[generation_pb2.TokenInfo(token_id=TOKEN_ID, token=TOKEN_TEXT)]
            ),
        )
        wait = self.ticker.event.wait
        for _ in range(count):
            await wait()
            yield token
        finished = generation_pb2.GenerateResponse(
            request_id=request.request_id,
            finished=generation_pb2.GenerationFinished(output_index=0, reason=generation_pb2.FINISH_REASON_LENGTH),
        )
        finished.usage.prompt_tokens = len(request.token_ids.ids)
        finished.usage.completion_tokens = count
        finished.usage.total_tokens = count + len(request.token_ids.ids)
        yield finished


async def serve(server_name: str, host: str, port: int, step_ms: float) -> int:
    implementation = resolve_implementation(server_name)
    ticker = Ticker(step_ms / 1000.0)
    server = create_server(implementation)
    openengine_pb2_grpc.add_InferenceServicer_to_server(BareInference(ticker), server)
    server.add_insecure_port(bind_address(host, port))
    await server.start()
    tick = asyncio.create_task(ticker.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"baseline {implementation.name} {implementation.version} listening on {host}:{port}", flush=True)
    await stop.wait()
    await server.stop(grace=1.0)
    tick.cancel()
    return 0


def wait_baseline_ready(target: str, timeout: float = 2.0) -> bool:
    """One short Generate answered in full: the bare server is up."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_stream(
            "/openengine.v1.Inference/Generate",
            request_serializer=generation_pb2.GenerateRequest.SerializeToString,
            response_deserializer=generation_pb2.GenerateResponse.FromString,
        )
        try:
            responses = list(
                call(
                    generation_pb2.GenerateRequest(
                        request_id="ready", stopping=generation_pb2.StoppingOptions(max_tokens=2)
                    ),
                    timeout=timeout,
                )
            )
        except grpc.RpcError:
            return False
    return len(responses) == 3 and responses[-1].HasField("finished")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("grpcio", "pygrpc-native"), required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-ms", type=float, default=2.0)
    args = parser.parse_args(argv)
    return run(serve(args.server, args.host, args.port, args.step_ms))  # on the frontend's event loop


if __name__ == "__main__":
    sys.exit(main())
