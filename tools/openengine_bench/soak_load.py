"""The soak's mixed workload: one asyncio client issuing operations at a steady rate, every outcome counted.

Operation i starts at exactly `i / rate` seconds (no bursts); its kind is dealt from a seeded, shuffled deck
of `DECK_SIZE` cards made in the proportions of `MIX`, so every 100 operations hold the same mix:

- stream      a Generate of a varied length (1..1024 tokens, log-uniform), read to its end: exactly that
              many tokens, one `finished` (LENGTH) and usage;
- cancel      a 4096-token Generate the client cancels after 1..256 tokens;
- abort       a 4096-token Generate stopped after 1..64 tokens by `Control.Abort(request_id)`: ABORTED,
              then the stream ends with `finished` CANCELLED;
- duplicate   a live request's id sent again on another connection: ALREADY_EXISTS (injected); the original
              is then cancelled;
- malformed   bytes that are not the method's request message (Generate and Abort): INVALID_ARGUMENT
              naming the message type (injected);
- invalid     well-formed requests with a field or metadata out of range: INVALID_ARGUMENT or NOT_FOUND as
              documented per case (injected);
- disconnect  a new connection through a local TCP relay, two 4096-token streams, first token read, then
              the relay resets both sides of the connection (no HTTP/2 goodbye): the frontend sees a client
              vanish; the client sees UNAVAILABLE (injected).

Each operation records outcomes (kind, outcome); `EXPECTED` lists the outcomes that are an operation's
normal end. Anything else is unexpected and kept with its detail.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import socket
import struct
import time
from collections import Counter
from typing import Any

import grpc

from openengine_serve.api.openengine.v1 import generation_pb2, lifecycle_pb2, openengine_pb2_grpc, server_pb2

from .load import MODEL, channel_options

G = generation_pb2
LONG_TOKENS = 4096  # long enough (8 s at the 2 ms step) that a cancel or abort always meets a running request
CALL_TIMEOUT_S = 60.0
MIX = {"stream": 50, "cancel": 12, "abort": 8, "duplicate": 5, "malformed": 9, "invalid": 11, "disconnect": 5}
DECK_SIZE = sum(MIX.values())
STREAMS_PER_DISCONNECT = 2
CHANNELS = 8
VARIANTS = 16  # distinct (prompt, seed) pairs
UNEXPECTED_KEPT = 50

EXPECTED = {
    "stream": {"completed"},
    "cancel": {"cancelled"},
    "abort": {"aborted"},
    "duplicate": {"ALREADY_EXISTS", "original cancelled"},
    "malformed": {"INVALID_ARGUMENT"},
    "invalid": {"INVALID_ARGUMENT", "NOT_FOUND"},
    "disconnect": {"UNAVAILABLE"},
}
# Outcomes that are errors the load injected on purpose (the rest of EXPECTED are normal ends).
INJECTED = {
    "duplicate": {"ALREADY_EXISTS"},
    "malformed": {"INVALID_ARGUMENT"},
    "invalid": {"INVALID_ARGUMENT", "NOT_FOUND"},
    "disconnect": {"UNAVAILABLE"},
}


def deck(seed: int) -> list[str]:
    cards = [kind for kind, n in MIX.items() for _ in range(n)]
    random.Random(seed).shuffle(cards)
    return cards


class Tally:
    """Outcome counts per operation kind, and the details of unexpected ones (the first UNEXPECTED_KEPT)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.unexpected: list[dict[str, str]] = []
        self.started: Counter[str] = Counter()

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.counts[(kind, outcome)] += 1
        if outcome not in EXPECTED[kind] and len(self.unexpected) < UNEXPECTED_KEPT:
            self.unexpected.append({"kind": kind, "outcome": outcome, "detail": detail[:300]})

    def summary(self) -> dict[str, Any]:
        by_kind: dict[str, dict[str, int]] = {}
        for (kind, outcome), n in sorted(self.counts.items()):
            by_kind.setdefault(kind, {})[outcome] = n
        unexpected = sum(n for (kind, outcome), n in self.counts.items() if outcome not in EXPECTED[kind])
        injected: Counter[str] = Counter()
        for (kind, outcome), n in self.counts.items():
            if outcome in INJECTED.get(kind, ()):
                injected[f"{kind}: {outcome}"] += n
        return {
            "operations": dict(self.started),
            "outcomes": by_kind,
            "unexpected": unexpected,
            "unexpected_samples": self.unexpected,
            "injected_errors": dict(sorted(injected.items())),
            "injected_total": sum(injected.values()),
        }


def _error_outcome(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name, exc.details() or ""
    return type(exc).__name__, str(exc)


class AbruptRelay:
    """A local TCP relay to the frontend whose connections `cut()` resets on both sides (SO_LINGER 0 then
    close: an RST, no HTTP/2 GOAWAY or RST_STREAM), as when a client's machine or network goes away."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.server: asyncio.base_events.Server | None = None
        self.links: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _accept(self, client_reader, client_writer) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            client_writer.close()
            return
        self.links += [client_writer, upstream_writer]
        await asyncio.gather(
            self._pump(client_reader, upstream_writer),
            self._pump(upstream_reader, client_writer),
            return_exceptions=True,
        )

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    def cut(self) -> None:
        for writer in self.links:
            sock = writer.get_extra_info("socket")
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self.links = []

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


class SoakLoad:
    """The operations of one soak run against one frontend target."""

    def __init__(self, target: str, *, rate: float, seed: int, id_prefix: str) -> None:
        self.target = target
        self.rate = rate
        self.rng = random.Random(seed)
        self.deck = deck(seed)
        self.id_prefix = id_prefix
        self.tally = Tally()
        self.lag_max_s = 0.0
        self.channels: list[grpc.aio.Channel] = []
        self.issued = 0
        self.cases: Counter[str] = Counter()

    # ---------------------------------------------------------------- setup and the schedule

    async def open(self) -> None:
        self.channels = [grpc.aio.insecure_channel(self.target, options=channel_options()) for _ in range(CHANNELS)]
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in self.channels)), 20.0)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.channels), return_exceptions=True)

    async def run(self, duration_s: float, drain_s: float) -> int:
        """Issues operations for `duration_s`, then waits up to `drain_s` for them to end. Returns how many
        were still open then (each also counted as an unexpected outcome)."""
        started = time.monotonic()
        tasks: set[asyncio.Task] = set()
        i = 0
        while (at := started + i / self.rate) < started + duration_s:
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                self.lag_max_s = max(self.lag_max_s, -delay)
            kind = self.deck[i % DECK_SIZE]
            self.tally.started[kind] += 1
            task = asyncio.create_task(self.operation(kind, i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        self.issued = i
        if not tasks:
            return 0
        _, pending = await asyncio.wait(set(tasks), timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for _ in pending:
            self.tally.add("stream", "still open at the end of the drain")
        return len(pending)

    async def operation(self, kind: str, i: int) -> None:
        try:
            await getattr(self, f"op_{kind}")(i)
        except Exception as exc:  # noqa: BLE001 - counted as unexpected, with what it was
            self.tally.add(kind, f"load generator error {type(exc).__name__}", str(exc))

    # ---------------------------------------------------------------- helpers

    def request(self, i: int, max_tokens: int, suffix: str = "") -> G.GenerateRequest:
        # The simulated engine's tokens follow from prompt and seed, uniformly over the vocabulary; with a new
        # prompt every time the frontend's per-token-id caches (bounded by the vocabulary) would fill across
        # the whole run and hide a real leak behind them. A pool of VARIANTS fills them during the warm-up.
        variant = i % VARIANTS
        words = " ".join(f"w{(variant * 7 + k) % 97}" for k in range(1 + variant))
        return G.GenerateRequest(
            request_id=f"{self.id_prefix}-{i}{suffix}",
            model=MODEL,
            prompt=f"soak {variant}: {words}",
            sampling=G.SamplingParams(seed=variant),
            stopping=G.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
        )

    def next_case(self, kind: str, count: int) -> int:
        """Cycles through an operation's `count` cases, one per occurrence of the operation."""
        self.cases[kind] += 1
        return (self.cases[kind] - 1) % count

    def inference(self, i: int, offset: int = 0) -> openengine_pb2_grpc.InferenceStub:
        return openengine_pb2_grpc.InferenceStub(self.channels[(i + offset) % CHANNELS])

    def control(self, i: int) -> openengine_pb2_grpc.ControlStub:
        return openengine_pb2_grpc.ControlStub(self.channels[i % CHANNELS])

    async def read_tokens(self, call, at_least: int) -> tuple[int, str | None]:
        """Reads until `at_least` tokens arrived; (tokens, the event that ended the stream early or None)."""
        tokens = 0
        while tokens < at_least:
            response = await call.read()
            if response is grpc.aio.EOF:
                return tokens, "end of stream"
            event = response.WhichOneof("event")
            if event == "token":
                tokens += len(response.token.tokens)
            elif event in ("finished", "error"):
                return tokens, event
        return tokens, None

    async def read_to_end(self, call) -> list[G.GenerateResponse]:
        out = []
        while (response := await call.read()) is not grpc.aio.EOF:
            out.append(response)
        return out

    # ---------------------------------------------------------------- the operations

    async def op_stream(self, i: int) -> None:
        length = max(1, min(1024, int(math.exp(self.rng.uniform(0.0, math.log(1024))))))
        call = self.inference(i).Generate(self.request(i, length), timeout=CALL_TIMEOUT_S)
        try:
            responses = await self.read_to_end(call)
        except grpc.aio.AioRpcError as exc:
            self.tally.add("stream", *_error_outcome(exc))
            return
        tokens = sum(len(r.token.tokens) for r in responses if r.WhichOneof("event") == "token")
        finished = [r.finished for r in responses if r.WhichOneof("event") == "finished"]
        errors = [r.error for r in responses if r.WhichOneof("event") == "error"]
        if errors:
            self.tally.add("stream", "engine error event", str(errors[0]))
        elif (tokens, [f.reason for f in finished]) != (length, [G.FINISH_REASON_LENGTH]) or not responses[-1].HasField(
            "usage"
        ):
            self.tally.add(
                "stream",
                "wrong stream end",
                f"{tokens}/{length} tokens, finished {[G.FinishReason.Name(f.reason) for f in finished]}",
            )
        else:
            self.tally.add("stream", "completed")

    async def op_cancel(self, i: int) -> None:
        call = self.inference(i).Generate(self.request(i, LONG_TOKENS), timeout=CALL_TIMEOUT_S)
        try:
            tokens, ended = await self.read_tokens(call, self.rng.randint(1, 256))
        except grpc.aio.AioRpcError as exc:
            self.tally.add("cancel", *_error_outcome(exc))
            return
        if ended:
            self.tally.add("cancel", f"stream ended before the cancel ({ended})", f"after {tokens} tokens")
            return
        call.cancel()
        self.tally.add("cancel", "cancelled")

    async def op_abort(self, i: int) -> None:
        request = self.request(i, LONG_TOKENS)
        started = time.monotonic()
        call = self.inference(i).Generate(request, timeout=CALL_TIMEOUT_S)
        try:
            tokens, ended = await self.read_tokens(call, self.rng.randint(1, 64))
            read_s = time.monotonic() - started
            if ended:
                self.tally.add(
                    "abort",
                    f"stream ended before the abort ({ended})",
                    f"{request.request_id}: after {tokens} tokens in {read_s:.2f} s",
                )
                return
            reply = await self.control(i + 1).Abort(
                lifecycle_pb2.AbortRequest(request_id=request.request_id), timeout=CALL_TIMEOUT_S
            )
            timing = f"{tokens} tokens read in {read_s:.2f} s, Abort answered after {time.monotonic() - started:.2f} s"
            rest = await self.read_to_end(call)
        except grpc.aio.AioRpcError as exc:
            self.tally.add("abort", *_error_outcome(exc))
            call.cancel()
            return
        finished = [r.finished.reason for r in rest if r.WhichOneof("event") == "finished"]
        if reply.status != lifecycle_pb2.ABORT_STATUS_ABORTED:
            self.tally.add(
                "abort", f"abort answered {lifecycle_pb2.AbortStatus.Name(reply.status)}", f"{reply.message}; {timing}"
            )
        elif finished != [G.FINISH_REASON_CANCELLED]:
            self.tally.add(
                "abort", "aborted stream did not end CANCELLED", str([G.FinishReason.Name(f) for f in finished])
            )
        else:
            self.tally.add("abort", "aborted")

    async def op_duplicate(self, i: int) -> None:
        request = self.request(i, LONG_TOKENS)
        started = time.monotonic()
        original = self.inference(i).Generate(request, timeout=CALL_TIMEOUT_S)
        try:
            tokens, ended = await self.read_tokens(original, 1)
            timing = f"{request.request_id}: first token after {time.monotonic() - started:.2f} s"
            if ended:
                self.tally.add("duplicate", f"original ended early ({ended})", timing)
                return
            try:
                again = self.inference(i, offset=1).Generate(request, timeout=CALL_TIMEOUT_S)
                await self.read_to_end(again)
                self.tally.add("duplicate", "duplicate id accepted", timing)
            except grpc.aio.AioRpcError as exc:
                self.tally.add("duplicate", *_error_outcome(exc))
        except grpc.aio.AioRpcError as exc:
            self.tally.add("duplicate", f"original {exc.code().name}", exc.details() or "")
            return
        original.cancel()
        self.tally.add("duplicate", "original cancelled")

    MALFORMED = (
        ("Inference", "Generate", "openengine.v1.GenerateRequest", b"\xff\xff\xff\xff"),  # wire type 7
        ("Inference", "Generate", "openengine.v1.GenerateRequest", b"\x08" + b"\xff" * 11),  # endless varint
        ("Control", "Abort", "openengine.v1.AbortRequest", b"\x0a\x40short"),  # length past the end
    )

    async def op_malformed(self, i: int) -> None:
        case = self.next_case("malformed", len(self.MALFORMED) + 2)
        if case < len(self.MALFORMED):
            service, method, message, payload = self.MALFORMED[case]
        else:
            service, method, message = "Inference", "Generate", "openengine.v1.GenerateRequest"
            request = self.request(i, 4)
            valid, prompt = request.SerializeToString(), request.prompt.encode()
            # the request cut short inside its last field, or its prompt made invalid UTF-8
            payload = valid[:-1] if case == len(self.MALFORMED) else valid.replace(prompt, b"\xc0" + prompt[1:])
        channel = self.channels[i % CHANNELS]
        path = f"/openengine.v1.{service}/{method}"
        try:
            if method == "Generate":
                stream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(path)
                async for _ in stream(payload, timeout=CALL_TIMEOUT_S):
                    pass
            else:
                unary: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(path)
                await unary(payload, timeout=CALL_TIMEOUT_S)
            self.tally.add("malformed", "accepted", f"{method} {payload!r}")
        except grpc.aio.AioRpcError as exc:
            code, details = _error_outcome(exc)
            if code == "INVALID_ARGUMENT" and not details.startswith(f"request is not a valid {message}: "):
                code = "INVALID_ARGUMENT without naming the message type"
            self.tally.add("malformed", code, f"{method}: {details}")

    def _invalid_generate(self, i: int, mutate, metadata=()) -> Any:
        request = self.request(i, 4)
        mutate(request)
        return self.inference(i).Generate(request, timeout=CALL_TIMEOUT_S, metadata=metadata)

    async def op_invalid(self, i: int) -> None:
        def token_ids(r):
            r.token_ids.ids.extend([1000, 999_999_999])

        cases = [
            (
                "empty request_id",
                "INVALID_ARGUMENT",
                lambda: self._invalid_generate(i, lambda r: setattr(r, "request_id", "")),
            ),
            (
                "top_p 1.5",
                "INVALID_ARGUMENT",
                lambda: self._invalid_generate(i, lambda r: setattr(r.sampling, "top_p", 1.5)),
            ),
            (
                "max_tokens 0",
                "INVALID_ARGUMENT",
                lambda: self._invalid_generate(i, lambda r: setattr(r.stopping, "max_tokens", 0)),
            ),
            (
                "num_sequences 0",
                "INVALID_ARGUMENT",
                lambda: self._invalid_generate(i, lambda r: setattr(r.sampling, "num_sequences", 0)),
            ),
            ("token id beyond the vocabulary", "INVALID_ARGUMENT", lambda: self._invalid_generate(i, token_ids)),
            (
                "unknown model",
                "NOT_FOUND",
                lambda: self._invalid_generate(i, lambda r: setattr(r, "model", "no-such-model")),
            ),
            (
                "target rank 7",
                "NOT_FOUND",
                lambda: self._invalid_generate(i, lambda r: None, (("openengine-target-dp-rank", "7"),)),
            ),
            (
                "target rank 'x1'",
                "INVALID_ARGUMENT",
                lambda: self._invalid_generate(i, lambda r: None, (("openengine-target-dp-rank", "x1"),)),
            ),
            (
                "Abort without a target",
                "INVALID_ARGUMENT",
                lambda: self.control(i).Abort(lifecycle_pb2.AbortRequest(), timeout=CALL_TIMEOUT_S),
            ),
            (
                "Abort of an unknown id",
                "NOT_FOUND",
                lambda: self.control(i).Abort(
                    lifecycle_pb2.AbortRequest(request_id=f"{self.id_prefix}-never-{i}"), timeout=CALL_TIMEOUT_S
                ),
            ),
        ]
        name, wanted, call = cases[self.next_case("invalid", len(cases))]
        try:
            result = call()
            if isinstance(result, grpc.aio.UnaryStreamCall):
                await self.read_to_end(result)
            else:
                await result
            self.tally.add("invalid", f"{name}: accepted")
        except grpc.aio.AioRpcError as exc:
            code, details = _error_outcome(exc)
            self.tally.add("invalid", code if code == wanted else f"{name}: {code} instead of {wanted}", details)

    async def op_disconnect(self, i: int) -> None:
        relay = AbruptRelay(self.target)  # one per disconnect: a cut drops this operation's connection only
        channel = grpc.aio.insecure_channel(await relay.start(), options=channel_options())
        try:
            stub = openengine_pb2_grpc.InferenceStub(channel)
            calls = [
                stub.Generate(self.request(i, LONG_TOKENS, f"-d{k}"), timeout=CALL_TIMEOUT_S)
                for k in range(STREAMS_PER_DISCONNECT)
            ]
            for call in calls:
                tokens, ended = await self.read_tokens(call, 1)
                if ended:
                    self.tally.add("disconnect", f"stream ended before the disconnect ({ended})")
            relay.cut()
            for call in calls:
                try:
                    await self.read_to_end(call)
                    self.tally.add("disconnect", "stream went on after the disconnect")
                except grpc.aio.AioRpcError as exc:
                    self.tally.add("disconnect", *_error_outcome(exc))
        finally:
            await channel.close()
            await relay.close()


async def running_requests(target: str) -> int:
    """Requests the deployment runs (`Control.GetLoad`, from the nodes' heartbeats)."""
    async with grpc.aio.insecure_channel(target) as channel:
        load = await openengine_pb2_grpc.ControlStub(channel).GetLoad(server_pb2.GetLoadRequest(), timeout=10)
        return load.running_requests + load.queued_requests


async def live_reservations(coordinator_target: str) -> int:
    """Request ids the coordinator still holds (`GetClusterLoad`, internal API)."""
    from openengine_serve.api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc

    async with grpc.aio.insecure_channel(coordinator_target) as channel:
        load = await cluster_pb2_grpc.CoordinatorStub(channel).GetClusterLoad(
            cluster_pb2.GetClusterLoadRequest(), timeout=10
        )
        return load.live_reservations
