"""`openengine-serve up`: the whole stack as child processes on one machine.

Coordinator, N nodes and the frontend each run as their own process, exactly
as in containers; internal ports are picked free unless given, so two stacks
can run side by side. Ctrl-C or SIGTERM stops them in order: frontend first
(it drains), then nodes, then the coordinator.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

from .client import NO_CREDENTIALS, Credentials, is_serving
from .common.lifecycle import bind_address
from .common.net import free_port, port_in_use

STOP_TIMEOUT_S = 40.0
_PR_SET_PDEATHSIG = 1
READY_TIMEOUT_S = 90.0
UP_HTTP_PORT = 8000  # the OpenAI-compatible API's usual port (vLLM's, and llama-server's with --port 8000)


def wait_serving(
    target: str, deadline: float, procs: list[subprocess.Popen], credentials: Credentials = NO_CREDENTIALS
) -> bool:
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        if is_serving(target, credentials=credentials):
            return True
        time.sleep(0.2)
    return False


def component_command(component: str, host: str, port: int, *extra: str, **options: object) -> list[str]:
    """The command line that runs one component as its own process (for `up`, the bench and the tests):
    `python -m openengine_serve <component> --host H --port P`, then each option as `--its-name value`
    (None leaves it out), then `extra` as given."""
    command = [sys.executable, "-m", "openengine_serve", component, "--host", host, "--port", str(port)]
    for name, value in options.items():
        if value is not None:
            command += [f"--{name.replace('_', '-')}", str(value)]
    return command + list(extra)


def up_http_port(args: argparse.Namespace) -> int:
    """--http-port, else OPENENGINE_HTTP_PORT, else UP_HTTP_PORT: `up` serves the HTTP API by default."""
    if args.http_port is not None:
        return args.http_port
    value = os.environ.get("OPENENGINE_HTTP_PORT", "")
    return int(value) if value.isdigit() else UP_HTTP_PORT


def run_stack(args: argparse.Namespace) -> int:
    host = args.host
    coordinator_port = args.coordinator_port or free_port(host)
    coordinator = f"{host}:{coordinator_port}"
    metrics_port = (lambda default: default) if args.metrics else (lambda default: 0)
    plan: list[tuple[str, list[str]]] = [
        ("coordinator", component_command("coordinator", host, coordinator_port, metrics_port=metrics_port(9092)))
    ]
    for i in range(args.nodes):
        port = args.node_port + i if args.node_port else free_port(host)
        node = component_command(
            "node",
            host,
            port,
            node_rank=i,
            coordinator_address=coordinator,
            metrics_port=metrics_port(9093 + i),
            engine=args.engine or None,
            model_path=args.model_path[min(i, len(args.model_path) - 1)] if args.model_path else None,
        )
        plan.append((f"node-{i}", node))
    http_port = up_http_port(args)
    security = public_security(args)
    frontend = component_command(
        "frontend",
        host,
        args.port,
        *security.frontend_flags,
        coordinator_address=coordinator,
        metrics_port=metrics_port(9091),
        grpc_server=args.grpc_server or None,
        workers=args.workers or None,
        http_port=http_port,
    )
    plan.append(("frontend", frontend))
    fixed = {"--port": args.port, "--http-port": http_port, "--coordinator-port": args.coordinator_port}
    fixed |= {f"--node-port (node {i})": args.node_port + i for i in range(args.nodes) if args.node_port}
    if args.metrics:
        fixed |= {"--metrics (frontend)": 9091, "--metrics (coordinator)": 9092}
        fixed |= {f"--metrics (node {i})": 9093 + i for i in range(args.nodes)}
    busy = [f"{port} ({flag})" for flag, port in fixed.items() if port and port_in_use(host, port)]
    if busy:
        print(
            f"openengine-serve up: port(s) already in use on {host}: {', '.join(busy)}; another stack or program "
            "listens there: stop it, or choose other ports with the options named",
            file=sys.stderr,
        )
        return 1

    procs: dict[str, subprocess.Popen] = {}
    stop_requested = False

    def on_signal(signum, _frame):
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    exit_code = 0
    try:
        for name, command in plan:
            # Own process group: a Ctrl-C in the terminal reaches `up` only, which then stops children in order.
            procs[name] = subprocess.Popen(command, start_new_session=True, preexec_fn=stop_with_parent)
        public = f"{host}:{args.port}"
        if not wait_serving(public, time.monotonic() + READY_TIMEOUT_S, list(procs.values()), security.check):
            dead = [f"{n} (exit {p.returncode})" for n, p in procs.items() if p.poll() is not None]
            print(
                f"openengine-serve up: the stack did not become ready: {', '.join(dead) or 'timed out'}",
                file=sys.stderr,
            )
            return 1
        scheme = "https" if security.tls else "http"
        http = f"; OpenAI-compatible API on {scheme}://{bind_address(host, http_port)}/v1" if http_port else ""
        print(
            f"OpenEngine frontend ready on {public}{http}{security.describe()}  (coordinator {coordinator}, "
            f"{args.nodes} node(s)); Ctrl-C stops the stack",
            flush=True,
        )
        while not stop_requested:
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead:
                print(f"openengine-serve up: {', '.join(dead)} exited; stopping the stack", file=sys.stderr)
                exit_code = 1
                break
            time.sleep(0.2)
    finally:
        stop_all(procs)
    return exit_code


def stop_with_parent() -> None:
    """A `preexec_fn`: SIGTERM to the child when the thread that started it dies, however it dies (Linux
    PR_SET_PDEATHSIG), so a killed `up` (or benchmark) leaves nothing it started running. Start children from the
    main thread."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class PublicSecurity:
    """`up`'s TLS and API key settings: flags (or OPENENGINE_* variables) for the frontend, and the credentials
    of its own readiness check (health needs no key; TLS is verified with --tls-ca-file, by default the
    frontend's own certificate, which is right for a self-signed one)."""

    def __init__(
        self, cert: str, key: str, client_ca: str, keys_file: str, ca: str, client_cert: str, client_key: str
    ) -> None:
        self.frontend_flags = [
            flag
            for name, value in (
                ("--tls-cert-file", cert),
                ("--tls-key-file", key),
                ("--tls-client-ca-file", client_ca),
                ("--api-keys-file", keys_file),
            )
            if value
            for flag in (name, value)
        ]
        self.tls, self.mutual, self.keys = bool(cert), bool(client_ca), bool(keys_file)
        self.check = (
            Credentials(ca_file=ca or cert, cert_file=client_cert, key_file=client_key) if cert else NO_CREDENTIALS
        )

    def describe(self) -> str:
        parts = [p for p, on in (("TLS", self.tls), ("mutual TLS", self.mutual), ("API key required", self.keys)) if on]
        return f" ({', '.join(parts)})" if parts else ""


def public_security(args: argparse.Namespace) -> PublicSecurity:
    def setting(flag: str, variable: str) -> str:
        return getattr(args, flag, "") or os.environ.get(variable, "")

    return PublicSecurity(
        setting("tls_cert_file", "OPENENGINE_TLS_CERT_FILE"),
        setting("tls_key_file", "OPENENGINE_TLS_KEY_FILE"),
        setting("tls_client_ca_file", "OPENENGINE_TLS_CLIENT_CA_FILE"),
        setting("api_keys_file", "OPENENGINE_API_KEYS_FILE"),
        getattr(args, "tls_ca_file", ""),
        getattr(args, "client_cert_file", ""),
        getattr(args, "client_key_file", ""),
    )


def stop_all(procs: dict[str, subprocess.Popen]) -> None:
    """Frontend first (drains open streams), then nodes, then the coordinator."""
    order = ["frontend"] + [n for n in procs if n.startswith("node-")] + ["coordinator"]
    for group in (order[:1], order[1:-1], order[-1:]):
        running = [procs[n] for n in group if n in procs and procs[n].poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
