"""`openengine-serve`: start the stack or one component, and talk to a running frontend."""

from __future__ import annotations

import argparse
import signal
import sys

from .client_args import add_credential_arguments, credentials, uses_tls
from .common.extras import DependencyError, require_extra

# Imports stay inside the commands: `health` runs every few seconds in every container and must start fast
# (tests/unit/test_health_check.py checks what it imports).


def _component(name: str):
    def run(args: argparse.Namespace) -> int:
        require_extra(name, name)
        from .common import config as cfg

        config_cls = cfg.COMPONENT_CONFIGS[name]
        config = cfg.load(config_cls, args)
        from .common.tls import check_internal_tls

        check_internal_tls(config)  # security hook: exit 2 at start on incomplete or unreadable internal TLS files
        # COMPONENT_CONFIGS[name] is the component's own config class: the isinstance checks only narrow the type.
        if name == "frontend":
            from .frontend.supervisor import run_frontend

            assert isinstance(config, cfg.FrontendConfig)
            return run_frontend(config)
        from .common.lifecycle import run_component

        if name == "coordinator":
            from .coordinator.server import serve as serve_coordinator

            assert isinstance(config, cfg.CoordinatorConfig)
            return run_component(config, lambda stop: serve_coordinator(config, stop))
        from .node.server import serve as serve_node

        assert isinstance(config, cfg.NodeConfig)
        return run_component(config, lambda stop: serve_node(config, stop))

    return run


def _up(args: argparse.Namespace) -> int:
    require_extra("up", "all")
    from .local import run_stack

    return run_stack(args)


def _quiet_broken_pipe() -> None:
    """`openengine-serve info | head` ends quietly. Only for printing commands: servers must keep SIGPIPE
    ignored (Python's default), or a peer closing a socket would kill them."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def add_up_security_arguments(up: argparse.ArgumentParser) -> None:
    for flag, what in (
        ("--tls-cert-file", "frontend TLS certificate [OPENENGINE_TLS_CERT_FILE]"),
        ("--tls-key-file", "its key [OPENENGINE_TLS_KEY_FILE]"),
        ("--tls-client-ca-file", "require client certificates this CA signed [OPENENGINE_TLS_CLIENT_CA_FILE]"),
        ("--api-keys-file", "API key file [OPENENGINE_API_KEYS_FILE]"),
        ("--tls-ca-file", "CA `up` verifies the frontend with (default: --tls-cert-file)"),
        ("--client-cert-file", "client certificate of `up`'s readiness check (mutual TLS)"),
        ("--client-key-file", "its key"),
    ):
        up.add_argument(flag, default="", help=what)


def _generate(args: argparse.Namespace) -> int:
    _quiet_broken_pipe()
    import uuid

    import grpc

    from .api.openengine.v1 import generation_pb2
    from .chat import ChatTemplateError, render_chat
    from .client import Client, served_model

    with Client(args.target, credentials=credentials(args)) as client:
        model_name, prompt = args.model, args.prompt
        if args.chat or not model_name:  # the server's model (and its chat template)
            try:
                model = served_model(client, model_name, timeout=args.timeout)
            except grpc.RpcError as exc:
                print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 2
            model_name = model.served_model_name
            if args.chat:
                try:
                    prompt = render_chat(model, args.prompt, system=args.system)
                except ChatTemplateError as exc:
                    print(f"error: --chat: {exc}", file=sys.stderr)
                    return 2
        request = generation_pb2.GenerateRequest(
            request_id=args.request_id or f"cli-{uuid.uuid4()}", model=model_name, prompt=prompt
        )
        if args.max_tokens is not None:
            request.stopping.max_tokens = args.max_tokens
        if args.ignore_eos:
            request.stopping.ignore_eos = True
        if args.seed is not None:
            request.sampling.seed = args.seed
        if args.temperature is not None:
            request.sampling.temperature = args.temperature
        for stop in args.stop:
            request.stopping.conditions.add(stop_text=stop)
        if args.json_schema:
            try:
                with open(args.json_schema, encoding="utf-8") as schema:
                    request.guided.json_schema = schema.read()
            except OSError as exc:
                print(f"error: --json-schema: cannot read {args.json_schema}: {exc.strerror}", file=sys.stderr)
                return 2
        elif args.regex:
            request.guided.regex = args.regex
        elif args.choice:
            request.guided.choice.choices.extend(args.choice)
        if args.lora:
            request.lora_name = args.lora
        return _print_stream(client, request, args.timeout)


def _print_stream(client, request, timeout: float) -> int:
    import grpc

    from .api.openengine.v1 import generation_pb2

    line_open = False  # streamed text not yet ended by a newline: an error message starts on its own line

    try:
        for response in client.generate(request, timeout=timeout):
            event = response.WhichOneof("event")
            if event == "token":
                sys.stdout.write(response.token.text)
                sys.stdout.flush()
                line_open = line_open or bool(response.token.text)
            elif event == "finished":
                sys.stdout.write("\n")
                line_open = False
                reason = generation_pb2.FinishReason.Name(response.finished.reason)
                print(f"[finished output={response.finished.output_index} reason={reason}]", file=sys.stderr)
            elif event == "error":
                print(
                    ("\n" if line_open else "") + f"[error code={response.error.code} "
                    f"retryable={response.error.retryable}] {response.error.message}",
                    file=sys.stderr,
                )
                return 1
            if response.HasField("usage"):
                u = response.usage
                print(
                    f"[usage prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens} "
                    f"total_tokens={u.total_tokens}]",
                    file=sys.stderr,
                )
    except grpc.RpcError as exc:
        print(("\n" if line_open else "") + f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    return 0


def _info(args: argparse.Namespace) -> int:
    _quiet_broken_pipe()
    import grpc
    from google.protobuf import text_format

    from .api.openengine.v1 import model_pb2, server_pb2
    from .client import Client

    with Client(args.target, credentials=credentials(args)) as client:
        try:
            server = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=args.timeout)
            model = client.control.GetModelInfo(
                model_pb2.GetModelInfoRequest(model=server.supported_models[0]), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    print("# ServerInfo\n" + text_format.MessageToString(server))
    print("# ModelInfo\n" + text_format.MessageToString(model))
    return 0


def _lora(args: argparse.Namespace) -> int:
    """LoadLora, UnloadLora or ListLoras; prints the adapters as ListLoras names them."""
    import grpc

    from .api.openengine.v1 import lora_pb2
    from .client import Client

    with Client(args.target, credentials=credentials(args)) as client:
        try:
            if args.action == "load":
                adapter = lora_pb2.LoraAdapter(lora_name=args.name, source_path=args.file)
                loaded = client.control.LoadLora(lora_pb2.LoadLoraRequest(adapter=adapter), timeout=args.timeout)
                adapters = [loaded.adapter]
            elif args.action == "unload":
                request = lora_pb2.UnloadLoraRequest(lora_name=args.name)
                adapters = [client.control.UnloadLora(request, timeout=args.timeout).adapter]
            else:
                adapters = list(client.control.ListLoras(lora_pb2.ListLorasRequest(), timeout=args.timeout).adapters)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    for adapter in adapters:
        print(f"{adapter.lora_name}\tid={adapter.lora_id}\t{adapter.source_path}")
    return 0


def _health(args: argparse.Namespace) -> int:
    """A standard-library Check first (health_check.py); grpcio only when that gets no well-formed answer, or
    for TLS (the standard-library probe speaks h2c only)."""
    from .common import health_check

    status = _health_grpcio(args) if uses_tls(args) else _health_standard_library(args)
    if status is None:
        return 1
    print(f"{args.service}: {health_check.status_name(status)}")
    return 0 if status == health_check.SERVING else 1


def _health_standard_library(args: argparse.Namespace) -> int | None:
    from .common import health_check

    try:
        return health_check.check(args.target, args.service, args.timeout)
    except TimeoutError:
        print(f"{args.service}: UNREACHABLE (DEADLINE_EXCEEDED: no answer within {args.timeout:g} s)")
        return None
    except health_check.ProbeInconclusive:
        return _health_grpcio(args)
    except OSError as exc:
        print(f"{args.service}: UNREACHABLE (UNAVAILABLE: {exc.strerror or exc})")
        return None


def _health_grpcio(args: argparse.Namespace) -> int | None:
    import grpc

    from .client import check_health

    try:
        return check_health(args.target, args.service, args.timeout, credentials(args))
    except grpc.RpcError as exc:
        print(f"{args.service}: UNREACHABLE ({exc.code().name}: {exc.details()})")
        return None


HEALTH_HELP = "grpc.health.v1 check: exit 0 when SERVING, 1 otherwise"


def _add_health_arguments(health: argparse.ArgumentParser) -> argparse.ArgumentParser:
    health.add_argument("--target", default="127.0.0.1:50051")
    health.add_argument("--service", default="readiness", help="liveness | readiness | a service name")
    health.add_argument("--timeout", type=float, default=3.0)
    add_credential_arguments(health)
    health.set_defaults(func=_health)
    return health


def build_parser() -> argparse.ArgumentParser:
    from .common import config as cfg

    parser = argparse.ArgumentParser(prog="openengine-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run coordinator, nodes and frontend on this machine (Ctrl-C stops all)")
    up.add_argument("--port", type=int, default=50051, help="public frontend port (default 50051)")
    up.add_argument("--host", default="127.0.0.1", help="address every component binds (default 127.0.0.1)")
    up.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    up.add_argument(
        "--grpc-server",
        choices=cfg.GRPC_SERVERS,
        default=None,
        help="frontend gRPC server [OPENENGINE_GRPC_SERVER, default grpcio]",
    )
    up.add_argument("--workers", type=int, default=None, help="frontend worker processes [OPENENGINE_FRONTEND_WORKERS]")
    up.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="OpenAI-compatible HTTP API port, 0 = off [OPENENGINE_HTTP_PORT, default 8000 in `up`]",
    )
    up.add_argument(
        "--engine",
        choices=cfg.ENGINES,
        default=None,
        help="the nodes' engine [OPENENGINE_ENGINE, default llama.cpp: SmolLM2-135M-Instruct, or "
        "OPENENGINE_MODEL_PATH]",
    )
    up.add_argument(
        "--model-path",
        action="append",
        default=[],
        metavar="GGUF",
        help="llama.cpp: a GGUF model for node 0, again for node 1 and so on (the last one for the nodes after); "
        "nodes of different models serve each under its own name [default OPENENGINE_MODEL_PATH, or SmolLM2]",
    )
    up.add_argument("--coordinator-port", type=int, default=0, help="default: a free port")
    up.add_argument(
        "--node-port", type=int, default=0, help="first node's port, further nodes count up (default: free ports)"
    )
    up.add_argument("--metrics", action="store_true", help="serve metrics on 9091/9092/9093+ instead of off")
    add_up_security_arguments(up)
    up.set_defaults(func=_up)

    for name, config_cls in cfg.COMPONENT_CONFIGS.items():
        p = sub.add_parser(name, help=f"run the {name} (what its container image runs)")
        cfg.add_arguments(p, config_cls)
        p.set_defaults(func=_component(name))

    gen = sub.add_parser("generate", help="stream one generation to stdout; usage and finish reason to stderr")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--prompt", required=True)
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message in the model's chat template (from ModelInfo)",
    )
    gen.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    gen.add_argument("--model", default=None, help="served model name (default: the first the server names)")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None, help="0: greedy (default: the server's, 1.0)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    guide = gen.add_mutually_exclusive_group()
    guide.add_argument("--json-schema", metavar="FILE", help="structured output: a JSON Schema the answer follows")
    guide.add_argument("--regex", help="structured output: a regular expression the whole answer matches")
    guide.add_argument("--choice", action="append", default=[], help="structured output: one of these (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--lora", default=None, metavar="NAME", help="a LoRA adapter loaded with `lora load`")
    gen.add_argument("--request-id", default=None)
    gen.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="deadline of the whole call in seconds, retries included (default 300)",
    )
    add_credential_arguments(gen)
    gen.set_defaults(func=_generate)

    info = sub.add_parser("info", help="print ServerInfo and ModelInfo")
    info.add_argument("--target", default="127.0.0.1:50051")
    info.add_argument("--timeout", type=float, default=10.0)
    add_credential_arguments(info)
    info.set_defaults(func=_info)

    lora = sub.add_parser("lora", help="load, unload or list the deployment's LoRA adapters (an admin's calls)")
    lora.set_defaults(func=_lora)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default="127.0.0.1:50051")
    common.add_argument("--timeout", type=float, default=120.0)
    add_credential_arguments(common)
    actions = lora.add_subparsers(dest="action", required=True)
    load = actions.add_parser("load", parents=[common], help="load an adapter on every node (LoadLora)")
    load.add_argument("name", help="the name requests use (lora_name)")
    load.add_argument("file", help="the adapter's GGUF file, in the nodes' OPENENGINE_LORA_DIR")
    actions.add_parser("unload", parents=[common], help="unload an adapter (UnloadLora)").add_argument("name")
    actions.add_parser("list", parents=[common], help="the adapters loaded (ListLoras)")

    _add_health_arguments(sub.add_parser("health", help=HEALTH_HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["health"]:  # without the other commands' imports (config, grpc)
        parser = _add_health_arguments(argparse.ArgumentParser(prog="openengine-serve health", description=HEALTH_HELP))
        return _health(parser.parse_args(argv[1:]))
    from .common import config as cfg

    if argv[:1] and argv[0] in cfg.COMPONENT_CONFIGS:
        from .common.grpc_core import configure_grpc_core

        configure_grpc_core(argv[0])

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (cfg.ConfigError, DependencyError) as exc:
        print(f"openengine-serve: error: {exc}", file=sys.stderr)
        return 2
