"""API keys and roles on the public port (both gRPC servers): a key file and an `aio.ServerInterceptor`.

The key file (OPENENGINE_API_KEYS_FILE) holds one key a line,
`ROLE NAME SECRET [OPTION=VALUE ...]`: ROLE is `user` or `admin`, NAME labels the
key in logs and metrics, SECRET is the key itself or `sha256:<hex>` of it; `#`
starts a comment. Options, each at most once, in any order:
- `max_in_flight=N`: the Generate streams the key keeps open on one frontend worker
  (else OPENENGINE_API_KEY_MAX_IN_FLIGHT; 0 there: no cap);
- `max_priority=N`: the highest `openengine-priority` the key may send (a user key's default is 0, the
  default priority; an admin key may send any);
- `cache_group=NAME`: keys naming the same group share one prefix-cache namespace (a team's common system
  prompt); without it each key has a namespace of its own (`cache_namespace`);
- `share_weight=N`: the key's weight in each node's fair share of the batch between keys (1 by default: equal
  shares; a key of weight 3 beside one of weight 1 holds up to 3/4 of the batch when both wait).

Only SHA-256 digests are kept in memory; a presented key is hashed and compared
with every stored digest in constant time. Secrets never reach a log or an error
message.

The interceptor refuses a call without a known key (UNAUTHENTICATED) before the
request is even deserialized, so no validation, routing or engine work happens.
`grpc.health.v1` and reflection stay open for probes. The caller's key travels
to the handler in a context variable (`caller()`), which the frontend uses for
the ownership of its requests, its log line and its metrics. A refused call is
counted (openengine_frontend_auth_failures_total{reason}) and logged, at most
one line per reason every AUTH_FAILURE_LOG_INTERVAL_S.

Request ids are scoped per key (`internal_request_id`): the same id under two
keys is two requests, and no key can probe or take another key's ids.

Keys only protect what they cross: a key file needs TLS on the public port, or
OPENENGINE_ALLOW_PLAINTEXT_KEYS=1 behind a TLS-terminating proxy
(`check_key_transport`); a frontend without keys says at start that anyone can
Abort every request, unless OPENENGINE_AUTH=none (`warn_if_open`).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import inspect
import logging
import os
import re
import time
from dataclasses import dataclass

import grpc

from ..common.config import AUTH_NONE, ConfigError, FrontendConfig
from ..common.logging_setup import log_event
from . import metrics

logger = logging.getLogger("openengine_serve.frontend")

ROLES = ("user", "admin")
RELOAD_CHECK_S = 0.5  # how often a call may look at the file; a removed key stops within this (plus the write)
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
USER_METHODS = frozenset(
    {
        "/openengine.v1.Inference/Generate",
        "/openengine.v1.Control/GetServerInfo",
        "/openengine.v1.Control/GetModelInfo",
        "/openengine.v1.Control/GetLoad",
        "/openengine.v1.Control/Health",
        "/openengine.v1.Control/Abort",  # only of its own requests, and not all_requests (see abort_refusal)
    }
)
NO_KEY_LABEL = "-"  # the key label of requests when keys are off
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
LINE_FORMAT = "`ROLE NAME SECRET [max_in_flight=N] [max_priority=N] [cache_group=NAME] [share_weight=N]`"
OPTIONS = ("max_in_flight", "max_priority", "cache_group", "share_weight")
INT32_MAX = 2**31 - 1
SCOPE_SEPARATOR = " "  # between a key's name and a request id; a name never holds whitespace (parse_keys)
AUTH_FAILURE_LOG_INTERVAL_S = 10.0  # a flood of bad keys writes one log line per reason this often, not one per call
# openengine_frontend_auth_failures_total{reason}
NO_KEY, UNKNOWN_KEY, WRONG_ROLE = "no_key", "unknown_key", "wrong_role"
PLAINTEXT_KEYS = (
    "OPENENGINE_API_KEYS_FILE is set but the public port has no TLS (OPENENGINE_TLS_CERT_FILE): the keys would "
    "cross the network readable; configure TLS, or set OPENENGINE_ALLOW_PLAINTEXT_KEYS=1 when a TLS-terminating "
    "proxy is in front of the frontend"
)
OPEN_PORT_WARNING = (
    "no API keys (OPENENGINE_API_KEYS_FILE unset): anyone who reaches the public port can call every method, "
    "including Abort of every request; set OPENENGINE_API_KEYS_FILE, or OPENENGINE_AUTH=none to run without keys "
    "on purpose"
)


@dataclass(frozen=True)
class ApiKey:
    role: str
    name: str
    digest: bytes  # sha256 of the secret
    max_in_flight: int = 0  # Generate streams open at once on one worker; 0: the default (api_key_max_in_flight)
    max_priority: int | None = None  # the highest openengine-priority it may send; None: admin any, user 0
    cache_group: str = ""  # keys of one group share a prefix-cache namespace; "": the key's own
    share_weight: int = 1  # its weight in each node's fair share of the batch

    @property
    def priority_limit(self) -> int:
        if self.max_priority is not None:
            return self.max_priority
        return INT32_MAX if self.admin else DEFAULT_PRIORITY

    @property
    def admin(self) -> bool:
        return self.role == "admin"


DEFAULT_PRIORITY = 0  # the protocol's default; above it is a right of the key


_CALLER: contextvars.ContextVar[ApiKey | None] = contextvars.ContextVar("openengine_api_key", default=None)
_KEY_STORE: contextvars.ContextVar[KeyStore | None] = contextvars.ContextVar("openengine_api_keys", default=None)


def caller() -> ApiKey | None:
    """The key of the call being handled (None when keys are off)."""
    return _CALLER.get()


def bind_caller(key: ApiKey, store: KeyStore) -> None:
    """Makes `key` the caller of the running task (the HTTP API's check; the gRPC interceptor's `_as_caller`)."""
    _CALLER.set(key)
    _KEY_STORE.set(store)


def owner() -> str:
    """The owner recorded with a request this call starts ("" when keys are off)."""
    key = _CALLER.get()
    return "" if key is None else key.name


def key_label(owner_name: str) -> str:
    """The key label of logs and metrics for a request's owner."""
    return owner_name or NO_KEY_LABEL


def caller_label() -> str:
    return key_label(owner())


def internal_request_id(owner_name: str, request_id: str) -> str:
    """The id a request has inside the deployment (coordinator, nodes): with keys on, the owner's key name before
    the public id, so the same id under two keys is two requests; with keys off, the id itself. Clients only
    ever see their own id."""
    return f"{owner_name}{SCOPE_SEPARATOR}{request_id}" if owner_name else request_id


def check_key_transport(config: FrontendConfig) -> None:
    """At start: a key file needs TLS on the public port, unless OPENENGINE_ALLOW_PLAINTEXT_KEYS=1."""
    if config.api_keys_file and not config.tls_cert_file and not config.allow_plaintext_keys:
        raise ConfigError(PLAINTEXT_KEYS)


def warn_if_open(config: FrontendConfig) -> None:
    """At start, once per frontend: the public port without keys, unless OPENENGINE_AUTH=none says it is meant."""
    if not config.api_keys_file and config.auth != AUTH_NONE:
        log_event(logger, OPEN_PORT_WARNING, logging.WARNING)


def abort_refusal() -> str | None:
    """Why the current caller may not Abort all requests (a user key), or None (an admin, or keys off)."""
    key = _CALLER.get()
    if key is None or key.admin:
        return None
    return f"API key {key.name!r} has role user; Abort with all_requests needs role admin"


def abort_targets(request_id: str) -> list[tuple[str, str]]:
    """(internal id, owner filter for the coordinator) of each request an Abort of `request_id` by the current
    caller may end: a user's own request; an admin's, the id under every key of the file (ids are scoped per
    key); with keys off, the id."""
    key = _CALLER.get()
    if key is None:
        return [(request_id, "")]
    if not key.admin:
        return [(internal_request_id(key.name, request_id), key.name)]
    store = _KEY_STORE.get()
    assert store is not None  # bound with the caller's key (_as_caller)
    names = dict.fromkeys(k.name for k in store.keys)
    return [(internal_request_id(name, request_id), "") for name in names]


def parse_keys(path: str) -> tuple[ApiKey, ...]:
    """Reads a key file; any malformed line fails with the file's name and the line number (never the secret)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"OPENENGINE_API_KEYS_FILE {path!r} cannot be read: {exc}") from None
    keys: list[ApiKey] = []
    seen: dict[bytes, str] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        fields = line.split()
        if not 3 <= len(fields) <= 3 + len(OPTIONS):
            raise ConfigError(f"{where}: expected {LINE_FORMAT} (3 to {3 + len(OPTIONS)} fields), found {len(fields)}")
        role, name, secret = fields[:3]
        options = _options(fields[3:], where)
        if role not in ROLES:
            raise ConfigError(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if secret.startswith("sha256:"):
            hexdigest = secret[len("sha256:") :]
            if not _HEX_DIGEST.fullmatch(hexdigest):
                raise ConfigError(f"{where}: a sha256: secret must be 64 hexadecimal digits")
            digest = bytes.fromhex(hexdigest)
        else:
            digest = hashlib.sha256(secret.encode()).digest()
        if digest in seen:
            raise ConfigError(f"{where}: the same secret is already the key {seen[digest]!r}")
        seen[digest] = name
        keys.append(ApiKey(role, name, digest, **options))
    if not keys:
        raise ConfigError(f"OPENENGINE_API_KEYS_FILE {path!r} holds no key: every call would be refused")
    return tuple(keys)


MAX_SHARE_WEIGHT = 1000
_GROUP_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _options(fields: list[str], where: str) -> dict:
    """The OPTION=VALUE fields after the secret; a field is never echoed (it may be part of a mistyped secret)."""
    options: dict = {}
    for index, option in enumerate(fields, 4):
        name, _, value = option.partition("=")
        if name not in OPTIONS or not value:
            raise ConfigError(f"{where}: field {index} must be one of {', '.join(o + '=...' for o in OPTIONS)}")
        if name in options:
            raise ConfigError(f"{where}: {name}= is given more than once")
        if name == "cache_group":
            if not _GROUP_NAME.fullmatch(value):
                raise ConfigError(f"{where}: cache_group= must be 1 to 64 of A-Z a-z 0-9 . _ -")
            options[name] = value
            continue
        low = 0 if name == "max_priority" else 1
        high = MAX_SHARE_WEIGHT if name == "share_weight" else INT32_MAX
        if not (value.isascii() and value.isdigit() and low <= int(value) <= high):
            raise ConfigError(f"{where}: {name}=N needs N an integer in [{low}, {high}]")
        options[name] = int(value)
    return options


NAMESPACE_BYTES = 16


def cache_namespace(key: ApiKey | None) -> str:
    """The prefix-cache namespace of a caller's requests: "" with keys off (one namespace, as without keys);
    else a digest of the key's cache group, or of its name. The frontend puts it before the client's
    `cache_salt` (`scoped_cache_salt`), so a client can narrow its namespace but never reach another key's.
    It is a fixed function of the key file: every frontend and worker of a deployment computes the same one
    (no secret to share), so the nodes' caches and prefix routing agree across them."""
    if key is None:
        return ""
    scope = f"group:{key.cache_group}" if key.cache_group else f"key:{key.name}"
    return hashlib.blake2b(scope.encode(), digest_size=NAMESPACE_BYTES, person=b"oe-cache-ns").hexdigest()


def scoped_cache_salt(namespace: str, client_salt: str) -> str:
    """The salt the engine's prefix cache keys on: the caller's namespace, then the client's own salt."""
    return f"{namespace}/{client_salt}" if namespace else client_salt


def priority_refusal(priority: int) -> str | None:
    """Why the current caller may not send `priority` (above its key's max_priority), or None."""
    key = _CALLER.get()
    if key is None or priority <= key.priority_limit:
        return None
    where = "its max_priority in OPENENGINE_API_KEYS_FILE" if key.max_priority is not None else f"role {key.role}"
    return (
        f"metadata openengine-priority {priority} is above the {key.priority_limit} API key {key.name!r} may "
        f"send ({where}); send at most {key.priority_limit}"
    )


class KeyStore:
    """The keys of one file, re-read when the file changes (checked at most every RELOAD_CHECK_S, on use).
    A reload that fails (a malformed or half-written file) keeps the previous keys and logs the reason."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.keys = parse_keys(path)
        self._state = self._file_state()
        self._checked_at = time.monotonic()

    def _file_state(self):
        try:
            st = os.stat(self.path)
            return st.st_ino, st.st_mtime_ns, st.st_size
        except OSError:
            return None

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < RELOAD_CHECK_S:
            return
        self._checked_at = now
        state = self._file_state()
        if state == self._state:
            return
        try:
            keys = parse_keys(self.path)
        except ConfigError as exc:
            log_event(logger, "API key file reload failed; keeping the previous keys", logging.ERROR, error=str(exc))
            return  # _state unchanged: tried again at the next check
        self._state = state
        self.keys = keys
        log_event(logger, "API key file reloaded", path=self.path, keys=len(keys))

    def authenticate(self, secret: str) -> ApiKey | None:
        self._maybe_reload()
        digest = hashlib.sha256(secret.encode()).digest()
        found = None
        for key in self.keys:  # every key is compared: the time does not depend on which one matches
            if hmac.compare_digest(key.digest, digest):
                found = key
        return found


for _reason in (NO_KEY, UNKNOWN_KEY, WRONG_ROLE):  # every reason is a series from the start (0), for rate()
    metrics.AUTH_FAILURES.labels(reason=_reason)


class FailureLog:
    """Refused calls: each counted, and logged at most once per reason every `interval_s` (with how many were
    refused since the last line), so a flood of bad keys cannot flood the log."""

    def __init__(self, interval_s: float = AUTH_FAILURE_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_logged: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def failed(self, reason: str, method: str, peer: str) -> None:
        metrics.AUTH_FAILURES.labels(reason=reason).inc()
        now = time.monotonic()
        last = self._last_logged.get(reason)
        if last is not None and now - last < self.interval_s:
            self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
            return
        self._last_logged[reason] = now
        log_event(
            logger,
            "call refused by the API key check",
            logging.WARNING,
            reason=reason,
            method=method,
            peer=peer,
            refused_since_last_line=self._unlogged.pop(reason, 0),
        )


def bearer_token(metadata) -> str | None:
    for name, value in metadata or ():
        if name == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


_HANDLER_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def handler_kind(handler) -> str:
    return next(k for k in _HANDLER_KINDS if getattr(handler, k) is not None)


def refusal(handler, code: grpc.StatusCode, message: str):
    """The same kind of handler, answering `code`; the request is not even deserialized."""

    async def refuse(request, context):
        await context.abort(code, message)

    return handler._replace(request_deserializer=_skip, **{handler_kind(handler): refuse})


def _skip(_data: bytes) -> None:
    return None


MAX_CACHED_WRAPPERS = 256  # handlers wrapped per method (and key): a bound, should handlers ever be made per call


def cached_wrapper(cache: dict, cache_key, wrap, *args):
    """`wrap(*args)`, built once per `cache_key` (an interceptor's wrapper of a handler, asked for at every call);
    past MAX_CACHED_WRAPPERS entries, or for an unhashable key, built per call."""
    try:
        wrapped = cache.get(cache_key)
    except TypeError:
        return wrap(*args)
    if wrapped is None:
        wrapped = wrap(*args)
        if len(cache) < MAX_CACHED_WRAPPERS:
            cache[cache_key] = wrapped
    return wrapped


def _as_caller(handler, key: ApiKey, store: KeyStore):
    kind = handler_kind(handler)
    behavior = getattr(handler, kind)
    if inspect.isasyncgenfunction(behavior):

        async def bound(request, context):
            _CALLER.set(key)
            _KEY_STORE.set(store)
            async for item in behavior(request, context):
                yield item
    else:

        async def bound(request, context):
            _CALLER.set(key)  # each call runs in its own task: its own copy of the context
            _KEY_STORE.set(store)
            return await behavior(request, context)

    return handler._replace(**{kind: bound})


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, store: KeyStore) -> None:
        self.store = store
        self._bound: dict = {}  # (handler, key) -> the handler bound to that caller
        self.failures = FailureLog()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if not token:
            return self._refused(
                handler,
                NO_KEY,
                method,
                grpc.StatusCode.UNAUTHENTICATED,
                "an API key is required: send the metadata `authorization: Bearer <key>`",
            )
        key = self.store.authenticate(token)
        if key is None:
            return self._refused(
                handler, UNKNOWN_KEY, method, grpc.StatusCode.UNAUTHENTICATED, "the API key is not valid"
            )
        if not key.admin and method not in USER_METHODS:
            return self._refused(
                handler,
                WRONG_ROLE,
                method,
                grpc.StatusCode.PERMISSION_DENIED,
                f"API key {key.name!r} has role user; {method} needs role admin",
            )
        return cached_wrapper(self._bound, (handler, key), _as_caller, handler, key, self.store)

    def _refused(self, handler, reason: str, method: str, code: grpc.StatusCode, message: str):
        """`refusal`, counted and logged (rate-limited) with the caller's address when the call is answered."""
        refuse = refusal(handler, code, message)
        kind = handler_kind(refuse)
        answer = getattr(refuse, kind)

        async def counted(request, context):
            self.failures.failed(reason, method, context.peer())
            await answer(request, context)

        return refuse._replace(**{kind: counted})


def key_store(config) -> KeyStore | None:
    """The keys of OPENENGINE_API_KEYS_FILE (None when keys are off), shared by the gRPC and HTTP APIs."""
    return KeyStore(config.api_keys_file) if config.api_keys_file else None


def interceptors(store: KeyStore | None) -> tuple[ApiKeyInterceptor, ...]:
    """The frontend server's interceptors: the key check when keys are on."""
    return (ApiKeyInterceptor(store),) if store is not None else ()
