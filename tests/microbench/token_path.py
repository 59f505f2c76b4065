"""The frontend's per-token Python path alone, in one process: CPU per token, for A/B of per-token changes.

    python -m tests.microbench.token_path [--streams 10] [--requests 400] [--tokens 128] [--server pygrpc-native]
                                          [--count-calls]

What runs is the frontend's own code from the lane read on: `NodeConnections` reads a node's result lane (a
stand-in stub yielding one StepResults per engine step with one token per open stream, the last one finishing
it), hands each event to its request's sink, and `Inference.stream` turns the events into deltas and writes
them. With `--server pygrpc-native` the writes go through pygrpc-native's own Python call context
(`context.write`, and the frontend's non-blocking send where the tree has one) onto a stand-in for its Rust
front that accepts every message; with `--server none` `write` is an empty coroutine. The node's lane is its
acknowledged `Lane` call, so the per-message acknowledgements (LaneAcknowledgements, the credit pacing and
pausing checks with the frontend's default settings) run too, each credit write a stand-in that completes
after one loop iteration (grpc.aio's own cost per write is not in the figure: the JSON counts the writes). No
gRPC transport, no
node, no client: what is left is exactly what a per-token change of the frontend can move, measured as
process CPU time (`time.process_time`) over the whole run ÷ tokens, without the noise of a full stack on a
shared machine. Streams run closed-loop (`--streams` open at a time) and between steps the lane yields to
the loop until the woken streams have written (one message per token, as at 40 req/s in the harness).

A/B of two source trees: run it alternately with each tree first on PYTHONPATH (the tool copes with trees
with and without the non-blocking send); compare the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import random
import sys
import time
from types import SimpleNamespace

import grpc

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.vocab import load_encoding
from openengine_serve.frontend.inference import Inference
from openengine_serve.frontend.nodes import NodeConnection, NodeConnections
from openengine_serve.frontend.request_trace import NO_TRACE
from openengine_serve.frontend.requests import OpenRequest
from openengine_serve.frontend.stream import TokenStrings, serialize_response
from openengine_serve.frontend.tasks import BackgroundTasks
from openengine_serve.frontend.validation import GenerationPlan

YIELDS_PER_STEP = 4  # loop iterations the lane leaves between steps: the woken streams write meanwhile


def token_ids(encoding, count: int, seed: int) -> list[int]:
    """Like the simulated engine's output: mostly tokens of ordinary text, some drawn from the whole vocabulary
    (those include byte fragments of multi-byte characters, which take the general path)."""
    rng = random.Random(seed)
    text = encoding.encode(
        "The quick brown fox jumps over the lazy dog while the model streams its answer, "
        "token by token, to a client that reads every delta as it comes. "
    )
    return [rng.choice(text) if rng.random() < 0.85 else rng.randrange(151_643) for _ in range(count)]


class Lane:
    """A node's result lane: one StepResults per step, one token per open request."""

    def __init__(self, encoding, tokens: int) -> None:
        self.tokens = tokens
        self.open: dict[str, int] = {}  # request id -> tokens sent
        self.ids = token_ids(encoding, 4096, seed=7)
        self.closed = False
        self.messages = 0  # lane messages with events handed to the frontend

    def Lane(self):  # noqa: N802 - the stub's method name
        return LaneCall(self._steps())

    async def _steps(self):
        yield cluster_pb2.StepResults()  # the first message only says the lane is open
        step = 0
        while not self.closed:
            step += 1
            results = cluster_pb2.StepResults(step=step)
            for request_id, sent in list(self.open.items()):
                last = sent + 1 == self.tokens
                results.events.add(
                    request_id=request_id,
                    tokens=[
                        cluster_pb2.TokenRecord(
                            token_id=self.ids[(step + sent * 31 + hash(request_id)) % len(self.ids)]
                        )
                    ],
                    finish=cluster_pb2.ENGINE_FINISH_LENGTH if last else cluster_pb2.ENGINE_FINISH_NONE,
                )
                if last:
                    del self.open[request_id]
                else:
                    self.open[request_id] = sent + 1
            self.messages += bool(results.events)
            yield results
            for _ in range(YIELDS_PER_STEP):
                await asyncio.sleep(0)


class LaneCall:
    """A node's acknowledged `Lane` call: the lane's messages to read, the frontend's credits counted."""

    written = 0  # credit writes, over every call

    def __init__(self, steps) -> None:
        self._steps = steps

    async def write(self, _credit) -> None:
        LaneCall.written += 1
        await asyncio.sleep(0)  # a grpc.aio write completes after the transport took the message

    async def read(self):
        try:
            return await self._steps.__anext__()
        except StopAsyncIteration:
            return grpc.aio.EOF

    def cancel(self) -> None:
        pass


class NoChannel:
    async def close(self) -> None:
        pass


class Sent:
    """Counts what reaches the transport."""

    def __init__(self) -> None:
        self.messages = 0


def native_context(call_id: int, sent: Sent):
    """pygrpc-native's own call context on a stand-in front that accepts every message."""
    import pygrpc_native.aio as native_aio
    from pygrpc_native._native import STREAM_SENT

    class Front:
        def stream_try_send(self, _call_id, _data) -> int:
            sent.messages += 1
            return STREAM_SENT

    server = native_aio.Server()
    server._front = Front()
    handler = grpc.unary_stream_rpc_method_handler(lambda *_: None, response_serializer=serialize_response)
    call = native_aio._Call(call_id, "/openengine.v1.Inference/Generate", handler, (), "ipv4:127.0.0.1:1", None)
    return native_aio._Context(server, call)


def frontend_lane_settings() -> dict:
    """NodeConnections' lane settings as the frontend passes them (frontend/server.py), for the ones this tree has."""
    from openengine_serve.common.config import FrontendConfig

    config = FrontendConfig()
    settings = {
        "lane_window": getattr(config, "lane_window", 2),
        "lane_busy_ack_interval_s": getattr(config, "lane_busy_ack_interval_ms", 0.0) / 1000,
        "pause_after_s": getattr(config, "client_pause_after_s", 0.0),
    }
    accepted = inspect.signature(NodeConnections).parameters
    return {name: value for name, value in settings.items() if name in accepted}


async def run(args) -> dict:
    encoding = load_encoding()
    inference = Inference.__new__(Inference)  # only what `stream` uses: the served model's tokenizer
    loaded = SimpleNamespace(
        tokenizer=encoding, strings=TokenStrings(encoding), limits=SimpleNamespace(prefix_cache=False)
    )
    inference.model = SimpleNamespace(loaded=loaded, for_name=lambda name: loaded)
    lane = Lane(encoding, args.tokens)
    nodes = NodeConnections("token-path", BackgroundTasks(), 5.0, 5.0, **frontend_lane_settings())
    entry = cluster_pb2.NodeEntry(node_id="node-0", address="127.0.0.1:1")
    conn = NodeConnection(entry, NoChannel(), lane)
    nodes.connections[entry.node_id] = conn
    await nodes.connect(entry)
    takes_send_now = "send_now" in inspect.signature(Inference.stream).parameters
    try:
        from openengine_serve.common.grpc_server import nonblocking_send
    except ImportError:
        nonblocking_send = None
    sent = Sent()

    async def empty_write(_message) -> None:
        sent.messages += 1

    async def one_request(index: int) -> None:
        request_id = f"r{index}"
        plan = GenerationPlan(
            request_id=request_id,
            model="m",
            prompt_token_ids=[1] * 32,
            num_sequences=1,
            max_tokens=args.tokens,
            ignore_eos=True,
        )
        sink = nodes.open_sink(request_id)
        conn.requests.add(request_id)
        accepted = OpenRequest(request_id, request_id, conn, sink, nodes, "", NO_TRACE)
        extra = ()
        if args.server == "pygrpc-native":
            context = native_context(index, sent)
            write = context.write
            if takes_send_now and nonblocking_send is not None:
                extra = (nonblocking_send(context),)
        else:
            write = empty_write
        lane.open[request_id] = 0
        try:
            await inference.stream(plan, accepted, time.perf_counter(), write, *extra)
        finally:
            nodes.close_sink(request_id, entry.node_id)

    async def slot(first: int) -> None:
        for index in range(first, args.requests, args.streams):
            await one_request(index)

    for _ in range(3):  # warm the per-token caches and the code paths
        await one_request(-1 - _)
    sent.messages = 0
    LaneCall.written = 0
    profiler = None
    if args.count_calls:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    started_cpu, started_wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(slot(i) for i in range(args.streams)))
    cpu, wall = time.process_time() - started_cpu, time.perf_counter() - started_wall
    if profiler is not None:
        profiler.disable()
    lane.closed = True
    await nodes.close()
    tokens = args.requests * args.tokens
    extra = {}
    if profiler is not None:
        import pstats

        extra["python_calls_per_token"] = round(pstats.Stats(profiler).total_calls / tokens, 2)
    return {
        **extra,
        "server": args.server,
        "streams": args.streams,
        "tokens": tokens,
        "messages": sent.messages,
        "credit_writes": LaneCall.written,
        "lane_messages": lane.messages,
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "cpu_us_per_token": round(cpu / tokens * 1e6, 2),
        "non_blocking_send": bool(takes_send_now and nonblocking_send and args.server == "pygrpc-native"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.microbench.token_path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--streams", type=int, default=10, help="open at a time (40 req/s x 128 tokens x 2 ms ≈ 10)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--server", choices=("pygrpc-native", "none"), default="pygrpc-native")
    p.add_argument(
        "--count-calls",
        action="store_true",
        help="count the Python function calls per token (cProfile; the stand-in lane's own included): "
        "a noise-free measure of per-token work, the CPU figure is then inflated by the profiler",
    )
    args = p.parse_args(argv)
    try:
        import uvloop

        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
