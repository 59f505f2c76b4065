"""The load generator: grpc.aio clients in worker processes pinned off the frontend's core.

Two workloads, both 32 prompt token ids -> 128 output tokens (`ignore_eos`):

- fixed: open-loop Poisson arrivals at a given rate; the schedule (arrival
  times, request ids, seeds, prompts) is precomputed by the orchestrator, so
  both servers get exactly the same requests at the same offsets;
- saturation: N slots, each issuing its next request as soon as the last one
  ended (N requests in flight); slot s's j-th request has id `...-s<s>-<j>`
  and a seed derived from (s, j), so both servers see the same ids and seeds.

Request k (or slot s) goes to connection k mod C; connection c belongs to
worker process c mod P. Each connection is its own channel with a local
subchannel pool, i.e. its own TCP connection.

Per message the client does the minimum: requests go out pre-serialized and
responses arrive as raw bytes (no protobuf objects): `scan_response` walks the
wire format just far enough to find the event and the token ids, then one
clock read and a window check. A request's token ids are hashed when it ends
(so the two servers' outputs can be compared per request).
Counters are kept for the measured window [t0, t1) only: tokens whose message
arrived in it, TTFT of requests started in it, inter-token gaps ending in it.
All processes read the same CLOCK_MONOTONIC (`time.monotonic`).
"""

from __future__ import annotations

import array
import asyncio
import gc
import hashlib
import multiprocessing
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import grpc

from openengine_serve.api.openengine.v1 import generation_pb2
from openengine_serve.client import Credentials, open_async_channel
from openengine_serve.common.lifecycle import freeze_startup_objects, new_event_loop
from openengine_serve.common.wire.protobuf import read_varint, skip

from . import h2client
from .h2client import StreamError

MASK64 = (1 << 64) - 1
MODEL = "Qwen/Qwen3-0.6B"
GENERATE = "/openengine.v1.Inference/Generate"
RPC_TIMEOUT_S = 600.0
CONNECT_MARGIN_S = 1.0  # between handing out jobs and the first request: channels connect meanwhile
SETTLE_S = 0.5  # pause after a window (saturation: the frontend cleans up the cancelled streams)


# ---------------------------------------------------------------- deterministic requests


def prompt_ids(key: int, length: int) -> list[int]:
    """`length` token ids determined by `key` (within the regular vocabulary)."""
    x = (key * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & MASK64
    out = []
    for _ in range(length):
        x = (x * 6364136223846793005 + 1442695040888963407) & MASK64
        out.append(1000 + (x >> 33) % 100_000)
    return out


def poisson_arrivals(rate: float, duration_s: float, seed: str) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process; the same seed gives the same schedule."""
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(t)


def digest(token_ids: Sequence[int]) -> str:
    return hashlib.blake2b(array.array("I", token_ids).tobytes(), digest_size=8).hexdigest()


def build_request(
    request_id: str, key: int, prompt_tokens: int, output_tokens: int, model: str = MODEL
) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        model=model,
        token_ids=generation_pb2.TokenIds(ids=prompt_ids(key, prompt_tokens)),
        sampling=generation_pb2.SamplingParams(seed=key & MASK64),
        stopping=generation_pb2.StoppingOptions(max_tokens=output_tokens, ignore_eos=True),
    )


# GenerateResponse's oneof `event` (field numbers from the generated descriptor, never literals that could drift)
_EVENT_FIELDS = {f.number: f.name for f in generation_pb2.GenerateResponse.DESCRIPTOR.oneofs_by_name["event"].fields}
_TOKEN_FIELD = generation_pb2.GenerateResponse.DESCRIPTOR.fields_by_name["token"].number
_TOKENS_FIELD = generation_pb2.TokenOutput.DESCRIPTOR.fields_by_name["tokens"].number
_TOKEN_ID_FIELD = generation_pb2.TokenInfo.DESCRIPTOR.fields_by_name["token_id"].number


def _token_ids(data: bytes, i: int, end: int, out: list[int]) -> None:
    """Appends the token_id of every TokenInfo in the TokenOutput bytes data[i:end]."""
    while i < end:
        key, i = read_varint(data, i)
        if key >> 3 == _TOKENS_FIELD and key & 7 == 2:
            length, i = read_varint(data, i)
            info_end = i + length
            token_id = 0  # proto3 default: an id of 0 is not on the wire
            while i < info_end:
                info_key, i = read_varint(data, i)
                if info_key >> 3 == _TOKEN_ID_FIELD and info_key & 7 == 0:
                    token_id, i = read_varint(data, i)
                else:
                    i = skip(data, i, info_key & 7)
            out.append(token_id)
        else:
            i = skip(data, i, key & 7)


def scan_response(data: bytes, token_ids: list[int]) -> str | None:
    """The event of serialized GenerateResponse bytes ("token", "finished", "error", ...; None: none set);
    for "token" the token ids are appended to `token_ids`. Reads only what it needs: no message objects."""
    i, end = 0, len(data)
    while i < end:
        key, i = read_varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 2 and field in _EVENT_FIELDS:
            length, i = read_varint(data, i)
            if field == _TOKEN_FIELD:
                _token_ids(data, i, i + length, token_ids)
            return _EVENT_FIELDS[field]
        i = skip(data, i, wire)
    return None


def channel_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", 16 * 1024 * 1024),
        ("grpc.enable_retries", 0),
        # Without a local pool, channels to one target share one subchannel, i.e. one TCP connection.
        ("grpc.use_local_subchannel_pool", 1),
    ]


# ---------------------------------------------------------------- one worker's job


class _Run:
    """State of one job in one worker process."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.t0 = job["t0"]
        self.t1 = job["t1"]
        self.output_tokens = job["output_tokens"]
        self.prompt_tokens = job["prompt_tokens"]
        self.model = job.get("model", MODEL)
        self.window_tokens = 0
        self.window_messages = 0
        self.tokens = 0
        self.started = 0
        self.completed = 0
        self.errors: dict[str, int] = {}
        self.ttft = array.array("d")
        self.itl = array.array("d")
        self.hashes: dict[str, str] = {}
        self.lag_max = 0.0
        self.closing = False  # set when the run cancels what is still open on purpose
        self.cancelled_at_end = 0
        self.eof = h2client.EOF if job.get("client") == "h2" else grpc.aio.EOF
        api_key = job.get("api_key") or ""
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def request_bytes(self, request_id: str, key: int) -> bytes:
        return build_request(request_id, key, self.prompt_tokens, self.output_tokens, self.model).SerializeToString()

    async def request(self, call_factory, request_id: str, key: int, request: bytes | None = None) -> None:
        if request is None:
            request = self.request_bytes(request_id, key)
        now_fn = time.monotonic
        t0, t1 = self.t0, self.t1
        ids: list[int] = []
        last = None
        finished = False
        self.started += 1
        started = now_fn()
        ttft_counted = t0 <= started < t1
        ttft, itl = self.ttft, self.itl
        eof = self.eof
        try:
            call = call_factory(request, timeout=RPC_TIMEOUT_S, metadata=self.metadata)
            read = call.read
            while (response := await read()) is not eof:
                now = now_fn()
                had = len(ids)
                event = scan_response(response, ids)
                if event == "token":
                    if t0 <= now < t1:
                        self.window_tokens += len(ids) - had
                        self.window_messages += 1
                        if last is not None:
                            itl.append(now - last)
                    if last is None and ttft_counted:
                        ttft.append(now - started)
                    last = now
                elif event == "finished":
                    finished = True
                elif event == "error":
                    self.error("engine_error")
                    return
        except grpc.aio.AioRpcError as exc:
            self.error(exc.code().name)
            return
        except StreamError as exc:
            self.error(exc.kind)
            return
        except asyncio.CancelledError:
            if self.closing:
                self.cancelled_at_end += 1
            else:
                self.error("unfinished_at_drain_deadline")
            raise
        except Exception as exc:  # noqa: BLE001 - counted and reported, never hides a bad run
            self.error(type(exc).__name__)
            return
        self.tokens += len(ids)
        if not finished or len(ids) != self.output_tokens:
            self.error("short_stream")
            return
        self.completed += 1
        self.hashes[request_id] = digest(ids)

    def result(self) -> dict[str, Any]:
        return {
            "window_tokens": self.window_tokens,
            "window_messages": self.window_messages,
            "tokens": self.tokens,
            "started": self.started,
            "completed": self.completed,
            "errors": self.errors,
            "ttft": self.ttft.tobytes(),
            "itl": self.itl.tobytes(),
            "hashes": self.hashes,
            "lag_max_s": self.lag_max,
            "cancelled_at_end": self.cancelled_at_end,
        }


async def run_job(job: dict[str, Any]) -> dict[str, Any]:
    run = _Run(job)
    connections, procs, index = job["connections"], job["procs"], job["index"]
    mine = [c for c in range(connections) if c % procs == index]
    channels: dict[int, Any] = {}
    try:
        if job.get("client") == "h2":
            if job.get("tls"):
                raise ValueError("the h2 load generator is plaintext only; use --client grpc-aio for TLS")
            for c, opened in zip(
                mine,
                await asyncio.wait_for(
                    asyncio.gather(
                        *(h2client.Connection.open(job["target"], GENERATE, run.metadata or ()) for _ in mine)
                    ),
                    20.0,
                ),
            ):
                channels[c] = opened
            calls = {c: ch.generate for c, ch in channels.items()}
        else:
            channels = {c: _open_channel(job) for c in mine}
            await asyncio.wait_for(asyncio.gather(*(ch.channel_ready() for ch in channels.values())), 20.0)
            # No serializer either way: requests go out as prepared bytes, responses come in as bytes.
            calls = {c: ch.unary_stream(GENERATE) for c, ch in channels.items()}
        # Fixed load: every request is serialized before the first arrival; the window pays only for sending.
        prepared = {
            k: run.request_bytes(f"{job['id_prefix']}-{k}", job["key_base"] + k) for k, _ in job.get("arrivals", ())
        }
        delay = job["start_at"] - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks: list[asyncio.Task] = []
        if job["kind"] == "fixed":
            await _fixed(run, job, calls, tasks, prepared)
        else:
            _saturation(run, job, calls, tasks)
        if job["kind"] == "fixed":
            # Every scheduled request runs to its end; one still open after the drain timeout is an error.
            deadline = job["stop_at"] + job["drain_timeout_s"]
        else:
            # Saturation: the window is over at stop_at; what is still streaming then is cancelled, by design.
            deadline = job["stop_at"]
        pending: set[asyncio.Task] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        run.closing = job["kind"] != "fixed"
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await asyncio.gather(*(ch.close() for ch in channels.values()), return_exceptions=True)
    return run.result()


def _open_channel(job: dict[str, Any]) -> grpc.aio.Channel:
    """One channel (its own TCP connection); TLS as the job's `tls` says (CA file or the system roots, a client
    certificate for mutual TLS)."""
    tls = job.get("tls")
    if not tls:
        return grpc.aio.insecure_channel(job["target"], options=channel_options())
    credentials = Credentials(tls=True, **tls)  # API keys go as metadata of each call (not an interceptor)
    return open_async_channel(job["target"], channel_options(), credentials)


async def _fixed(run: _Run, job: dict[str, Any], calls: dict, tasks: list, prepared: dict[int, bytes]) -> None:
    connections = job["connections"]
    base = job["start_at"]
    prefix = job["id_prefix"]
    for k, offset in job["arrivals"]:
        delay = base + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            run.lag_max = max(run.lag_max, -delay)
        tasks.append(
            asyncio.create_task(
                run.request(calls[k % connections], f"{prefix}-{k}", job["key_base"] + k, prepared.pop(k))
            )
        )


def _saturation(run: _Run, job: dict[str, Any], calls: dict, tasks: list) -> None:
    connections = job["connections"]
    prefix = job["id_prefix"]
    stop_at = job["stop_at"]

    async def slot(s: int) -> None:
        call = calls[s % connections]
        j = 0
        while time.monotonic() < stop_at:
            await run.request(call, f"{prefix}-s{s}-{j}", job["key_base"] + s * 100_000 + j)
            j += 1

    for s in job["slots"]:
        tasks.append(asyncio.create_task(slot(s)))


# ---------------------------------------------------------------- worker processes


def _worker_main(conn, cpus: list[int] | None, loop_name: str = "") -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)  # before grpc starts its threads: they inherit the mask
    # The components' loop (uvloop where it exists) unless asked for asyncio's own (as a plain grpc.aio client runs)
    loop = asyncio.new_event_loop() if loop_name == "asyncio" else new_event_loop()
    asyncio.set_event_loop(loop)
    # As the components do: a collection in this process would pause its loop inside a window, and its TTFT and
    # ITL would count that against the server. Each job's garbage goes before the next job.
    freeze_startup_objects()
    while True:
        job = conn.recv()
        if job is None:
            break
        gc.collect()
        try:
            conn.send(loop.run_until_complete(run_job(job)))
        except Exception as exc:  # noqa: BLE001 - reported to the orchestrator
            conn.send({"fatal": f"{type(exc).__name__}: {exc}"})
    loop.close()


class LoadPool:
    """P persistent load-generator processes (spawned, pinned), driven job by job."""

    def __init__(self, procs: int, cpus: Sequence[int] | None, loop_name: str = "") -> None:
        ctx = multiprocessing.get_context("spawn")
        self.workers = []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, list(cpus) if cpus else None, loop_name), daemon=True)
            proc.start()
            self.workers.append((proc, parent))

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p, _ in self.workers if p.pid is not None]  # all of them: started in __init__

    def submit(self, jobs: Sequence[dict[str, Any]]) -> None:
        for (_, conn), job in zip(self.workers, jobs):
            conn.send(job)

    def collect(self, count: int, timeout: float) -> list[dict[str, Any]]:
        out = []
        for _, conn in self.workers[:count]:
            if not conn.poll(timeout):
                raise RuntimeError(f"a load generator did not report within {timeout:.0f}s")
            result = conn.recv()
            if "fatal" in result:
                raise RuntimeError(f"load generator failed: {result['fatal']}")
            out.append(result)
        return out

    def close(self) -> None:
        for _proc, conn in self.workers:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc, _ in self.workers:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def make_jobs(
    *,
    kind: str,
    target: str,
    connections: int,
    procs: int,
    start_at: float,
    t0: float,
    t1: float,
    stop_at: float,
    drain_timeout_s: float,
    id_prefix: str,
    key_base: int,
    prompt_tokens: int,
    output_tokens: int,
    arrivals: Sequence[float] = (),
    inflight: int = 0,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One job per worker process that has connections (P' = min(P, C)); `extra` (e.g. `tls`, `api_key`, `model`)
    is copied into every job."""
    procs = max(1, min(procs, connections))
    jobs = []
    for index in range(procs):
        job = {
            "kind": kind,
            "target": target,
            "connections": connections,
            "procs": procs,
            "index": index,
            "start_at": start_at,
            "t0": t0,
            "t1": t1,
            "stop_at": stop_at,
            "drain_timeout_s": drain_timeout_s,
            "id_prefix": id_prefix,
            "key_base": key_base,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            **(extra or {}),
        }
        if kind == "fixed":
            job["arrivals"] = [(k, a) for k, a in enumerate(arrivals) if (k % connections) % procs == index]
        else:
            job["slots"] = [s for s in range(inflight) if (s % connections) % procs == index]
        jobs.append(job)
    return jobs


def merge_results(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Sums the counters of every worker's result; concatenates samples; unions hashes."""
    merged: dict[str, Any] = {
        "window_tokens": 0,
        "window_messages": 0,
        "tokens": 0,
        "started": 0,
        "completed": 0,
        "cancelled_at_end": 0,
        "errors": {},
        "ttft": [],
        "itl": [],
        "hashes": {},
        "lag_max_s": 0.0,
    }
    for r in results:
        for key in ("window_tokens", "window_messages", "tokens", "started", "completed", "cancelled_at_end"):
            merged[key] += r[key]
        for kind, n in r["errors"].items():
            merged["errors"][kind] = merged["errors"].get(kind, 0) + n
        merged["ttft"].extend(array.array("d", r["ttft"]))
        merged["itl"].extend(array.array("d", r["itl"]))
        merged["hashes"].update(r["hashes"])
        merged["lag_max_s"] = max(merged["lag_max_s"], r["lag_max_s"])
    return merged


def sleep_until(at: float) -> None:
    delay = at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
