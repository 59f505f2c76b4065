"""The OpenAI API's edges: a request body lowered into an openengine.v1 GenerateRequest, and the request's
GenerateResponse records (built once by frontend/stream.py: text, token ids, logprobs, finish, usage) shaped into
OpenAI's responses and stream chunks. Nothing here detokenizes, matches stops or counts usage.

Every field OpenAI or the llama-server / vLLM extensions define is either mapped (docs/protocol.md, "HTTP") or
refused with a 400 naming it; a field that is not known at all is refused the same way.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ...api.openengine.v1 import generation_pb2 as G

FINISH_REASONS = {G.FINISH_REASON_STOP: "stop", G.FINISH_REASON_LENGTH: "length", G.FINISH_REASON_CANCELLED: "abort"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the served model's limit)


class BadRequest(Exception):
    """A body OpenAI's shapes do not allow, or a field this server does not serve: 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


# Fields refused whatever their value (unless null): what this server does not do.
REFUSED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "suffix": "suffix (insertion) is not supported",
    "reasoning_effort": "reasoning effort is not supported",
}
COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
    "frequency_penalty", "stream", "stream_options", "user", "logit_bias", "response_format",
    # llama-server / vLLM extensions
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "cache_salt",
    "cache_prompt",
}  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "metadata", "store", "add_generation_prompt",
}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of"}
MAX_TOP_LOGPROBS = 20


@dataclass
class Lowered:
    """A body lowered into openengine.v1, with what only the HTTP edge needs to shape the answer."""

    request: G.GenerateRequest
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: bool
    echo: str | None = None  # /v1/completions with echo: the prompt text put before each choice's text
    messages: list[dict] = field(default_factory=list)  # /v1/chat/completions: to render with the chat template


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def lower_chat(body: dict, request_id: str) -> Lowered:
    _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array of {role, content} objects", "messages")
    request = _common(body, request_id)
    max_tokens = _optional(body, "max_completion_tokens", int) or _optional(body, "max_tokens", int)
    if max_tokens is not None:
        request.stopping.max_tokens = _non_negative(max_tokens, "max_completion_tokens")
    logprobs = bool(_optional(body, "logprobs", bool))
    top = _optional(body, "top_logprobs", int)
    if top is not None:
        if not logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs must be 0 to {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    if logprobs:
        request.response.return_output_logprobs = True
        if top:
            request.response.output_candidates.top_n = top
    if _optional(body, "store", bool):
        raise BadRequest("store: true is not supported (this server keeps no completions)", "store")
    lowered = Lowered(request, *_stream_options(body), logprobs=logprobs)
    lowered.messages = [_message(m, i) for i, m in enumerate(messages)]
    return lowered


def lower_completion(body: dict, request_id: str) -> Lowered:
    _check_fields(body, COMPLETION_FIELDS)
    request = _common(body, request_id)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if any(t < 0 for t in prompt):
            raise BadRequest("prompt token ids must be non-negative", "prompt")
        request.token_ids.ids.extend(prompt)
    else:
        raise BadRequest(
            "prompt must be a string or an array of token ids (one prompt per request; send several requests "
            "for a batch)",
            "prompt",
        )
    max_tokens = _optional(body, "max_tokens", int)
    request.stopping.max_tokens = _non_negative(
        COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, "max_tokens"
    )
    best_of = _optional(body, "best_of", int)
    if best_of is not None and best_of != request.sampling.num_sequences and best_of != 1:
        raise BadRequest("best_of is not supported (only best_of = n)", "best_of")
    logprobs = _optional(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"logprobs must be 0 to {MAX_TOP_LOGPROBS}, got {logprobs}", "logprobs")
    echo = bool(_optional(body, "echo", bool))
    if logprobs is not None:
        request.response.return_output_logprobs = True
        if logprobs:
            request.response.output_candidates.top_n = logprobs
        if echo:
            request.response.return_prompt_logprobs = True
            if logprobs:
                request.response.prompt_candidates.top_n = logprobs
    lowered = Lowered(request, *_stream_options(body), logprobs=logprobs is not None)
    if echo:
        lowered.echo = prompt if isinstance(prompt, str) else ""  # token ids: their text comes with the records
    return lowered


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if value is None:
            continue
        if name in REFUSED:
            raise BadRequest(f"{name}: {REFUSED[name]}", name, "unsupported_field")
        if name not in allowed:
            raise BadRequest(
                f"unknown or unsupported field {name!r}; supported: {', '.join(sorted(allowed))}",
                name,
                "unsupported_field",
            )
    if body.get("logit_bias"):
        raise BadRequest("logit_bias is not supported (only an empty map)", "logit_bias", "unsupported_field")


def _optional(body: dict, name: str, kind: type):
    value = body.get(name)
    if value is None:
        return None
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:
        expected = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}[kind]
        raise BadRequest(f"{name} must be {expected}, got {json.dumps(value)[:64]}", name)
    return value


def _non_negative(value: int, name: str) -> int:
    if value < 0:
        raise BadRequest(f"{name} must be non-negative, got {value}", name)
    return value


def _common(body: dict, request_id: str) -> G.GenerateRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required: a name from GET /v1/models", "model")
    request = G.GenerateRequest(request_id=request_id, model=model)
    sampling = request.sampling
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = _optional(body, name, float)
        if value is not None:
            setattr(sampling, name, value)
    top_k = _optional(body, "top_k", int)
    if top_k is not None and top_k > 0:  # llama-server and vLLM: 0 / -1 = disabled
        sampling.top_k = top_k
    seed = _optional(body, "seed", int)
    if seed is not None:
        if not 0 <= seed < 1 << 64:
            raise BadRequest(f"seed must be 0 to 2^64-1, got {seed}", "seed")
        sampling.seed = seed
    n = _optional(body, "n", int)
    if n is not None:
        if n < 1:
            raise BadRequest(f"n must be at least 1, got {n}", "n")
        sampling.num_sequences = n
    stopping = request.stopping
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("stop must be a non-empty string or an array of them", "stop")
        stopping.conditions.extend(G.StopCondition(stop_text=s) for s in stop)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(type(t) is int and t >= 0 for t in stop_ids):
            raise BadRequest("stop_token_ids must be an array of token ids", "stop_token_ids")
        stopping.conditions.extend(G.StopCondition(stop_token_id=t) for t in stop_ids)
    min_tokens = _optional(body, "min_tokens", int)
    if min_tokens is not None:
        stopping.min_tokens = _non_negative(min_tokens, "min_tokens")
    for name, target in (("ignore_eos", "ignore_eos"), ("include_stop_str_in_output", "include_stop_in_output")):
        value = _optional(body, name, bool)
        if value is not None:
            setattr(stopping, target, value)
    salt = _optional(body, "cache_salt", str)
    if salt is not None:
        request.kv.cache_salt = salt
    if _optional(body, "cache_prompt", bool) is False:  # llama-server's name: neither read nor kept in the cache
        request.kv.bypass_prefix_cache = True
    _guide(body, request.guided)
    return request


def _guide(body: dict, guided: G.GuidedDecoding) -> None:
    """response_format and the vLLM guided_* extensions: at most one guide."""
    chosen: list[str] = []
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            guided.json_object.SetInParent()
            chosen.append("response_format")
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise BadRequest("response_format.json_schema.schema must be a JSON schema object", "response_format")
            guided.json_schema = json.dumps(schema)
            chosen.append("response_format")
        elif kind != "text":
            raise BadRequest(
                "response_format.type must be text, json_object or json_schema", "response_format", "invalid_value"
            )
    guided_json = body.get("guided_json")
    if guided_json is not None:
        if isinstance(guided_json, dict):
            guided_json = json.dumps(guided_json)
        if not isinstance(guided_json, str):
            raise BadRequest("guided_json must be a JSON schema (object or string)", "guided_json")
        guided.json_schema = guided_json
        chosen.append("guided_json")
    for name, target in (("guided_regex", "regex"), ("guided_grammar", "ebnf_grammar")):
        value = _optional(body, name, str)
        if value is not None:
            setattr(guided, target, value)
            chosen.append(name)
    choices = body.get("guided_choice")
    if choices is not None:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise BadRequest("guided_choice must be a non-empty array of strings", "guided_choice")
        guided.choice.choices.extend(choices)
        chosen.append("guided_choice")
    if len(chosen) > 1:
        raise BadRequest(f"at most one guide: got {', '.join(chosen)}", chosen[1])


def _stream_options(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats: vLLM's completion tokens so far in every chunk)."""
    stream = bool(_optional(body, "stream", bool))
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options needs stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise BadRequest("stream_options may hold include_usage and continuous_usage_stats", "stream_options")
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
    return stream, include_usage, continuous


def _message(message, index: int) -> dict:
    """One chat message as the template takes it: role and text content (text parts joined)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object with role and content", where)
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise BadRequest(
            f"{where}.role must be system, developer, user or assistant, got {json.dumps(role)[:40]} "
            "(tool messages: tool calling is not supported)",
            f"{where}.role",
        )
    for name in message:
        if name not in ("role", "content", "name") and message[name] is not None:
            raise BadRequest(f"{where}.{name} is not supported", f"{where}.{name}", "unsupported_field")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(
                    f"{where}.content[{j}]: only text parts are supported, got type {json.dumps(kind)[:40]}",
                    f"{where}.content[{j}].type",
                    "unsupported_content",
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or an array of text parts", f"{where}.content")
    shaped = {"role": "system" if role == "developer" else role, "content": content}
    if isinstance(message.get("name"), str):
        shaped["name"] = message["name"]
    return shaped


# ------------------------------------------------------------------ the output records, shaped


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    tokens: list[G.TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # stream: its first chunk went out


class Shaper:
    """The records of one request shaped as one API's answer: `chunks(record)` for a stream (SSE events),
    `collect(record)` then `response()` otherwise. `chat` picks chat.completion or text_completion."""

    def __init__(self, lowered: Lowered, model: str, chat: bool, token_text: Callable[[list[int]], str]) -> None:
        self.lowered = lowered
        self.model = model
        self.chat = chat
        self.id = lowered.request.request_id
        self.created = int(time.time())
        self.choices = [Choice() for _ in range(max(1, lowered.request.sampling.num_sequences))]
        self.usage: dict | None = None
        self.completion_tokens = 0  # token records streamed so far (continuous_usage_stats)
        self.prompt_tokens: list[G.TokenInfo] = []
        self.token_text = token_text
        self.object = "chat.completion" if chat else "text_completion"

    # ---- records in
    def _take(self, record: G.GenerateResponse) -> tuple[str, int, G.TokenOutput | G.GenerationFinished | None]:
        event = record.WhichOneof("event")
        if event == "token":
            return event, record.token.output_index, record.token
        if event == "finished":
            if record.HasField("usage"):
                self.usage = _usage(record.usage)
            return event, record.finished.output_index, record.finished
        if event == "prompt":
            self.prompt_tokens = list(record.prompt.tokens)
        return event or "", 0, None

    def collect(self, record: G.GenerateResponse) -> None:
        event, index, body = self._take(record)
        choice = self.choices[index]
        if event == "token":
            choice.text.append(body.text)  # type: ignore[union-attr]
            choice.tokens.extend(body.tokens)  # type: ignore[union-attr]
        elif event == "finished":
            choice.finish_reason = FINISH_REASONS.get(body.reason, "stop")  # type: ignore[union-attr]

    def response(self) -> dict:
        choices = []
        for index, choice in enumerate(self.choices):
            text = self._echo() + "".join(choice.text)
            if self.chat:
                shaped = {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": self._chat_logprobs(choice.tokens),
                    "finish_reason": choice.finish_reason,
                }
            else:
                shaped = {
                    "index": index,
                    "text": text,
                    "logprobs": self._completion_logprobs(choice.tokens, echo=True),
                    "finish_reason": choice.finish_reason,
                }
            choices.append(shaped)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage,
        }

    def chunks(self, record: G.GenerateResponse) -> list[bytes]:
        event, index, body = self._take(record)
        if event not in ("token", "finished"):
            return []
        choice = self.choices[index]
        out = []
        if event == "token":
            text = body.text  # type: ignore[union-attr]
            if not choice.started:
                choice.started = True
                text = self._echo() + text
            if self.chat:
                delta: dict = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
                if self.lowered.logprobs:
                    delta["logprobs"] = self._chat_logprobs(body.tokens)  # type: ignore[union-attr]
            else:
                delta = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
                if self.lowered.logprobs:
                    delta["logprobs"] = self._completion_logprobs(list(body.tokens), echo=False)  # type: ignore[union-attr]
            usage = None
            if self.lowered.continuous_usage:
                self.completion_tokens += len(body.tokens)  # type: ignore[union-attr]
                usage = {"completion_tokens": self.completion_tokens}
            out.append(self._chunk([delta], usage))
        else:
            reason = FINISH_REASONS.get(body.reason, "stop")  # type: ignore[union-attr]
            done: dict = {"index": index, "logprobs": None, "finish_reason": reason}
            if self.chat:
                done["delta"] = {}
            else:
                done["text"] = ""
            out.append(self._chunk([done]))
            if self.usage is not None and self.lowered.include_usage:
                out.append(self._chunk([], usage=self.usage))
        return out

    def start_chunks(self) -> list[bytes]:
        """Chat streams open each choice with the assistant's role, as OpenAI's do."""
        if not self.chat:
            return []
        return [
            self._chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
            for i in range(len(self.choices))
        ]

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        chunk: dict = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.lowered.include_usage:
            chunk["usage"] = usage
        return sse(chunk)

    def _echo(self) -> str:
        echo = self.lowered.echo
        if echo is None:
            return ""
        if not echo and self.lowered.request.WhichOneof("input") == "token_ids":
            return self.token_text(list(self.lowered.request.token_ids.ids))
        return echo

    def _chat_logprobs(self, tokens) -> dict | None:
        if not self.lowered.logprobs:
            return None
        return {
            "content": [
                {
                    "token": t.token,
                    "logprob": t.logprob,
                    "bytes": list(t.token.encode()),
                    "top_logprobs": [
                        {"token": c.token, "logprob": c.logprob, "bytes": list(c.token.encode())} for c in t.candidates
                    ],
                }
                for t in tokens
            ]
        }

    def _completion_logprobs(self, tokens: list[G.TokenInfo], echo: bool) -> dict | None:
        if not self.lowered.logprobs:
            return None
        if echo and self.lowered.echo is not None:
            tokens = self.prompt_tokens + tokens
        offsets, offset = [], 0
        for t in tokens:
            offsets.append(offset)
            offset += len(t.token)
        return {
            "tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob if t.HasField("logprob") else None for t in tokens],
            "top_logprobs": [
                {c.token: c.logprob for c in t.candidates} if t.HasField("logprob") else None for t in tokens
            ],
            "text_offset": offsets,
        }


def _usage(usage: G.Usage) -> dict:
    shaped: dict = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.HasField("cached_prompt_tokens"):
        shaped["prompt_tokens_details"] = {"cached_tokens": usage.cached_prompt_tokens}
    return shaped


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
