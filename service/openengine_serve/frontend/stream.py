"""Turns a request's engine events into OpenEngine GenerateResponse messages.

One `OutputStream` per output (num_sequences): incremental detokenization,
stop strings across token boundaries, exactly one `finished`. The engine sends
the token that ended an output (EOS or a stop token) as its last record.
"""

from __future__ import annotations

from typing import cast

from ..api.openengine.v1 import error_pb2, generation_pb2
from ..api.openengine_internal.v1 import cluster_pb2
from ..api.openengine_internal.v1.cluster_pb2 import (
    ENGINE_FINISH_CANCELLED,
    ENGINE_FINISH_EOS,
    ENGINE_FINISH_LENGTH,
    ENGINE_FINISH_NONE,
    ENGINE_FINISH_STOP_TOKEN,
)
from ..common.wire.protobuf import length_delimited, varint
from .text import IncrementalDetokenizer, StopStringMatcher
from .validation import GenerationPlan

FINISH_STOP = generation_pb2.FINISH_REASON_STOP
FINISH_LENGTH = generation_pb2.FINISH_REASON_LENGTH
FINISH_CANCELLED = generation_pb2.FINISH_REASON_CANCELLED


class TokenStrings:
    """token id -> its own text (bytes decoded with replacement), and its serialized TokenInfo; cached, so a
    token costs one dict lookup."""

    def __init__(self, encoding) -> None:
        self._encoding = encoding
        self._cache: dict[int, str] = {}
        self._info_bytes: dict[int, bytes] = {}
        self._pieces: dict[int, bytes | None] = {}
        self._first_output_deltas: dict[int, bytes | None] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._encoding.decode_single_token_bytes(token_id).decode("utf-8", "replace")
            self._cache[token_id] = text
        return text

    def info_field(self, token_id: int) -> bytes:
        """`TokenOutput.tokens` entry (field 2) holding TokenInfo{token_id, token}, serialized once per id."""
        field = self._info_bytes.get(token_id)
        if field is None:
            info = generation_pb2.TokenInfo(token_id=token_id, token=self(token_id)).SerializeToString()
            field = self._info_bytes[token_id] = length_delimited(_TOKENS_FIELD, info)
        return field

    def one_token_body(self, token_id: int) -> bytes | None:
        """`tokens` and `text` fields of a TokenOutput carrying just this token, or None when the token's
        bytes are not complete UTF-8 on their own (its text then depends on its neighbours)."""
        try:
            return self._pieces[token_id]
        except KeyError:
            pass
        raw = self._encoding.decode_single_token_bytes(token_id)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            body = None
        else:
            body = self.info_field(token_id) + (length_delimited(_TEXT_FIELD, raw) if raw else b"")
        self._pieces[token_id] = body
        return body

    def first_output_delta(self, token_id: int) -> bytes | None:
        """The `token` field (a TokenOutput of output 0 carrying just this token) of a GenerateResponse, cached per
        id; None like one_token_body."""
        try:
            return self._first_output_deltas[token_id]
        except KeyError:
            pass
        body = self.one_token_body(token_id)
        delta = None if body is None else length_delimited(_TOKEN_FIELD, output_index_field(0) + body)
        self._first_output_deltas[token_id] = delta
        return delta


# Token deltas without logprobs — the bulk of all traffic — are serialized by hand from cached pieces:
# building a GenerateResponse, a TokenOutput and a TokenInfo per token costs more than the gRPC write.
# GenerateResponse{request_id = 1, token = 3}; TokenOutput{output_index = 1 (always present), tokens = 2,
# text = 3}. tests/unit/test_stream.py checks the bytes parse to the message protobuf would build.
_REQUEST_ID_FIELD = b"\x0a"
_TOKEN_FIELD = b"\x1a"
_OUTPUT_INDEX_FIELD = b"\x08"
_TOKENS_FIELD = b"\x12"
_TEXT_FIELD = b"\x1a"


def request_id_field(request_id: str) -> bytes:
    raw = request_id.encode()
    return length_delimited(_REQUEST_ID_FIELD, raw)


def output_index_field(output_index: int) -> bytes:
    return _OUTPUT_INDEX_FIELD + varint(output_index)


def token_delta_bytes(request_id_prefix: bytes, index_field: bytes, token_fields: list[bytes], text: str) -> bytes:
    """A serialized GenerateResponse carrying one TokenOutput delta."""
    body = index_field + b"".join(token_fields)
    if text:
        raw = text.encode()
        body += length_delimited(_TEXT_FIELD, raw)
    return request_id_prefix + length_delimited(_TOKEN_FIELD, body)


def serialize_response(response: bytes | generation_pb2.GenerateResponse) -> bytes:
    """The Generate response serializer: hand-built token deltas pass through as they are."""
    # `type() is` narrows only its own branch: the other is the protobuf message.
    return response if type(response) is bytes else cast(generation_pb2.GenerateResponse, response).SerializeToString()


def token_info(record: cluster_pb2.TokenRecord, strings: TokenStrings, with_logprobs: bool) -> generation_pb2.TokenInfo:
    info = generation_pb2.TokenInfo(token_id=record.token_id, token=strings(record.token_id))
    if with_logprobs and record.has_logprob:
        info.logprob = record.logprob
        info.rank = record.rank
        for c in record.candidates:
            info.candidates.add(token_id=c.token_id, logprob=c.logprob, token=strings(c.token_id), rank=c.rank)
    return info


class OutputStream:
    __slots__ = (
        "index",
        "plan",
        "strings",
        "detokenizer",
        "stops",
        "finished",
        "generated",
        "request_id_prefix",
        "index_field",
        "plain",
    )

    def __init__(self, index: int, plan: GenerationPlan, encoding, strings: TokenStrings) -> None:
        self.index = index
        self.plan = plan
        self.strings = strings
        self.detokenizer = IncrementalDetokenizer(encoding)
        self.stops = StopStringMatcher(plan.stop_strings, plan.include_stop_in_output) if plan.stop_strings else None
        self.finished = False
        self.generated = 0  # tokens the engine produced for this output (usage)
        self.request_id_prefix = request_id_field(plan.request_id)
        self.index_field = output_index_field(index)
        # No stop strings and no logprobs: a one-token event can be answered from cached bytes.
        self.plain = self.stops is None and not plan.output_logprobs

    def one_token_delta(self, event: cluster_pb2.OutputEvent) -> bytes | None:
        """The steady state, answered from cached bytes: a plain output (no stop strings, no logprobs), one token,
        nothing held back. The serialized delta (counted as generated), else None (on_events then builds it; same
        bytes). Whether the event finishes the output is the caller's check (a delta then needs its `finished`)."""
        if not self.plain or self.detokenizer.pending:
            return None
        tokens = event.tokens
        if len(tokens) != 1:
            return None
        if self.index == 0:  # every single-output request: the whole `token` field is cached
            token_field = self.strings.first_output_delta(tokens[0].token_id)
            if token_field is None:
                return None
        else:
            body = self.strings.one_token_body(tokens[0].token_id)
            if body is None:
                return None
            token_field = length_delimited(_TOKEN_FIELD, self.index_field + body)
        self.generated += 1
        return self.request_id_prefix + token_field

    def on_events(self, events: list[cluster_pb2.OutputEvent]):
        """This output's queued engine events as at most one token delta plus its `finished`.

        Returns (delta, delta_tokens, finished, stop_output): the delta is serialized bytes (or a
        GenerateResponse when logprobs were asked) or None; `finished` is a GenerateResponse or None;
        stop_output says the node must be told to stop this output (a stop string matched here)."""
        if len(events) == 1:
            event = events[0]
            finish = event.finish
            if finish == ENGINE_FINISH_NONE or finish == ENGINE_FINISH_LENGTH:
                # A one-token event of a plain output: its delta from cached bytes; at max_tokens (every
                # 1-token request's only event) with nothing held back, the text needs no flush either.
                delta: generation_pb2.GenerateResponse | bytes | None = self.one_token_delta(event)
                if delta is not None:
                    return delta, 1, None if finish == ENGINE_FINISH_NONE else self.finish(FINISH_LENGTH), False
        plan = self.plan
        if len(events) == 1:
            records = list(events[0].tokens)
        else:
            records = [record for event in events for record in event.tokens]
        event = events[-1]  # only an output's last event can finish it
        self.generated += len(records)
        finish = event.finish
        # The EOS/stop token ends the output; its record and text are kept only with include_stop_in_output.
        stop_record = None
        if finish in (ENGINE_FINISH_EOS, ENGINE_FINISH_STOP_TOKEN) and records:
            stop_record = records.pop()
        ids = [r.token_id for r in records]
        text = self.detokenizer.push(ids) if ids else ""
        if stop_record is not None and plan.include_stop_in_output and finish == ENGINE_FINISH_STOP_TOKEN:
            text += self.detokenizer.push([stop_record.token_id])
        if finish != ENGINE_FINISH_NONE:
            text += self.detokenizer.flush()
        matched = None
        if self.stops is not None:
            text, matched = self.stops.feed(text)
            if finish != ENGINE_FINISH_NONE and matched is None:
                text += self.stops.flush()
        # After a stop-string match the event's records are all kept: the text alone is cut at the match.
        if matched is None and stop_record is not None and plan.include_stop_in_output:
            records.append(stop_record)
        delta = None
        if records or text:
            if plan.output_logprobs:
                delta = generation_pb2.GenerateResponse(
                    request_id=plan.request_id,
                    token=generation_pb2.TokenOutput(
                        output_index=self.index, text=text, tokens=[token_info(r, self.strings, True) for r in records]
                    ),
                )
            else:
                info_field = self.strings.info_field
                delta = token_delta_bytes(
                    self.request_id_prefix, self.index_field, [info_field(r.token_id) for r in records], text
                )
        finished = None
        if matched is not None:
            finished = self.finish(FINISH_STOP, stop_match=generation_pb2.StopMatch(stop_text=matched))
        elif finish == ENGINE_FINISH_EOS:
            finished = self.finish(FINISH_STOP, stop_match=generation_pb2.StopMatch(eos_token_id=event.finish_token_id))
        elif finish == ENGINE_FINISH_STOP_TOKEN:
            finished = self.finish(
                FINISH_STOP, stop_match=generation_pb2.StopMatch(stop_token_id=event.finish_token_id)
            )
        elif finish == ENGINE_FINISH_LENGTH:
            finished = self.finish(FINISH_LENGTH)
        elif finish == ENGINE_FINISH_CANCELLED:
            finished = self.finish(FINISH_CANCELLED, message=event.message or "request was aborted")
        return delta, len(records), finished, matched is not None

    def finish(
        self,
        reason: generation_pb2.FinishReason,
        *,
        stop_match: generation_pb2.StopMatch | None = None,
        message: str = "",
    ) -> generation_pb2.GenerateResponse:
        self.finished = True
        finished = generation_pb2.GenerationFinished(output_index=self.index, reason=reason, message=message)
        if stop_match is not None:
            finished.stop_match.CopyFrom(stop_match)
        return generation_pb2.GenerateResponse(request_id=self.plan.request_id, finished=finished)


def prompt_output(
    plan: GenerationPlan, event: cluster_pb2.OutputEvent, strings: TokenStrings
) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(
        request_id=plan.request_id,
        prompt=generation_pb2.PromptOutput(tokens=[token_info(r, strings, True) for r in event.prompt_tokens]),
    )


def engine_error(
    request_id: str, code: error_pb2.ErrorCode, message: str, retryable: bool
) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(
        request_id=request_id, error=error_pb2.EngineError(code=code, message=message, retryable=retryable)
    )
