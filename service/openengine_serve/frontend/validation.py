"""Everything checked before a Generate request is accepted.

A rejected request raises a `Refusal` (refusal.py) whose kind maps to the gRPC
status code in parentheses below, with a message that names the offending field
and what is allowed. The checks run
in a fixed order, so a request with several problems always gets the same
answer:

1. ``request_id``: non-empty, at most 1024 bytes of UTF-8 (INVALID_ARGUMENT).
2. input shape: exactly one of ``prompt`` / ``token_ids``, not empty; a text
   prompt at most ``max_prompt_bytes`` long, before it is tokenized
   (INVALID_ARGUMENT).
3. ``model``: the served name or an alias (NOT_FOUND).
4. features: ``media``, ``kv.session``, ``lora_name``, ``all`` candidates
   (UNIMPLEMENTED); ``guided`` and the prefix cache's ``kv`` fields are served
   by engines that advertise them (UNIMPLEMENTED otherwise, naming the engine
   that serves them); a guide is read and bounded here (INVALID_ARGUMENT) and
   compiled later, off the event loop (inference.py). They come after the
   model because what is supported is a property of the model.
5. ``sampling`` ranges and ``num_sequences`` (INVALID_ARGUMENT).
6. ``stopping``: ``max_tokens``, ``min_tokens``, stop conditions (INVALID_ARGUMENT).
7. ``response``: candidate selections (INVALID_ARGUMENT).
8. the prompt's tokens, last because a text prompt must be tokenized first:
   ids inside the vocabulary, prompt within the context, ``max_tokens`` fits
   after the prompt (clamped when the client left it out), ``min_tokens``
   still fits, ``prompt_logprob_start`` inside the prompt (INVALID_ARGUMENT).

``extra`` is ignored. Checks that need deployment state (duplicate request
ids, admission) are not made here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from openengine_serve.api.openengine.v1 import generation_pb2
from openengine_serve.common import guides

from .refusal import InvalidRequest, NotServed, Unsupported

MAX_REQUEST_ID_BYTES = 1024

ROUTING_KEY_HEADER = "openengine-routing-key"
TARGET_RANK_HEADER = "openengine-target-dp-rank"
PRIORITY_HEADER = "openengine-priority"
_OPENENGINE_HEADER_PREFIX = "openengine-"

_UINT32_MAX = 2**32 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# Leading zeros are allowed; the digit count bound keeps int() cheap.
_UINT32_TEXT = re.compile(r"0*([0-9]{1,10})")
_INT32_TEXT = re.compile(r"([+-]?)0*([0-9]{1,10})")
# W3C Trace Context: version-trace_id-parent_id-flags; versions after 00 may append fields.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?")

CandidateSelection = tuple[Literal["top_n"], int] | tuple[Literal["token_ids"], tuple[int, ...]]


@dataclass(frozen=True)
class ModelLimits:
    served_model_name: str
    aliases: tuple[str, ...]
    max_context_length: int
    max_output_tokens: int
    max_num_sequences: int
    vocab_size: int
    max_top_n: int = 20
    max_candidate_token_ids: int = 20
    max_stop_conditions: int = 16
    engine: str = "simulated"  # the nodes' engine, named when a feature it lacks is asked
    guided_decoding: bool = False  # the engine serves `guided`
    prefix_cache: bool = False  # the engine serves `kv.bypass_prefix_cache` and `kv.cache_salt`
    max_loras: int = 0  # LoRA adapters a node holds at once (0: the deployment serves no `lora_name`)
    max_guide_bytes: int = 65536
    max_prompt_bytes: int = 1 << 20

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.aliases)


@dataclass(frozen=True)
class RequestMetadata:
    routing_key: str = ""
    target_rank: int | None = None
    priority: int = 0
    traceparent: str = ""
    tracestate: str = ""


@dataclass
class GenerationPlan:
    """A validated Generate request with every default applied."""

    request_id: str
    model: str  # the served model name, also when the request used an alias
    prompt_token_ids: list[int]
    num_sequences: int
    max_tokens: int
    min_tokens: int = 0
    stop_strings: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_in_output: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    output_logprobs: bool = False
    output_candidates: CandidateSelection | None = None
    prompt_logprobs: bool = False
    prompt_candidates: CandidateSelection | None = None
    prompt_logprob_start: int = 0
    metadata: RequestMetadata = field(default_factory=RequestMetadata)
    guide_kind: str = ""  # the `guided` field set ("" none)
    guide: str = ""  # its llguidance grammar (common/guides.py), not compiled yet
    bypass_prefix_cache: bool = False
    cache_salt: str = ""
    model_card: str = ""  # its nodes' name for the model (ModelCard.name), which routing goes by (set by the frontend)
    lora_name: str = ""  # the LoRA adapter ("": the base model)
    lora_path: str = ""  # its file, as LoadLora named it (set by the frontend from the adapters listed)
    prefix_key: str = ""  # set by the frontend when the engine has a prefix cache (requests.prefix_key)
    block_hashes: list[bytes] = field(default_factory=list)  # likewise (requests.prefix_blocks)
    min_p: float = 0.0  # 0 = disabled
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = disabled


# --- request metadata --------------------------------------------------------


def parse_metadata(pairs: Sequence[tuple[str, str | bytes]]) -> RequestMetadata:
    """Reads the OpenEngine and W3C Trace Context keys from a call's metadata.

    A key of the ``openengine-`` family sent twice, a malformed number, or an
    empty or non-ASCII routing key is rejected. Trace context never rejects a
    call: a malformed or repeated ``traceparent`` is dropped together with
    ``tracestate`` (W3C: start a new trace), and repeated ``tracestate``
    values are joined with commas.
    """
    seen: set[str] = set()
    routing_key = ""
    target_rank: int | None = None
    priority = 0
    traceparents: list[str] = []
    tracestates: list[str] = []
    for raw_key, value in pairs:
        key = raw_key.lower()
        if key.startswith(_OPENENGINE_HEADER_PREFIX):
            if key in seen:
                raise InvalidRequest(f"metadata {key} was sent more than once; send it at most once")
            seen.add(key)
        if key == ROUTING_KEY_HEADER:
            routing_key = _parse_routing_key(value)
        elif key == TARGET_RANK_HEADER:
            target_rank = _parse_uint32(key, value)
        elif key == PRIORITY_HEADER:
            priority = _parse_int32(key, value)
        elif key == "traceparent":
            traceparents.append(_ascii_or_empty(value))
        elif key == "tracestate":
            tracestates.append(_ascii_or_empty(value))
    if len(traceparents) == 1 and _is_valid_traceparent(traceparents[0]):
        traceparent, tracestate = traceparents[0], ",".join(s for s in tracestates if s)
    else:
        traceparent, tracestate = "", ""
    return RequestMetadata(routing_key, target_rank, priority, traceparent, tracestate)


def _ascii_or_empty(value: str | bytes) -> str:
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    return text if text.isascii() else ""


MAX_LORA_NAME_BYTES = 128


def lora_name_problem(name: str) -> str | None:
    """What is wrong with a LoRA adapter name (LoadLora), or None."""
    if not name:
        return "adapter.lora_name is required"
    if len(name.encode()) > MAX_LORA_NAME_BYTES:
        return f"adapter.lora_name must be at most {MAX_LORA_NAME_BYTES} bytes, got {len(name.encode())}"
    if any(not character.isprintable() or character.isspace() for character in name):
        return f"adapter.lora_name {shown(name)} must be printable and hold no whitespace"
    return None


def shown(value: str | bytes) -> str:
    """A client's value for an error message, cut short: the status travels in size-limited trailers."""
    shown = repr(value[:64])
    return shown if len(value) <= 64 else shown + "..."


def _parse_routing_key(value: str | bytes) -> str:
    if not value:
        raise InvalidRequest(f"metadata {ROUTING_KEY_HEADER} must be non-empty ASCII, got an empty value")
    text = _ascii_or_empty(value)
    if not text:
        raise InvalidRequest(f"metadata {ROUTING_KEY_HEADER} must be non-empty ASCII, got {shown(value)}")
    return text


def _parse_uint32(key: str, value: str | bytes) -> int:
    match = _UINT32_TEXT.fullmatch(_ascii_or_empty(value))
    if match is None or int(match[1]) > _UINT32_MAX:
        raise InvalidRequest(f"metadata {key} must be a base-10 uint32 (0..{_UINT32_MAX}), got {shown(value)}")
    return int(match[1])


def _parse_int32(key: str, value: str | bytes) -> int:
    match = _INT32_TEXT.fullmatch(_ascii_or_empty(value))
    number = None if match is None else int(match[1] + match[2])
    if number is None or not _INT32_MIN <= number <= _INT32_MAX:
        raise InvalidRequest(f"metadata {key} must be a base-10 int32 ({_INT32_MIN}..{_INT32_MAX}), got {shown(value)}")
    return number


def _is_valid_traceparent(value: str) -> bool:
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return False
    version, trace_id, parent_id, tail = match.groups()
    return version != "ff" and not (version == "00" and tail) and trace_id != "0" * 32 and parent_id != "0" * 16


# --- Generate ----------------------------------------------------------------


def validate_generate(
    request: generation_pb2.GenerateRequest,
    metadata: RequestMetadata,
    limits: ModelLimits,
    encode: Callable[[str], list[int]],
    served_names: Sequence[str] = (),
) -> GenerationPlan:
    """Checks a Generate request in the order of the module docstring and normalizes it. `limits`: the requested
    model's (of several, the one `request.model` names); `served_names`: every model's names, for the refusal of
    a model not served (default: those of `limits`)."""
    check_request_id(request.request_id)
    input_kind = _check_input_shape(request, limits)
    model = _resolve_model(request.model, limits, served_names or limits.served_names)
    guide_kind, guide = _check_supported_features(request, limits)

    # Unset sampling/response messages (most requests) have nothing to check: their defaults directly.
    sampling = _check_sampling(request.sampling, limits) if request.HasField("sampling") else _DEFAULT_SAMPLING
    stopping = request.stopping
    requested_max_tokens, min_tokens = _check_output_length(stopping, limits)
    stop_strings, stop_token_ids = _stop_conditions(stopping.conditions, limits)
    response = request.response
    if request.HasField("response"):
        output_candidates = _candidates(response, "output_candidates", limits)
        prompt_candidates = _candidates(response, "prompt_candidates", limits)
    else:
        output_candidates = prompt_candidates = None

    prompt_token_ids = _prompt_token_ids(request, input_kind, limits, encode)
    max_tokens = _fit_max_tokens(input_kind, len(prompt_token_ids), requested_max_tokens, limits)
    _check_room_after_prompt(len(prompt_token_ids), max_tokens, min_tokens, response.prompt_logprob_start, limits)

    return GenerationPlan(
        request_id=request.request_id,
        model=model,
        prompt_token_ids=prompt_token_ids,
        num_sequences=sampling.num_sequences,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_strings=stop_strings,
        stop_token_ids=stop_token_ids,
        ignore_eos=stopping.ignore_eos,
        include_stop_in_output=stopping.include_stop_in_output,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=max(sampling.top_k, 0),
        seed=sampling.seed,
        output_logprobs=response.return_output_logprobs,
        output_candidates=output_candidates,
        prompt_logprobs=response.return_prompt_logprobs,
        prompt_candidates=prompt_candidates,
        prompt_logprob_start=response.prompt_logprob_start,
        metadata=metadata,
        guide_kind=guide_kind,
        guide=guide,
        bypass_prefix_cache=request.kv.bypass_prefix_cache,
        cache_salt=request.kv.cache_salt,
        lora_name=request.lora_name,
        min_p=sampling.min_p,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        repetition_penalty=sampling.repetition_penalty,
    )


class _Sampling(NamedTuple):
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    num_sequences: int
    seed: int | None


def _check_sampling(sampling: generation_pb2.SamplingParams, limits: ModelLimits) -> _Sampling:
    """Step 5: sampling ranges and num_sequences, with defaults applied."""
    temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidRequest(f"sampling.temperature must be a finite number >= 0, got {temperature!r}")
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {top_p!r}")
    top_k = sampling.top_k
    if top_k < -1:
        raise InvalidRequest(f"sampling.top_k must be >= -1 (-1 and 0 disable it), got {top_k}")
    min_p = sampling.min_p
    if not 0 <= min_p <= 1:
        raise InvalidRequest(f"sampling.min_p must be in [0, 1], got {min_p!r}")
    for penalty_field in ("frequency_penalty", "presence_penalty"):
        penalty = getattr(sampling, penalty_field)
        if not -2 <= penalty <= 2:
            raise InvalidRequest(f"sampling.{penalty_field} must be in [-2, 2], got {penalty!r}")
    repetition_penalty = sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0
    if not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
        raise InvalidRequest(f"sampling.repetition_penalty must be a finite number > 0, got {repetition_penalty!r}")
    num_sequences = sampling.num_sequences if sampling.HasField("num_sequences") else 1
    if not 1 <= num_sequences <= limits.max_num_sequences:
        raise InvalidRequest(f"sampling.num_sequences must be in [1, {limits.max_num_sequences}], got {num_sequences}")
    return _Sampling(
        temperature,
        top_p,
        top_k,
        min_p,
        sampling.frequency_penalty,
        sampling.presence_penalty,
        repetition_penalty,
        num_sequences,
        sampling.seed if sampling.HasField("seed") else None,
    )


# What _check_sampling makes of an unset SamplingParams (tests/unit/test_validation.py checks they agree).
_DEFAULT_SAMPLING = _Sampling(
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    repetition_penalty=1.0,
    num_sequences=1,
    seed=None,
)


def _check_output_length(stopping: generation_pb2.StoppingOptions, limits: ModelLimits) -> tuple[int | None, int]:
    """Step 6 without the stop conditions: (max_tokens as requested or None, min_tokens)."""
    requested_max_tokens = stopping.max_tokens if stopping.HasField("max_tokens") else None
    if requested_max_tokens is not None and not 1 <= requested_max_tokens <= limits.max_output_tokens:
        raise InvalidRequest(
            f"stopping.max_tokens must be in [1, {limits.max_output_tokens}], got {requested_max_tokens}"
        )
    min_tokens = stopping.min_tokens
    if requested_max_tokens is not None and min_tokens > requested_max_tokens:
        raise InvalidRequest(
            f"stopping.min_tokens must be <= stopping.max_tokens ({requested_max_tokens}), got {min_tokens}"
        )
    if requested_max_tokens is None and min_tokens > limits.max_output_tokens:
        raise InvalidRequest(
            f"stopping.min_tokens must be <= max_output_tokens ({limits.max_output_tokens}) when "
            f"stopping.max_tokens is unset, got {min_tokens}"
        )
    return requested_max_tokens, min_tokens


def _check_room_after_prompt(
    prompt_tokens: int, max_tokens: int, min_tokens: int, prompt_logprob_start: int, limits: ModelLimits
) -> None:
    """The end of step 8: min_tokens still fits after the prompt, prompt_logprob_start is inside it."""
    if min_tokens > max_tokens:  # only reachable when max_tokens was clamped to the context
        raise InvalidRequest(
            f"stopping.min_tokens must be <= the {max_tokens} output tokens that fit in max_context_length "
            f"{limits.max_context_length} after the prompt's {prompt_tokens} tokens, got {min_tokens}"
        )
    if prompt_logprob_start >= prompt_tokens:
        raise InvalidRequest(
            f"response.prompt_logprob_start must be < the prompt length ({prompt_tokens} tokens), "
            f"got {prompt_logprob_start}"
        )


def check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidRequest("request_id must be non-empty")
    size = len(request_id.encode("utf-8"))
    if size > MAX_REQUEST_ID_BYTES:
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_BYTES} bytes of UTF-8, got {size} bytes")


def _check_input_shape(request: generation_pb2.GenerateRequest, limits: ModelLimits) -> Literal["prompt", "token_ids"]:
    input_kind = request.WhichOneof("input")
    if input_kind is None:
        raise InvalidRequest("exactly one of prompt or token_ids must be set, got neither")
    if input_kind == "prompt":
        prompt = request.prompt
        if not prompt:
            raise InvalidRequest("prompt must not be empty")
        limit = limits.max_prompt_bytes
        # A character is 1 to 4 bytes: the bytes are counted only when the characters leave it open.
        if len(prompt) > limit:
            raise InvalidRequest(
                f"prompt must be at most {limit} bytes of UTF-8 (OPENENGINE_MAX_PROMPT_BYTES), "
                f"got {len(prompt)} characters"
            )
        if len(prompt) * 4 > limit and (size := len(prompt.encode("utf-8", "surrogatepass"))) > limit:
            raise InvalidRequest(
                f"prompt must be at most {limit} bytes of UTF-8 (OPENENGINE_MAX_PROMPT_BYTES), got {size} bytes"
            )
    if input_kind == "token_ids" and not request.token_ids.ids:
        raise InvalidRequest("token_ids.ids must not be empty")
    return input_kind


def _resolve_model(requested: str, limits: ModelLimits, served_names: Sequence[str]) -> str:
    if requested in limits.served_names:
        return limits.served_model_name
    served = ", ".join(repr(name) for name in served_names)
    problem = "model must be set" if not requested else f"model {shown(requested)} is not served here"
    raise NotServed(f"{problem}; served models: {served}")


MAX_CACHE_SALT_BYTES = 256
MAX_STOP_TEXT_BYTES = 4096  # all stop_text together: every new token is matched against them


def _check_supported_features(request: generation_pb2.GenerateRequest, limits: ModelLimits) -> tuple[str, str]:
    """Step 4; returns the guide (its kind and its llguidance grammar, ("", "") without one)."""
    if request.media:
        raise Unsupported("media input is not supported (media must be empty)")
    # An unset message sets nothing (most requests): its fields are not looked at.
    guide_kind, guide = "", ""
    if request.HasField("guided"):
        guide_kind, guide = _guide(request.guided, limits)
    if request.HasField("kv"):
        kv = request.kv
        if kv.HasField("session"):
            raise Unsupported("KV sessions are not supported (kv.session is set)")
        if (kv.bypass_prefix_cache or kv.HasField("cache_salt")) and not limits.prefix_cache:
            field_set = "kv.bypass_prefix_cache" if kv.bypass_prefix_cache else "kv.cache_salt"
            raise Unsupported(
                f"the prefix cache is not served by this deployment's engine ({limits.engine}; "
                f"the llama.cpp engine serves it); leave {field_set} unset"
            )
        size = len(kv.cache_salt.encode())
        if size > MAX_CACHE_SALT_BYTES:
            raise InvalidRequest(f"kv.cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes, got {size}")
    if request.lora_name and not limits.max_loras:
        raise Unsupported(
            f"LoRA is not enabled on this deployment (lora_name {shown(request.lora_name)}; the nodes' "
            f"OPENENGINE_LORA_DIR is not set); leave lora_name empty"
        )
    if request.HasField("response"):
        for candidates_field in ("prompt_candidates", "output_candidates"):
            if getattr(request.response, candidates_field).WhichOneof("selection") == "all":
                raise Unsupported(f"response.{candidates_field}.all is not supported; only top_n and token_ids are")
    return guide_kind, guide


def _guide(guided: generation_pb2.GuidedDecoding, limits: ModelLimits) -> tuple[str, str]:
    kind = guided.WhichOneof("guide")
    if kind is None:
        return "", ""
    if not limits.guided_decoding:
        raise Unsupported(
            f"guided decoding is not served by this deployment's engine ({limits.engine}; the "
            f"llama.cpp engine serves it) (guided.{kind} is set)"
        )
    if guided.backend not in ("", "llguidance"):
        raise InvalidRequest(f"guided.backend must be empty or 'llguidance', got {shown(guided.backend)}")
    value = getattr(guided, kind)
    size = (
        sum(len(c.encode()) for c in value.choices)
        if kind == "choice"
        else 0
        if kind == "json_object"
        else len(value.encode())
    )
    if size > limits.max_guide_bytes:
        raise InvalidRequest(
            f"guided.{kind} must be at most {limits.max_guide_bytes} bytes (OPENENGINE_MAX_GUIDE_BYTES), got {size}"
        )
    try:
        return kind, guides.grammar_of(kind, value.choices if kind == "choice" else value)
    except guides.GuideError as exc:
        raise InvalidRequest(str(exc)) from None


def _stop_conditions(
    conditions: Sequence[generation_pb2.StopCondition], limits: ModelLimits
) -> tuple[list[str], list[int]]:
    if not conditions:
        return [], []
    if len(conditions) > limits.max_stop_conditions:
        raise InvalidRequest(
            f"stopping.conditions must have at most {limits.max_stop_conditions} entries, got {len(conditions)}"
        )
    stop_strings: list[str] = []
    stop_token_ids: list[int] = []
    stop_text_bytes = 0
    for index, condition in enumerate(conditions):
        kind = condition.WhichOneof("condition")
        if kind is None:
            raise InvalidRequest(f"stopping.conditions[{index}] must set stop_text or stop_token_id")
        if kind == "stop_text":
            if not condition.stop_text:
                raise InvalidRequest(f"stopping.conditions[{index}].stop_text must not be empty")
            stop_text_bytes += len(condition.stop_text.encode("utf-8", "surrogatepass"))
            if stop_text_bytes > MAX_STOP_TEXT_BYTES:
                raise InvalidRequest(
                    f"stopping.conditions' stop_text must total at most {MAX_STOP_TEXT_BYTES} "
                    f"bytes of UTF-8, got more by conditions[{index}]"
                )
            stop_strings.append(condition.stop_text)
        else:
            if condition.stop_token_id >= limits.vocab_size:
                raise InvalidRequest(
                    f"stopping.conditions[{index}].stop_token_id must be < {limits.vocab_size}, "
                    f"got {condition.stop_token_id}"
                )
            stop_token_ids.append(condition.stop_token_id)
    return list(dict.fromkeys(stop_strings)), list(dict.fromkeys(stop_token_ids))


def _candidates(
    response: generation_pb2.ResponseOptions, candidates_field: str, limits: ModelLimits
) -> CandidateSelection | None:
    """One candidate selection; an empty one (top_n 0, no ids) means none."""
    selection = getattr(response, candidates_field)
    kind = selection.WhichOneof("selection")
    if kind == "top_n":
        if selection.top_n > limits.max_top_n:
            raise InvalidRequest(
                f"response.{candidates_field}.top_n must be in [0, {limits.max_top_n}], got {selection.top_n}"
            )
        return ("top_n", selection.top_n) if selection.top_n else None
    if kind == "token_ids":
        ids = tuple(selection.token_ids.ids)
        if len(ids) > limits.max_candidate_token_ids:
            raise InvalidRequest(
                f"response.{candidates_field}.token_ids.ids must list at most {limits.max_candidate_token_ids} "
                f"token ids, got {len(ids)}"
            )
        for index, token_id in enumerate(ids):
            if token_id >= limits.vocab_size:
                raise InvalidRequest(
                    f"response.{candidates_field}.token_ids.ids[{index}] must be < {limits.vocab_size}, got {token_id}"
                )
        return ("token_ids", ids) if ids else None
    return None  # unset; `all` was rejected earlier


def _prompt_token_ids(
    request: generation_pb2.GenerateRequest,
    input_kind: Literal["prompt", "token_ids"],
    limits: ModelLimits,
    encode: Callable[[str], list[int]],
) -> list[int]:
    if input_kind == "prompt":
        token_ids = encode(request.prompt)
    else:
        ids = request.token_ids.ids
        if len(ids) > limits.max_context_length:  # before any copy or scan of what may be millions of ids
            raise InvalidRequest(
                f"token_ids must fit max_context_length {limits.max_context_length}, got {len(ids)} tokens"
            )
        token_ids = list(ids)
        if max(token_ids) >= limits.vocab_size:  # max() in C; find the position only on failure
            index = next(i for i, token_id in enumerate(token_ids) if token_id >= limits.vocab_size)
            raise InvalidRequest(
                f"token_ids.ids[{index}] must be < {limits.vocab_size} (the vocabulary size), got {token_ids[index]}"
            )
    if len(token_ids) > limits.max_context_length:
        raise InvalidRequest(
            f"{input_kind} must fit max_context_length {limits.max_context_length}, got {len(token_ids)} tokens"
        )
    return token_ids


def _fit_max_tokens(
    input_kind: Literal["prompt", "token_ids"], prompt_length: int, requested: int | None, limits: ModelLimits
) -> int:
    """The output budget: as requested, or when absent as much as fits up to max_output_tokens."""
    room = limits.max_context_length - prompt_length
    if requested is None:
        if room == 0:
            raise InvalidRequest(
                f"{input_kind} must leave room for output within max_context_length "
                f"{limits.max_context_length}, got {prompt_length} tokens"
            )
        return min(limits.max_output_tokens, room)
    if requested > room:
        raise InvalidRequest(
            f"stopping.max_tokens plus the prompt's {prompt_length} tokens must fit max_context_length "
            f"{limits.max_context_length} (at most {room} output tokens), got {requested}"
        )
    return requested
