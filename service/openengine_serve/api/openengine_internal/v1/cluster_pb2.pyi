from openengine_serve.api.openengine.v1 import kv_pb2 as _kv_pb2
from openengine_serve.api.openengine.v1 import lora_pb2 as _lora_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_STARTING: _ClassVar[NodeState]
    NODE_STATE_READY: _ClassVar[NodeState]
    NODE_STATE_DRAINING: _ClassVar[NodeState]
    NODE_STATE_DOWN: _ClassVar[NodeState]

class AbortOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ABORT_OUTCOME_UNSPECIFIED: _ClassVar[AbortOutcome]
    ABORT_OUTCOME_ABORTED: _ClassVar[AbortOutcome]
    ABORT_OUTCOME_ALREADY_FINISHED: _ClassVar[AbortOutcome]
    ABORT_OUTCOME_NOT_FOUND: _ClassVar[AbortOutcome]

class EngineFinish(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_FINISH_NONE: _ClassVar[EngineFinish]
    ENGINE_FINISH_EOS: _ClassVar[EngineFinish]
    ENGINE_FINISH_STOP_TOKEN: _ClassVar[EngineFinish]
    ENGINE_FINISH_LENGTH: _ClassVar[EngineFinish]
    ENGINE_FINISH_CANCELLED: _ClassVar[EngineFinish]
    ENGINE_FINISH_ERROR: _ClassVar[EngineFinish]
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_STARTING: NodeState
NODE_STATE_READY: NodeState
NODE_STATE_DRAINING: NodeState
NODE_STATE_DOWN: NodeState
ABORT_OUTCOME_UNSPECIFIED: AbortOutcome
ABORT_OUTCOME_ABORTED: AbortOutcome
ABORT_OUTCOME_ALREADY_FINISHED: AbortOutcome
ABORT_OUTCOME_NOT_FOUND: AbortOutcome
ENGINE_FINISH_NONE: EngineFinish
ENGINE_FINISH_EOS: EngineFinish
ENGINE_FINISH_STOP_TOKEN: EngineFinish
ENGINE_FINISH_LENGTH: EngineFinish
ENGINE_FINISH_CANCELLED: EngineFinish
ENGINE_FINISH_ERROR: EngineFinish

class NodeLoad(_message.Message):
    __slots__ = ("running_requests", "queued_requests", "running_tokens", "waiting_tokens", "decode_batch_size", "max_running_requests", "max_queued_requests")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    queued_requests: int
    running_tokens: int
    waiting_tokens: int
    decode_batch_size: int
    max_running_requests: int
    max_queued_requests: int
    def __init__(self, running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., running_tokens: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., decode_batch_size: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., max_queued_requests: _Optional[int] = ...) -> None: ...

class NodeEntry(_message.Message):
    __slots__ = ("node_id", "address", "rank", "state", "load", "model")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    rank: int
    state: NodeState
    load: NodeLoad
    model: ModelCard
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., rank: _Optional[int] = ..., state: _Optional[_Union[NodeState, str]] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., model: _Optional[_Union[ModelCard, _Mapping]] = ...) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("name", "aliases", "engine", "context_length", "max_output_tokens", "tokenizer", "tokenizer_digest", "tokenizer_data", "guided_decoding", "prefix_cache", "max_loras")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DATA_FIELD_NUMBER: _ClassVar[int]
    GUIDED_DECODING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    engine: str
    context_length: int
    max_output_tokens: int
    tokenizer: str
    tokenizer_digest: str
    tokenizer_data: bytes
    guided_decoding: bool
    prefix_cache: bool
    max_loras: int
    def __init__(self, name: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., engine: _Optional[str] = ..., context_length: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., tokenizer: _Optional[str] = ..., tokenizer_digest: _Optional[str] = ..., tokenizer_data: _Optional[bytes] = ..., guided_decoding: _Optional[bool] = ..., prefix_cache: _Optional[bool] = ..., max_loras: _Optional[int] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node", "auto_rank")
    NODE_FIELD_NUMBER: _ClassVar[int]
    AUTO_RANK_FIELD_NUMBER: _ClassVar[int]
    node: NodeEntry
    auto_rank: bool
    def __init__(self, node: _Optional[_Union[NodeEntry, _Mapping]] = ..., auto_rank: _Optional[bool] = ...) -> None: ...

class NodeHeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "state", "load", "reply_optional")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_OPTIONAL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: NodeState
    load: NodeLoad
    reply_optional: bool
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[_Union[NodeState, str]] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., reply_optional: _Optional[bool] = ...) -> None: ...

class RegisterFrontendRequest(_message.Message):
    __slots__ = ("frontend_id", "address", "incarnation")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    address: str
    incarnation: str
    def __init__(self, frontend_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class FrontendHeartbeatRequest(_message.Message):
    __slots__ = ("frontend_id", "live_requests")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    live_requests: int
    def __init__(self, frontend_id: _Optional[str] = ..., live_requests: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("heartbeat_interval_s", "nodes", "assigned_rank")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_RANK_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    nodes: _containers.RepeatedCompositeFieldContainer[NodeEntry]
    assigned_rank: int
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., nodes: _Optional[_Iterable[_Union[NodeEntry, _Mapping]]] = ..., assigned_rank: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "nodes", "full_table", "loras", "lora_models")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    FULL_TABLE_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_MODELS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    nodes: _containers.RepeatedCompositeFieldContainer[NodeEntry]
    full_table: bool
    loras: _containers.RepeatedCompositeFieldContainer[_lora_pb2.LoraAdapter]
    lora_models: _containers.RepeatedCompositeFieldContainer[LoraModels]
    def __init__(self, known: _Optional[bool] = ..., nodes: _Optional[_Iterable[_Union[NodeEntry, _Mapping]]] = ..., full_table: _Optional[bool] = ..., loras: _Optional[_Iterable[_Union[_lora_pb2.LoraAdapter, _Mapping]]] = ..., lora_models: _Optional[_Iterable[_Union[LoraModels, _Mapping]]] = ...) -> None: ...

class LoraModels(_message.Message):
    __slots__ = ("lora_name", "models")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lora_name: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "frontend_id", "routing_key", "target_rank", "prompt_tokens", "num_sequences", "owner", "traceparent", "tracestate", "prefix_key", "block_hashes", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    TARGET_RANK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    frontend_id: str
    routing_key: str
    target_rank: int
    prompt_tokens: int
    num_sequences: int
    owner: str
    traceparent: str
    tracestate: str
    prefix_key: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    model: str
    def __init__(self, request_id: _Optional[str] = ..., frontend_id: _Optional[str] = ..., routing_key: _Optional[str] = ..., target_rank: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., num_sequences: _Optional[int] = ..., owner: _Optional[str] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., prefix_key: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., model: _Optional[str] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeEntry
    def __init__(self, node: _Optional[_Union[NodeEntry, _Mapping]] = ...) -> None: ...

class ReservationBatch(_message.Message):
    __slots__ = ("frontend_id", "reserve", "release")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    reserve: _containers.RepeatedCompositeFieldContainer[ReserveRequest]
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, frontend_id: _Optional[str] = ..., reserve: _Optional[_Iterable[_Union[ReserveRequest, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class ReservationOutcome(_message.Message):
    __slots__ = ("node", "refusal_code", "refusal")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_CODE_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    node: NodeEntry
    refusal_code: int
    refusal: str
    def __init__(self, node: _Optional[_Union[NodeEntry, _Mapping]] = ..., refusal_code: _Optional[int] = ..., refusal: _Optional[str] = ...) -> None: ...

class ReservationReplies(_message.Message):
    __slots__ = ("outcome",)
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    outcome: _containers.RepeatedCompositeFieldContainer[ReservationOutcome]
    def __init__(self, outcome: _Optional[_Iterable[_Union[ReservationOutcome, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "frontend_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    frontend_id: str
    def __init__(self, request_id: _Optional[str] = ..., frontend_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterAbortRequest(_message.Message):
    __slots__ = ("request_id", "all_requests", "owner")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    all_requests: bool
    owner: str
    def __init__(self, request_id: _Optional[str] = ..., all_requests: _Optional[bool] = ..., owner: _Optional[str] = ...) -> None: ...

class ClusterAbortReply(_message.Message):
    __slots__ = ("outcome", "aborted")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    outcome: AbortOutcome
    aborted: int
    def __init__(self, outcome: _Optional[_Union[AbortOutcome, str]] = ..., aborted: _Optional[int] = ...) -> None: ...

class GetClusterLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterLoad(_message.Message):
    __slots__ = ("nodes", "live_reservations")
    NODES_FIELD_NUMBER: _ClassVar[int]
    LIVE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeEntry]
    live_reservations: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeEntry, _Mapping]]] = ..., live_reservations: _Optional[int] = ...) -> None: ...

class LoraCommand(_message.Message):
    __slots__ = ("adapter", "unload")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_FIELD_NUMBER: _ClassVar[int]
    adapter: _lora_pb2.LoraAdapter
    unload: bool
    def __init__(self, adapter: _Optional[_Union[_lora_pb2.LoraAdapter, _Mapping]] = ..., unload: _Optional[bool] = ...) -> None: ...

class LoraOutcome(_message.Message):
    __slots__ = ("adapter", "error", "already_loaded", "refusal_code", "models")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_CODE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    adapter: _lora_pb2.LoraAdapter
    error: str
    already_loaded: bool
    refusal_code: int
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter: _Optional[_Union[_lora_pb2.LoraAdapter, _Mapping]] = ..., error: _Optional[str] = ..., already_loaded: _Optional[bool] = ..., refusal_code: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ("include_snapshot", "start_sequence_number")
    INCLUDE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    START_SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    include_snapshot: bool
    start_sequence_number: int
    def __init__(self, include_snapshot: _Optional[bool] = ..., start_sequence_number: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request", "traceparent", "tracestate")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    request: EngineRequest
    traceparent: str
    tracestate: str
    def __init__(self, request: _Optional[_Union[EngineRequest, _Mapping]] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class SubmitBatch(_message.Message):
    __slots__ = ("submit",)
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    submit: _containers.RepeatedCompositeFieldContainer[SubmitRequest]
    def __init__(self, submit: _Optional[_Iterable[_Union[SubmitRequest, _Mapping]]] = ...) -> None: ...

class SubmitOutcome(_message.Message):
    __slots__ = ("refusal_code", "refusal")
    REFUSAL_CODE_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    refusal_code: int
    refusal: str
    def __init__(self, refusal_code: _Optional[int] = ..., refusal: _Optional[str] = ...) -> None: ...

class SubmitOutcomes(_message.Message):
    __slots__ = ("outcome",)
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    outcome: _containers.RepeatedCompositeFieldContainer[SubmitOutcome]
    def __init__(self, outcome: _Optional[_Iterable[_Union[SubmitOutcome, _Mapping]]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "output_index", "hold")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output_index: int
    hold: bool
    def __init__(self, request_id: _Optional[str] = ..., output_index: _Optional[int] = ..., hold: _Optional[bool] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("found", "ended", "held")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    found: bool
    ended: bool
    held: bool
    def __init__(self, found: _Optional[bool] = ..., ended: _Optional[bool] = ..., held: _Optional[bool] = ...) -> None: ...

class LaneCredit(_message.Message):
    __slots__ = ("frontend_id", "window", "handled", "pauses")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    HANDLED_FIELD_NUMBER: _ClassVar[int]
    PAUSES_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    window: int
    handled: int
    pauses: _containers.RepeatedCompositeFieldContainer[PauseRequest]
    def __init__(self, frontend_id: _Optional[str] = ..., window: _Optional[int] = ..., handled: _Optional[int] = ..., pauses: _Optional[_Iterable[_Union[PauseRequest, _Mapping]]] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("request_id", "resume")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    resume: bool
    def __init__(self, request_id: _Optional[str] = ..., resume: _Optional[bool] = ...) -> None: ...

class GetNodeLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Candidates(_message.Message):
    __slots__ = ("top_n", "token_ids", "all")
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    top_n: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    all: bool
    def __init__(self, top_n: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., all: _Optional[bool] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "frontend_id", "prompt_token_ids", "num_sequences", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "priority", "guide", "bypass_prefix_cache", "cache_salt", "owner", "share_weight", "lora_name", "lora_path", "temperature", "top_p", "top_k", "seed", "has_seed", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "output_logprobs", "output_candidates", "prompt_logprobs", "prompt_candidates", "prompt_logprob_start")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    GUIDE_FIELD_NUMBER: _ClassVar[int]
    BYPASS_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SHARE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_START_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    frontend_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_sequences: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    priority: int
    guide: str
    bypass_prefix_cache: bool
    cache_salt: str
    owner: str
    share_weight: int
    lora_name: str
    lora_path: str
    temperature: float
    top_p: float
    top_k: int
    seed: int
    has_seed: bool
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    output_logprobs: bool
    output_candidates: Candidates
    prompt_logprobs: bool
    prompt_candidates: Candidates
    prompt_logprob_start: int
    def __init__(self, request_id: _Optional[str] = ..., frontend_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., num_sequences: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., priority: _Optional[int] = ..., guide: _Optional[str] = ..., bypass_prefix_cache: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., owner: _Optional[str] = ..., share_weight: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., output_logprobs: _Optional[bool] = ..., output_candidates: _Optional[_Union[Candidates, _Mapping]] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_candidates: _Optional[_Union[Candidates, _Mapping]] = ..., prompt_logprob_start: _Optional[int] = ...) -> None: ...

class LogProbEntry(_message.Message):
    __slots__ = ("token_id", "logprob", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class TokenRecord(_message.Message):
    __slots__ = ("token_id", "has_logprob", "logprob", "rank", "candidates")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    has_logprob: bool
    logprob: float
    rank: int
    candidates: _containers.RepeatedCompositeFieldContainer[LogProbEntry]
    def __init__(self, token_id: _Optional[int] = ..., has_logprob: _Optional[bool] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[LogProbEntry, _Mapping]]] = ...) -> None: ...

class OutputEvent(_message.Message):
    __slots__ = ("request_id", "output_index", "tokens", "finish", "finish_token_id", "message", "retryable", "prompt_tokens", "lane", "first", "cached_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    FINISH_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output_index: int
    tokens: _containers.RepeatedCompositeFieldContainer[TokenRecord]
    finish: EngineFinish
    finish_token_id: int
    message: str
    retryable: bool
    prompt_tokens: _containers.RepeatedCompositeFieldContainer[TokenRecord]
    lane: str
    first: bool
    cached_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., output_index: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[TokenRecord, _Mapping]]] = ..., finish: _Optional[_Union[EngineFinish, str]] = ..., finish_token_id: _Optional[int] = ..., message: _Optional[str] = ..., retryable: _Optional[bool] = ..., prompt_tokens: _Optional[_Iterable[_Union[TokenRecord, _Mapping]]] = ..., lane: _Optional[str] = ..., first: _Optional[bool] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class StepResults(_message.Message):
    __slots__ = ("step", "events")
    STEP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    events: _containers.RepeatedCompositeFieldContainer[OutputEvent]
    def __init__(self, step: _Optional[int] = ..., events: _Optional[_Iterable[_Union[OutputEvent, _Mapping]]] = ...) -> None: ...

class EngineCommand(_message.Message):
    __slots__ = ("add", "cancel", "shutdown", "pause", "lora")
    ADD_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    add: EngineRequest
    cancel: CancelRequest
    shutdown: bool
    pause: PauseRequest
    lora: LoraCommand
    def __init__(self, add: _Optional[_Union[EngineRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelRequest, _Mapping]] = ..., shutdown: _Optional[bool] = ..., pause: _Optional[_Union[PauseRequest, _Mapping]] = ..., lora: _Optional[_Union[LoraCommand, _Mapping]] = ...) -> None: ...

class EngineStep(_message.Message):
    __slots__ = ("step", "events", "running", "queued", "running_tokens", "waiting_tokens", "step_seconds", "worker_pids", "prefilled_tokens", "cached_prompt_tokens", "cached_blocks", "kv_events", "lora_outcomes", "running_loras", "waiting_loras")
    STEP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_PIDS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LORA_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_LORAS_FIELD_NUMBER: _ClassVar[int]
    WAITING_LORAS_FIELD_NUMBER: _ClassVar[int]
    step: int
    events: _containers.RepeatedCompositeFieldContainer[OutputEvent]
    running: int
    queued: int
    running_tokens: int
    waiting_tokens: int
    step_seconds: float
    worker_pids: _containers.RepeatedScalarFieldContainer[int]
    prefilled_tokens: int
    cached_prompt_tokens: int
    cached_blocks: int
    kv_events: _containers.RepeatedCompositeFieldContainer[_kv_pb2.KvEvent]
    lora_outcomes: _containers.RepeatedCompositeFieldContainer[LoraOutcome]
    running_loras: _containers.RepeatedScalarFieldContainer[str]
    waiting_loras: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., events: _Optional[_Iterable[_Union[OutputEvent, _Mapping]]] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., running_tokens: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., worker_pids: _Optional[_Iterable[int]] = ..., prefilled_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., kv_events: _Optional[_Iterable[_Union[_kv_pb2.KvEvent, _Mapping]]] = ..., lora_outcomes: _Optional[_Iterable[_Union[LoraOutcome, _Mapping]]] = ..., running_loras: _Optional[_Iterable[str]] = ..., waiting_loras: _Optional[_Iterable[str]] = ...) -> None: ...
