"""The OpenAI-compatible HTTP API of a frontend worker (Starlette): each generation request is lowered into an
openengine.v1 GenerateRequest and run by the same `Inference.run` as the gRPC Generate (admission, keys, limits,
routing, cancellation, drain, metrics, traces); its GenerateResponse records are shaped by `openai.Shaper`."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ...api.openengine.v1 import error_pb2
from ...api.openengine.v1 import generation_pb2 as G
from ...chat import ChatTemplateError, render_messages
from ..auth import KeyStore, bind_caller
from ..inference import RETRY_AFTER_MS, RETRYABLE_REFUSALS, Inference
from ..refusal import DuplicateRequest, InvalidRequest, NotPermitted, NotServed, Refusal, Unavailable, Unsupported
from . import openai
from .openai import BadRequest, Lowered, Shaper, error_body

MAX_BODY_BYTES = 16 << 20  # a request body beyond it is refused (413) before it is parsed
REQUEST_ID_HEADER = "x-request-id"  # as vLLM: the request's id instead of a generated one
ERROR_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}
REFUSAL_STATUS: dict[type[Refusal], int] = {
    InvalidRequest: 400,
    Unsupported: 400,
    NotPermitted: 403,
    NotServed: 404,
    DuplicateRequest: 409,
    Unavailable: 503,
}


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers: dict[str, str] = {}


def error_response(error: HttpError) -> JSONResponse:
    kind = ERROR_KINDS.get(error.status, "invalid_request_error")
    return JSONResponse(
        error_body(error.message, kind, error.param, error.code), status_code=error.status, headers=error.headers
    )


def refusal_error(refusal: Refusal) -> HttpError:
    if isinstance(refusal, RETRYABLE_REFUSALS):
        error = HttpError(429, refusal.message, code="rate_limit_exceeded")
        error.headers["retry-after"] = str(math.ceil(RETRY_AFTER_MS / 1000))
        return error
    status = REFUSAL_STATUS.get(type(refusal), 400)
    code = {404: "model_not_found", 503: "unavailable"}.get(status)
    return HttpError(status, refusal.message, "model" if status == 404 else None, code)


class OpenAIApi:
    def __init__(self, inference: Inference, keys: KeyStore | None) -> None:
        self.inference = inference
        self.keys = keys
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
            ],
            exception_handlers={HttpError: lambda _request, exc: error_response(exc), 404: _not_found},
        )

    # ---- probes (open, like the gRPC health services)
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        health = self.inference.health
        if health.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not health.ready:
            return JSONResponse({"status": "not ready"}, status_code=503)
        return JSONResponse({"status": "ready"})

    # ---- the API
    async def models(self, request: Request) -> Response:
        self._authenticate(request)
        self._loaded()  # 503 before the first model is loaded
        owned = {"object": "model", "created": 0, "owned_by": "openengine-serve"}
        data = []
        for name in self.inference.model.names():
            loaded = self._loaded(name)
            if name == loaded.name:
                data.append({"id": name, **owned, "max_model_len": loaded.limits.max_context_length})
            else:
                data.append({"id": name, **owned, "root": loaded.name})
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, request: Request) -> Response:
        self._authenticate(request)
        body = await _json_body(request)
        lowered = _lowering(openai.lower_chat, body, request, "chatcmpl")
        loaded = self._loaded(lowered.request.model)
        template = loaded.tokenizer.chat_template
        if not template:
            raise HttpError(
                400, f"model {loaded.name!r} has no chat template; use /v1/completions with a prompt", "messages"
            )
        add_generation_prompt = body.get("add_generation_prompt", True)
        try:
            render = lambda: render_messages(  # noqa: E731
                template,
                lowered.messages,
                bos_token=loaded.tokenizer.bos_token,
                eos_token=loaded.tokenizer.eos_token,
                add_generation_prompt=add_generation_prompt is not False,
            )
            size = sum(len(m["content"]) for m in lowered.messages)
            lowered.request.prompt = await asyncio.to_thread(render) if size > 4096 else render()
        except ChatTemplateError as exc:
            raise HttpError(400, str(exc), "messages") from None
        return Generation(self, lowered, request, chat=True)

    async def completions(self, request: Request) -> Response:
        self._authenticate(request)
        body = await _json_body(request)
        return Generation(self, _lowering(openai.lower_completion, body, request, "cmpl"), request, chat=False)

    async def tokenize(self, request: Request) -> Response:
        """llama-server's and vLLM's: {"content" | "prompt": text} -> {"tokens": [...], "count", "max_model_len"}."""
        self._authenticate(request)
        body = await _json_body(request)
        text = body.get("prompt", body.get("content"))
        if not isinstance(text, str):
            raise HttpError(400, "prompt (or content) must be a string", "prompt")
        loaded = self._loaded(str(body.get("model", "")))
        if len(text.encode()) > loaded.limits.max_prompt_bytes:
            raise HttpError(400, f"prompt is longer than {loaded.limits.max_prompt_bytes} bytes", "prompt")
        tokens = await asyncio.to_thread(loaded.tokenizer.encode, text)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": loaded.limits.max_context_length})

    async def detokenize(self, request: Request) -> Response:
        """{"tokens": [ids]} -> {"prompt": text, "content": text} (vLLM's and llama-server's names)."""
        self._authenticate(request)
        body = await _json_body(request)
        tokens = body.get("tokens")
        loaded = self._loaded(str(body.get("model", "")))
        vocab = loaded.limits.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise HttpError(400, f"tokens must be an array of token ids (0 to {vocab - 1})", "tokens")
        text = loaded.tokenizer.decode_bytes(tokens).decode("utf-8", "replace")
        return JSONResponse({"prompt": text, "content": text})

    def _authenticate(self, request: Request) -> None:
        """With keys on: the caller's key from `Authorization: Bearer`, bound to this request's task (the same
        context the gRPC interceptor sets). Every HTTP endpoint but the probes is a user-role call."""
        if self.keys is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise HttpError(401, "an API key is required: send the header `Authorization: Bearer <key>`",
                            code="missing_api_key")  # fmt: skip
        key = self.keys.authenticate(token.strip())
        if key is None:
            raise HttpError(401, "the API key is not valid", code="invalid_api_key")
        bind_caller(key, self.keys)

    def _loaded(self, name: str = ""):
        """The model `name` names (the default model for "" or an unknown name: validation refuses the latter)."""
        try:
            return self.inference.loaded(name)
        except Unavailable as exc:
            raise HttpError(503, exc.message, code="unavailable") from None


def _lowering(lower: Callable[[dict, str], Lowered], body: dict, request: Request, prefix: str) -> Lowered:
    request_id = request.headers.get(REQUEST_ID_HEADER) or openai.new_id(prefix)
    try:
        return lower(body, request_id)
    except BadRequest as exc:
        raise HttpError(400, exc.message, exc.param, exc.code) from None


async def _json_body(request: Request) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HttpError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HttpError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise HttpError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    return body


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(HttpError(404, f"no route {request.method} {request.url.path}; see /v1/models"))


class Generation(Response):
    """Runs one lowered request in the HTTP request's own task (which the request owner cancels on a stall, and
    this cancels when the client disconnects), writing its records as SSE chunks or one JSON answer."""

    def __init__(self, api: OpenAIApi, lowered: Lowered, request: Request, chat: bool) -> None:
        self.api, self.lowered, self.chat = api, lowered, chat
        self.metadata = [(k, v) for k, v in request.headers.items() if k != "authorization"]
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        inference = self.api.inference
        request = self.lowered.request
        loaded = self.api._loaded(request.model)
        shaper = Shaper(self.lowered, request.model, self.chat, lambda ids: loaded.tokenizer.decode_bytes(ids).decode(
            "utf-8", "replace"))  # fmt: skip
        if request.model != loaded.name and request.model in loaded.limits.aliases:
            shaper.model = request.model
        stream = self.lowered.stream
        started = False
        failure: G.GenerateResponse | None = None

        async def write(record) -> None:
            nonlocal started, failure
            if type(record) is bytes:
                record = G.GenerateResponse.FromString(record)
            if record.WhichOneof("event") == "error":
                failure = record
                return
            if not stream:
                shaper.collect(record)
                return
            body = b"".join(shaper.chunks(record))
            if not started:
                started = True
                await _start(send, 200, "text/event-stream", request.request_id)
                body = b"".join(shaper.start_chunks()) + body
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})

        task = asyncio.current_task()
        assert task is not None
        disconnected = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()
            task.cancel()  # the request owner frees the engine slot and releases the id

        watcher = asyncio.create_task(watch())
        try:
            await inference.run(request, self.metadata, write)
        except Refusal as exc:
            watcher.cancel()
            await _send_error(send, refusal_error(exc))
            return
        except asyncio.CancelledError:
            # The client left (or stalled: the request owner already ended the request). Nothing more to send.
            task.uncancel()
            return
        finally:
            watcher.cancel()
        if failure is not None:
            error = failure.error
            status = 503 if error.code == error_pb2.ERROR_CODE_DRAINING else 500
            shaped = HttpError(status, error.message, code="retryable" if error.retryable else "engine_error")
            if not started:
                await _send_error(send, shaped)
                return
            kind = ERROR_KINDS[status]
            body = openai.sse(error_body(shaped.message, kind, None, shaped.code)) + openai.SSE_DONE
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        if stream:
            if not started:
                await _start(send, 200, "text/event-stream", request.request_id)
            await send({"type": "http.response.body", "body": openai.SSE_DONE, "more_body": False})
        else:
            body = json.dumps(shaper.response(), separators=(",", ":")).encode()
            await _start(send, 200, "application/json", request.request_id, len(body))
            await send({"type": "http.response.body", "body": body, "more_body": False})


async def _start(send: Send, status: int, content_type: str, request_id: str, length: int | None = None) -> None:
    headers = [(b"content-type", content_type.encode()), (b"x-request-id", request_id.encode())]
    if content_type == "text/event-stream":
        headers.append((b"cache-control", b"no-cache"))
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def _send_error(send: Send, error: HttpError) -> None:
    kind = ERROR_KINDS.get(error.status, "invalid_request_error")
    body = json.dumps(error_body(error.message, kind, error.param, error.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
