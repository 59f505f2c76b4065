"""`openengine-serve up`: the whole stack as child processes on one machine.

Coordinator, N nodes and the frontend each run as their own process, exactly
as in containers; internal ports are picked free unless given, so two stacks
can run side by side. Ctrl-C or SIGTERM stops them in order: frontend first
(it drains), then nodes, then the coordinator.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from .client import is_serving
from .common.net import free_port

STOP_TIMEOUT_S = 40.0
READY_TIMEOUT_S = 90.0


def wait_serving(target: str, deadline: float, procs: list[subprocess.Popen]) -> bool:
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        if is_serving(target):
            return True
        time.sleep(0.2)
    return False


def run_stack(args: argparse.Namespace) -> int:
    host = args.host
    coordinator_port = args.coordinator_port or free_port(host)
    coordinator = f"{host}:{coordinator_port}"
    metrics_port = (lambda default: default) if args.metrics else (lambda default: 0)
    python = [sys.executable, "-m", "openengine_serve"]
    common = ["--host", host]
    plan: list[tuple[str, list[str]]] = [
        ("coordinator", python + ["coordinator", *common, "--port", str(coordinator_port),
                                  "--metrics-port", str(metrics_port(9092))])]
    for i in range(args.nodes):
        port = args.node_port + i if args.node_port else free_port(host)
        plan.append((f"node-{i}", python + ["node", *common, "--port", str(port), "--node-rank", str(i),
                                            "--coordinator-address", coordinator,
                                            "--metrics-port", str(metrics_port(9093 + i))]))
    frontend = python + ["frontend", *common, "--port", str(args.port), "--coordinator-address", coordinator,
                         "--metrics-port", str(metrics_port(9091))]
    if args.grpc_server:
        frontend += ["--grpc-server", args.grpc_server]
    if args.workers:
        frontend += ["--workers", str(args.workers)]
    plan.append(("frontend", frontend))

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
            procs[name] = subprocess.Popen(command, start_new_session=True)
        public = f"{host}:{args.port}"
        if not wait_serving(public, time.monotonic() + READY_TIMEOUT_S, list(procs.values())):
            dead = [f"{n} (exit {p.returncode})" for n, p in procs.items() if p.poll() is not None]
            print(f"openengine-serve up: the stack did not become ready: {', '.join(dead) or 'timed out'}",
                  file=sys.stderr)
            return 1
        print(f"OpenEngine frontend ready on {public}  (coordinator {coordinator}, {args.nodes} node(s)); "
              f"Ctrl-C stops the stack", flush=True)
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
